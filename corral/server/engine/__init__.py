"""The decode loop: Scheduler (who runs), ModelRunner (the model and KV cache), Sequence (plain state)."""

from corral.server.engine.engine import Engine, EngineConfig
from corral.server.engine.loop import EngineLoop
from corral.server.engine.sampling import SamplingParams
from corral.server.engine.sequence import SeqOutput, Sequence
from corral.server.engine.step_watchdog import StepWatchdog

__all__ = ["Engine", "EngineConfig", "EngineLoop", "SamplingParams", "SeqOutput", "Sequence", "StepWatchdog"]
