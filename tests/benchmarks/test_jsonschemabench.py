"""JSONSchemaBench CLI: each metric on hand-made schemas whose right answers are known by hand."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from corral.benchmarks.jsonschemabench.compile_timeout import CompileStatus, compile_with_timeout
from corral.benchmarks.jsonschemabench.conformance import UNLABELLED, failing_keyword, validate_generated
from corral.benchmarks.jsonschemabench.dataset import load_case, sample_names
from corral.benchmarks.jsonschemabench.masks import MaskContext, encode_instances, run_masks, serializations
from corral.benchmarks.jsonschemabench.report import ALL, finish_table, summarize_generate, summarize_masks
from corral.grammar_engines import registry
from corral.grammar_engines.protocol import TokenizerSpec
from corral.grammar_engines.registry import BackendSet
from corral.grammars.spec import GrammarSpec

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "tests" / "data" / "jsonschemabench_sample"

OBJECT_A = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}


def write_case(root: Path, subset: str, name: str, schema: Any, tests: list[tuple[Any, bool]]) -> Path:
    folder = root / subset
    folder.mkdir(parents=True, exist_ok=True)
    body = {"description": name, "meta": {}, "schema": schema,
            "tests": [{"description": f"t{i}", "valid": ok, "data": data} for i, (data, ok) in enumerate(tests)]}
    path = folder / f"{name}.json"
    path.write_text(json.dumps(body), encoding="utf-8")
    return path


def masks_record(tmp_path: Path, backends: BackendSet, tokenizer: TokenizerSpec, schema: Any,
                 tests: list[tuple[Any, bool]], backend: str, timeout_s: float = 10.0) -> dict[str, Any]:
    case = load_case(write_case(tmp_path, "S", "case", schema, tests), "S")
    ctx = MaskContext(backends, tokenizer, timeout_s)
    return run_masks(ctx, case, backend, encode_instances(case, tokenizer))


# -- data selection and serialization -------------------------------------------------------------------

def test_limit_takes_evenly_spaced_sorted_names() -> None:
    names = [f"{i:02d}.json" for i in range(10)][::-1]
    assert sample_names(names, 3) == ["00.json", "03.json", "06.json"]
    assert sample_names(names, None) == sorted(names)
    assert sample_names(names, 50) == sorted(names)


def test_instances_are_compact_with_corral_separators_sorted_keys_first() -> None:
    assert serializations({"b": [1, 2], "a": "é"}) == ['{"a": "é", "b": [1, 2]}', '{"b": [1, 2], "a": "é"}']
    assert serializations([1, {"x": None}]) == ['[1, {"x": null}]']
    # Given the schema: also the order the engines emit, declared properties first in declaration order.
    schema = {"type": "object", "properties": {"z": {}, "a": {"properties": {"y": {}, "b": {}}}}}
    assert serializations({"a": {"b": 1, "y": 2}, "z": 0}, schema)[-1] == '{"z": 0, "a": {"y": 2, "b": 1}}'
    # Two subschemas declare the same names in different orders (Github_medium/o57539): also each object by
    # the widest declaration of all its keys.
    schema = {"properties": {"g": {"items": {"properties": {"qid": {}, "points": {}}}},
                             "z": {"items": {"properties": {"points": {}, "qid": {}, "qids": {}}}}}}
    texts = serializations({"z": [{"qid": "q", "points": 1}]}, schema)
    assert '{"z": [{"points": 1, "qid": "q"}]}' in texts and '{"z": [{"qid": "q", "points": 1}]}' in texts


# -- masks mode -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["xgrammar", "llguidance", "auto"])
def test_unresolvable_ref_is_not_declared(tmp_path: Path, backends: BackendSet, tokenizer: TokenizerSpec,
                                          backend: str) -> None:
    record = masks_record(tmp_path, backends, tokenizer, {"$ref": "#/$defs/missing"}, [(1, True)], backend)
    assert record["status"] == "rejected"
    assert record["gct_ms"] is None and "sound_failures" not in record
    row = summarize_masks([record], ["S"], [backend])[0]
    assert (row["schemas"], row["declared"], row["declared_pct"], row["valid_instances"]) == (1, 0, 0.0, 0)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance", "auto"])
def test_valid_instance_is_sound_and_invalid_one_is_rejected(
    tmp_path: Path, backends: BackendSet, tokenizer: TokenizerSpec, backend: str
) -> None:
    tests = [({"a": 1}, True), ({"a": -20}, True), ({"a": "x"}, False), ({"a": 1, "b": 2}, False), ({}, False)]
    record = masks_record(tmp_path, backends, tokenizer, OBJECT_A, tests, backend)
    assert record["status"] == "ok" and record["routed"] in ("xgrammar", "llguidance")
    assert (record["valid_total"], record["invalid_total"]) == (2, 3)
    assert record["sound_failures"] == [] and record["strict_failures"] == []
    assert record["mask_mismatch"] == 0
    # One timed mask per token of each valid instance plus one after its last token (the stop mask).
    encode = tokenizer.hf_tokenizer.encode
    expected_masks = sum(len(encode(t, add_special_tokens=False)) + 1 for t in ('{"a": 1}', '{"a": -20}'))
    assert record["tbm"]["count"] == expected_masks
    assert 0 < record["tbm_p50_us"] <= record["tbm_p99_us"] <= record["tbm_max_us"]


def test_mislabelled_instance_counts_as_strictness_failure(tmp_path: Path, backends: BackendSet,
                                                           tokenizer: TokenizerSpec) -> None:
    # {"a": 1} is valid, so an exact engine accepts it: labelled invalid, it is a strictness failure the
    # validator cannot attribute to any keyword.
    record = masks_record(tmp_path, backends, tokenizer, OBJECT_A, [({"a": 1}, False)], "llguidance")
    assert record["strict_failures"] == [{"test": 0, "keyword": UNLABELLED, "at": "/"}]
    row = summarize_masks([record], ["S"], ["llguidance"])[0]
    assert row["strict_failures"] == 1 and row["strict_failures_by_keyword"] == {UNLABELLED: 1}


def test_prefix_of_a_valid_value_is_not_accepted(tmp_path: Path, backends: BackendSet,
                                                tokenizer: TokenizerSpec) -> None:
    # "1" is accepted token by token (it could become "10") but the grammar cannot end there.
    schema = {"type": "integer", "minimum": 10}
    record = masks_record(tmp_path, backends, tokenizer, schema, [(12, True), (1, False)], "llguidance")
    assert record["sound_failures"] == [] and record["strict_failures"] == []


# A backend that accepts every token: whatever the schema says, every instance passes.
@dataclass(frozen=True)
class _LaxCompiled:
    spec: GrammarSpec
    backend_name: str = "lax"


class _LaxMatcher:
    error: str | None = None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].fill_(-1)

    def accept_token(self, token_id: int) -> bool:
        return True

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        pass

    def forced_tokens(self) -> list[int]:
        return []

    def is_terminated(self) -> bool:
        return False

    def can_terminate(self) -> bool:
        return True


class _LaxBackend:
    name = "lax"

    def __init__(self, tokenizer: TokenizerSpec) -> None:
        pass

    def supports(self, spec: GrammarSpec) -> str | None:
        return None

    def compile(self, spec: GrammarSpec) -> _LaxCompiled:
        return _LaxCompiled(spec)

    def new_matcher(self, compiled: Any) -> _LaxMatcher:
        return _LaxMatcher()

    def fill_bitmasks(self, matchers: Any, bitmask: torch.Tensor, rows: Any) -> None:
        pass


def test_accepted_invalid_instances_are_counted_per_keyword(
    tmp_path: Path, tokenizer: TokenizerSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(registry._registered, "lax", _LaxBackend)
    lax = BackendSet(tokenizer, ["lax"])
    schema = {**OBJECT_A, "properties": {"a": {"type": "integer", "maximum": 3}, "d": {"format": "date"}}}
    tests = [({"a": 1}, True), ({"a": "x"}, False), ({"a": 9}, False), ({"a": 5}, False),
             ({"a": 1, "d": "nope"}, False), ({"a": 1, "z": 0}, False)]
    record = masks_record(tmp_path, lax, tokenizer, schema, tests, "lax")
    assert record["sound_failures"] == []
    assert [f["keyword"] for f in record["strict_failures"]] == [
        "type", "maximum", "maximum", "format:date", "additionalProperties"]
    row = summarize_masks([record], ["S"], ["lax"])[0]
    assert row["strict_failures"] == 5 and row["invalid_instances"] == 5
    assert row["strict_failures_by_keyword"] == {"maximum": 2, "type": 1, "format:date": 1, "additionalProperties": 1}


def test_failing_keyword_names_keyword_and_place() -> None:
    assert failing_keyword(OBJECT_A, {"a": "x"}) == ("type", "/a")
    assert failing_keyword({"type": "string", "format": "date"}, "x") == ("format:date", "/")
    assert failing_keyword(OBJECT_A, {"a": 1}) == (UNLABELLED, "/")


def test_compile_timeout_is_recorded(tmp_path: Path, backends: BackendSet, tokenizer: TokenizerSpec) -> None:
    outcome = compile_with_timeout(backends, GrammarSpec.json_schema(OBJECT_A), "xgrammar", tokenizer.vocab_size, 1e-6)
    assert outcome.status is CompileStatus.TIMEOUT and not outcome.declared
    record = masks_record(tmp_path, backends, tokenizer, OBJECT_A, [({"a": 1}, True)], "xgrammar", timeout_s=1e-6)
    assert record["status"] == "timeout"
    row = summarize_masks([record], ["S"], ["xgrammar"])[0]
    assert (row["declared"], row["timeouts"], row["valid_instances"]) == (0, 1, 0)


# -- generate mode ----------------------------------------------------------------------------------------

def _gen(status: str, finish: str | None = "stop", valid: bool = False, subset: str = "S") -> dict[str, Any]:
    return {"mode": "generate", "subset": subset, "schema": f"{status}{finish}{valid}", "backend": "b",
            "status": status, "finish_reason": finish, "valid": valid, "gct_ms": 2.0, "ttft_ms": 10.0,
            "tpot_ms": 1.0}


def test_coverage_and_compliance_arithmetic() -> None:
    records = [_gen("ok", valid=True), _gen("ok", valid=True), _gen("ok", valid=False),
               _gen("ok", "length"), _gen("rejected", None), _gen("timeout", None), _gen("gen_timeout", None)]
    row = summarize_generate(records, ["S"], ["b"])[0]
    # 7 schemas; 5 compiled (declared); 2 valid outputs; 3 finished with "stop", 2 of them valid.
    assert (row["schemas"], row["declared"], row["valid"]) == (7, 5, 2)
    assert row["declared_pct"] == round(100 * 5 / 7, 1)
    assert row["empirical_pct"] == round(100 * 2 / 7, 1)
    assert row["compliance_pct"] == 40.0
    assert row["finished_compliance_pct"] == round(100 * 2 / 3, 1)
    assert (row["length"], row["compile_timeouts"], row["gen_timeouts"]) == (1, 1, 1)
    # gen_timeout has no finish_reason: it is declared but ended without one.
    assert row["finish_reasons"] == {"stop": 3, "length": 1, "None": 1}


def test_finish_reason_table_has_a_column_per_backend() -> None:
    records = [_gen("ok"), _gen("ok", "dead_end"), _gen("ok", "dead_end", subset="T")]
    records.append({**_gen("ok", "stall"), "backend": "c"})
    rows = summarize_generate(records, ["S", "T"], ["b", "c"])
    table = finish_table(rows)
    assert table.headers == ["finish_reason", "b", "c"]
    assert table.rows == [["dead_end", "2", "0"], ["stall", "0", "1"], ["stop", "1", "0"]]


def test_generated_text_is_judged_with_draft_2020_12_and_formats() -> None:
    assert validate_generated(OBJECT_A, '{"a": 3}').valid
    assert not validate_generated(OBJECT_A, '{"a": 3').valid
    assert not validate_generated({"type": "string", "format": "date"}, '"2024-13-40"').valid


def test_generate_mode_in_process(tmp_path: Path) -> None:
    from corral.benchmarks.jsonschemabench.results import ResultStore
    from corral.benchmarks.jsonschemabench.runner import BenchConfig, plan, run_generate_plan, write_report

    data = tmp_path / "data"
    write_case(data, "S", "bool", {"type": "boolean"}, [])
    write_case(data, "S", "enum", {"enum": ["red", "green"]}, [])
    write_case(data, "S", "broken", {"$ref": "#/$defs/missing"}, [])
    config = BenchConfig(data=data, out=tmp_path / "out", backends=["auto"], mode="generate", max_tokens=64,
                         gen_timeout_s=60)
    store = ResultStore(config.out, config.mode)
    work = plan(config, store)
    run_generate_plan(config, work, store, lambda record: None)
    by_name = {r["schema"]: r for r in store.records()}
    assert by_name["broken.json"]["status"] == "rejected"
    assert by_name["bool.json"]["valid"] and by_name["enum.json"]["valid"]
    assert json.loads(by_name["enum.json"]["text"]) in ("red", "green")
    report = write_report(config, store, work.cases, None)
    row = next(r for r in json.loads((config.out / "results.json").read_text())["rows"] if r["subset"] == ALL)
    assert (row["schemas"], row["declared"], row["valid"]) == (3, 2, 2)
    assert (row["empirical_pct"], row["compliance_pct"], row["finished_compliance_pct"]) == (66.7, 100.0, 100.0)
    assert row["ttft_p50_ms"] is not None and row["gct_p50_ms"] is not None
    assert (config.out / "coverage.png") in report.files
    assert plan(config, store).pending == 0  # resumable: nothing left to do


# -- CLI --------------------------------------------------------------------------------------------------

def test_cli_masks_smoke_on_committed_sample(tmp_path: Path) -> None:
    from corral.server.cli import main

    out = tmp_path / "out"
    argv = ["bench", "jsonschemabench", "--data", str(SAMPLE), "--subsets", "Github_trivial", "WashingtonPost",
            "--limit", "2", "--out", str(out)]
    assert main(argv) == 0
    for name in ("report.md", "results.json", "coverage.png", "mask_latency_cdf.png", "masks.jsonl"):
        assert (out / name).stat().st_size > 0, name
    lines = (out / "masks.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 2 * 3  # subsets × schemas × backends
    results = json.loads((out / "results.json").read_text())
    assert {r["backend"] for r in results["rows"]} == {"xgrammar", "llguidance", "auto"}
    assert "| subset | backend |" in (out / "report.md").read_text()
    assert main(argv) == 0  # a rerun resumes: nothing new appended
    assert len((out / "masks.jsonl").read_text().splitlines()) == len(lines)


def test_sample_has_every_subset_in_maskbench_format() -> None:
    subsets = sorted(p.name for p in SAMPLE.iterdir() if p.is_dir())
    assert len(subsets) == 7
    for subset in subsets:
        files = sorted((SAMPLE / subset).glob("*.json"))
        assert 1 <= len(files) <= 12
        for path in files:
            assert {"schema", "tests"} <= set(json.loads(path.read_text()))
    assert sum(p.stat().st_size for p in SAMPLE.rglob("*") if p.is_file()) <= 300_000


def test_isolated_compile_is_killed_at_the_deadline(backends: BackendSet, tokenizer: TokenizerSpec) -> None:
    """--isolate: the benchmark compiles in the server's worker processes; a compile past the deadline is
    killed there (nothing left to drain), and an ordinary schema still compiles and masks."""
    hostile = {  # anyOf of 10 objects x 20 enum-valued properties x 50 values: ~22 s on xgrammar here
        "anyOf": [
            {"type": "object", "properties": {f"k{i}": {"enum": [f"v{j}" for j in range(50)]} for i in range(20)},
             "required": [f"k{i}" for i in range(20)]}
            for _ in range(10)
        ]
    }
    vocab = tokenizer.vocab_size
    ok = compile_with_timeout(backends, GrammarSpec.json_schema(OBJECT_A), "xgrammar", vocab, 10.0, isolate=True)
    assert ok.status is CompileStatus.OK and ok.gct_ms is not None
    start = time.perf_counter()
    slow = compile_with_timeout(backends, GrammarSpec.json_schema(hostile), "xgrammar", vocab, 1.0, isolate=True)
    assert slow.status is CompileStatus.TIMEOUT and "deadline" in (slow.error or "")
    assert time.perf_counter() - start < 10.0  # killed near the 1 s deadline, not left to run its ~22 s


def test_compile_workers_size_the_isolated_pool(tmp_path: Path) -> None:
    """--isolate: one compile worker per thread by default (at least the server's 2), or --compile-workers."""
    from corral.benchmarks.jsonschemabench.runner import BenchConfig

    def config(**kwargs: Any) -> BenchConfig:
        return BenchConfig(data=SAMPLE, out=tmp_path, backends=["xgrammar"], **kwargs)

    assert config(isolate=True).sandbox_workers == 2
    assert config(isolate=True, workers=16).sandbox_workers == 16
    assert config(isolate=True, workers=16, compile_workers=4).sandbox_workers == 4
    with pytest.raises(ValueError, match="only applies with --isolate"):
        config(compile_workers=4)
    with pytest.raises(ValueError, match="at least 1"):
        config(isolate=True, compile_workers=0)
