"""`corral bench kinds` runs end to end, measures every backend on the same path, and refuses bad arguments."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from conftest import run_bench

from corral.benchmarks.kinds.cases import CASES
from corral.benchmarks.kinds.runner import measure_case
from corral.grammar_engines.protocol import TokenizerSpec
from corral.grammar_engines.registry import BackendSet
from corral.grammars.spec import GrammarKind


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return run_bench("kinds", *args)


def test_kinds_bench_writes_a_row_per_case_and_backend(tmp_path: Path) -> None:
    done = _bench("--cases", "choices", "--rounds", "2", "--batch", "2", "--walk-tokens", "4", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    payload = json.loads((tmp_path / "results.json").read_text())
    labels = [c.label for c in CASES if "choices" in c.label]
    assert [(r["case"], r["backend"]) for r in payload["results"]] == [
        (label, backend) for label in labels for backend in ("xgrammar", "llguidance")
    ]
    assert all(r["error"] is None and r["fill_us"] > 0 and r["batch_step_us"] > 0 for r in payload["results"])
    assert {r["auto"] for r in payload["results"]} == {"xgrammar"}
    assert (tmp_path / "kinds.png").stat().st_size > 0


def test_every_kind_the_routing_rule_covers_has_cases() -> None:
    assert {c.spec.kind for c in CASES} == {GrammarKind.REGEX, GrammarKind.EBNF, GrammarKind.LARK, GrammarKind.CHOICE}
    assert len({c.label for c in CASES}) == len(CASES)


def test_both_backends_walk_the_same_answer(tokenizer: TokenizerSpec) -> None:
    case = next(c for c in CASES if c.label == "date")
    rows = measure_case(BackendSet(tokenizer, ["xgrammar", "llguidance"]), case, rounds=2, batch=2, walk_tokens=8)
    assert [r.backend for r in rows] == ["xgrammar", "llguidance"]
    assert all(r.error is None and r.tokens == rows[0].tokens and len(r.rounds) == 2 for r in rows)
    assert all(r.walk_us is not None and r.walk_us > 0 for r in rows)


def test_kinds_bench_refuses_bad_arguments(tmp_path: Path) -> None:
    done = _bench("--rounds", "1", "--out", str(tmp_path))
    assert done.returncode == 2 and "--rounds" in done.stdout
    done = _bench("--cases", "no such case", "--out", str(tmp_path))
    assert done.returncode == 2 and "no case label" in done.stdout
