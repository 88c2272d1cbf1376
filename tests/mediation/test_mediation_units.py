"""Mediation pieces that need no server: markers, modes, repair policy, schema versions, telemetry, import."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from pydantic import BaseModel

from corral.mediation import (
    Capabilities,
    FailureClass,
    JsonlSink,
    Mode,
    OutputSchema,
    Reliability,
    RepairPolicy,
    RoundRecord,
    SchemaVersion,
    choose_mode,
    extract_block,
)
from corral.mediation.failures import Failure
from corral.mediation.markers import MarkerError
from corral.mediation.modes import OPENAI, PLAIN, degrade

REPO = Path(__file__).resolve().parents[2]


def test_imports_without_torch_transformers_or_server() -> None:
    # Poison the heavy modules: importing one of them raises, so the package must not touch them.
    code = (
        "import sys\n"
        "for name in ('torch', 'transformers', 'xgrammar', 'llguidance', 'corral.server', 'corral.samplers',\n"
        "             'corral.grammars'):\n"
        "    sys.modules[name] = None\n"
        "import corral.mediation, corral.mediation.mediator, corral.mediation.telemetry\n"
        "heavy = ('torch', 'transformers', 'fastapi', 'corral.server', 'corral.samplers', 'corral.grammars')\n"
        "print(sorted(m for m, mod in sys.modules.items()\n"
        "             if mod is not None and any(m == h or m.startswith(h + '.') for h in heavy)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("text", "payload"),
    [
        ('BEGIN_DISPATCH_RESULT\n{"a": 1}\nEND_DISPATCH_RESULT', '{"a": 1}'),
        ('  \nBEGIN_DISPATCH_RESULT {"a": 1} END_DISPATCH_RESULT\n\n', '{"a": 1}'),
    ],
)
def test_marker_block_is_extracted(text: str, payload: str) -> None:
    assert extract_block(text) == payload


@pytest.mark.parametrize(
    "text",
    [
        '{"a": 1}',  # no markers
        'Sure! BEGIN_DISPATCH_RESULT {"a": 1} END_DISPATCH_RESULT',  # prose before
        'BEGIN_DISPATCH_RESULT {"a": 1} END_DISPATCH_RESULT thanks',  # prose after
        "BEGIN_DISPATCH_RESULT {} END_DISPATCH_RESULT BEGIN_DISPATCH_RESULT {} END_DISPATCH_RESULT",  # two blocks
        'BEGIN_DISPATCH_RESULT {"a": 1}',  # unterminated
    ],
)
def test_marker_contract_violations_are_refused(text: str) -> None:
    with pytest.raises(MarkerError):
        extract_block(text)


def test_modes_degrade_deterministically_by_capability() -> None:
    corral = Capabilities(json_schema=True, json_object=True, lark_json=True, logprobs=True,
                          grammar_backend="llguidance")
    assert choose_mode(corral, markers=True) is Mode.SCHEMA_CONSTRAINED
    assert choose_mode(OPENAI, markers=False) is Mode.SCHEMA_CONSTRAINED
    # OpenAI-style providers cannot put markers into a constraint: straight to contract_only.
    assert choose_mode(OPENAI, markers=True) is Mode.CONTRACT_ONLY
    assert choose_mode(Capabilities(json_object=True), markers=False) is Mode.JSON_MODE
    assert choose_mode(PLAIN, markers=False) is Mode.CONTRACT_ONLY
    assert choose_mode(corral, markers=False, preferred=Mode.JSON_MODE) is Mode.JSON_MODE
    assert degrade(Mode.SCHEMA_CONSTRAINED, corral, markers=True) is Mode.JSON_MODE
    assert degrade(Mode.SCHEMA_CONSTRAINED, OPENAI, markers=True) is Mode.CONTRACT_ONLY
    assert degrade(Mode.CONTRACT_ONLY, corral, markers=False) is None


def test_capabilities_from_corral_document() -> None:
    doc = {"constraint_kinds": ["json_schema", "json_object", "lark"], "backends": ["xgrammar", "llguidance"],
           "logprobs": True}
    caps = Capabilities.from_corral(doc)
    assert caps.lark_json and caps.json_schema and caps.json_object and caps.grammar_backend == "llguidance"
    assert not Capabilities.from_corral({**doc, "backends": ["xgrammar"]}).lark_json


def _f(cls: FailureClass) -> Failure:
    return Failure(cls, "x")


def test_repair_policy_repairs_semantic_and_fails_fast_on_structure() -> None:
    policy = RepairPolicy(max_attempts=3, structural_retries=1)
    semantic, parse = _f(FailureClass.SEMANTIC_INVALID), _f(FailureClass.JSON_PARSE_FAILED)
    assert policy.next_round([semantic]) and policy.next_round([semantic, semantic])
    assert not policy.next_round([semantic, semantic, semantic])  # budget spent
    assert policy.next_round([parse])  # one structural retry (003)...
    assert not policy.next_round([parse, _f(FailureClass.SCHEMA_INVALID)])  # ...then terminal
    assert not RepairPolicy(structural_retries=0).next_round([parse])
    assert not policy.next_round([_f(FailureClass.PROVIDER_ERROR)])
    assert policy.next_round([_f(FailureClass.MODE_UNSUPPORTED)])  # degrade, not a retry
    with pytest.raises(ValueError):
        RepairPolicy(max_attempts=0)


class Point(BaseModel):
    x: int
    y: int


def test_versioned_schema_accepts_old_version_until_cutoff() -> None:
    v1 = {"type": "object", "properties": {"pos": {"type": "array", "items": {"type": "integer"}}},
          "required": ["pos"]}
    cutoff = datetime(2030, 1, 1, tzinfo=UTC)
    out = OutputSchema.from_model(Point, version="v2", previous=[
        SchemaVersion("v1", v1, accepted_until=cutoff, upgrade=lambda v: {"x": v["pos"][0], "y": v["pos"][1]})])
    current = out.check({"x": 1, "y": 2})
    assert (current.version, current.value) == ("v2", {"x": 1, "y": 2})
    old = out.check({"pos": [3, 4]}, now=cutoff - timedelta(days=1))
    assert (old.version, out.parse(old.value)) == ("v1", Point(x=3, y=4))
    late = out.check({"pos": [3, 4]}, now=cutoff)
    assert late.version is None and late.error and late.path == "/"


def test_dynamic_enum_is_an_object_every_mode_can_carry() -> None:
    out = OutputSchema.dynamic_enum(["agent-a", "agent-b", "agent-a"])
    assert out.schema["properties"]["choice"]["enum"] == ["agent-a", "agent-b"]
    assert out.parse(out.check({"choice": "agent-b"}).value) == "agent-b"
    assert out.check({"choice": "agent-c"}).version is None
    with pytest.raises(ValueError):
        OutputSchema.dynamic_enum([])


def _round(provider: str, failure: str | None, **checks: bool) -> RoundRecord:
    return RoundRecord(provider, "m", "json_mode", "s", "v1" if failure is None else None, 1, failure, "stop",
                       10, 5, 1.0, checks=checks)


def test_reliability_is_an_ewma_per_provider_and_failure_class() -> None:
    rel = Reliability(alpha=0.5)
    rel.record(_round("p", None))
    assert rel.rate("p", "success") == 1.0 and rel.rate("p", FailureClass.TRUNCATED) == 0.0
    rel.record(_round("p", "truncated"))
    rel.record(_round("q", "schema_invalid"))
    assert rel.rate("p", "success") == 0.5 and rel.rate("p", FailureClass.TRUNCATED) == 0.5
    assert rel.rate("q", FailureClass.SCHEMA_INVALID) == 1.0 and rel.rate("q", "success") == 0.0
    assert rel.rate("r", "success") is None
    assert set(rel.snapshot()) == {"p", "q"}


def test_jsonl_export_carries_verifiable_rewards(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "rounds.jsonl")
    sink.record(_round("p", None, json=True, schema=True, positive=True))
    sink.record(_round("p", "semantic_invalid", json=True, schema=True, positive=False))
    sink.record(_round("p", "json_parse_failed", json=False))
    rows = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert [r["reward"] for r in rows] == [1.0, 0.6, 0.0]
    assert rows[1]["checks"] == {"json": True, "schema": True, "positive": False}
    assert rows[1]["failure_class"] == "semantic_invalid"
