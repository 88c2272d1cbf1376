"""Client-side mediation (issue 10): typed, validated results from any OpenAI-compatible server, with
bounded repair, capability-aware modes, the dispatch marker contract and per-round telemetry.

Needs only the openai SDK, pydantic, jsonschema and httpx: no torch, nothing from corral's server."""

from corral.mediation.failures import Failure, FailureClass, MediationError
from corral.mediation.judging import Usage
from corral.mediation.markers import BEGIN, END, extract_block
from corral.mediation.mcp_results import ToolOutcome, finish_tool_result, verified
from corral.mediation.mediator import Mediated, Mediator
from corral.mediation.modes import Capabilities, Mode, choose_mode, fetch_corral_capabilities
from corral.mediation.repair import Escalation, RepairPolicy
from corral.mediation.schemas import OutputSchema, SchemaVersion
from corral.mediation.telemetry import JsonlSink, MemorySink, Reliability, RoundRecord, Sink
from corral.mediation.validators import Rule, SemanticValidator, Violation

__all__ = [
    "BEGIN",
    "END",
    "Capabilities",
    "Escalation",
    "Failure",
    "FailureClass",
    "JsonlSink",
    "Mediated",
    "MediationError",
    "Mediator",
    "MemorySink",
    "Mode",
    "OutputSchema",
    "Reliability",
    "RepairPolicy",
    "RoundRecord",
    "Rule",
    "SchemaVersion",
    "SemanticValidator",
    "Sink",
    "ToolOutcome",
    "Usage",
    "Violation",
    "choose_mode",
    "extract_block",
    "fetch_corral_capabilities",
    "finish_tool_result",
    "verified",
]
