"""The decode loop: Scheduler (who runs), ModelRunner (the model and KV cache), Sequence (plain state)."""

from server.engine.engine import Engine, EngineConfig
from server.engine.loop import EngineLoop
from server.engine.sampling import SamplingParams
from server.engine.sequence import SeqOutput, Sequence
from server.engine.step_watchdog import StepWatchdog

__all__ = ["Engine", "EngineConfig", "EngineLoop", "SamplingParams", "SeqOutput", "Sequence", "StepWatchdog"]
