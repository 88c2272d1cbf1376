"""Client-side mediation (issue 10): typed, validated results from any OpenAI-compatible server, with
bounded repair, capability-aware modes, the dispatch marker contract and per-round telemetry.

Needs only the openai SDK, pydantic, jsonschema and httpx: no torch, nothing from corral's server."""

from mediation.failures import Failure, FailureClass, MediationError
from mediation.markers import BEGIN, END, extract_block
from mediation.mcp_results import ToolOutcome, finish_tool_result, verified
from mediation.mediator import Mediated, Mediator, Usage
from mediation.modes import Capabilities, Mode, choose_mode, fetch_corral_capabilities
from mediation.repair import Escalation, RepairPolicy
from mediation.schemas import OutputSchema, SchemaVersion
from mediation.telemetry import JsonlSink, MemorySink, Reliability, RoundRecord, Sink
from mediation.validators import Rule, SemanticValidator, Violation

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
