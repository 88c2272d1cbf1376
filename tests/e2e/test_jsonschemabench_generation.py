"""Issue 2's floor: on schemas sampled from JSONSchemaBench, every answer that ends with finish_reason
"stop" (or is closed early, "closed") validates against the full schema (Draft 2020-12 + format checker), with
backend=auto; and with a budget far too small, the answers it cuts close validly.

Uses ../shared/jsonschemabench when present (CORRAL_BENCH_SCHEMAS schemas, default 49, spread evenly over
the dev subsets; the closing note's 203-schema run sets it to 203), else the committed sample under tests/data."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import SAMPLE_BENCH, SHARED_BENCH, RunningServer

SUBSETS = [
    "Github_trivial",
    "Github_easy",
    "Github_medium",
    "Github_hard",
    "Glaiveai2K",
    "Kubernetes",
    "WashingtonPost",
]


def sample_schemas(root: Path, total: int) -> list[tuple[str, Any]]:
    per_subset = max(1, total // len(SUBSETS))
    picked: list[tuple[str, Any]] = []
    for subset in SUBSETS:
        files = sorted((root / subset).glob("*.json"))
        if not files:
            continue
        step = max(1, len(files) // per_subset)
        for path in files[::step][:per_subset]:
            picked.append((f"{subset}/{path.name}", json.loads(path.read_text())["schema"]))
    return picked


def _schemas() -> list[tuple[str, Any]]:
    if SHARED_BENCH.is_dir():
        return sample_schemas(SHARED_BENCH, int(os.environ.get("CORRAL_BENCH_SCHEMAS", "49")))
    if not SAMPLE_BENCH.is_dir():
        pytest.skip(f"no JSONSchemaBench data: neither {SHARED_BENCH} nor {SAMPLE_BENCH} exists")
    return sample_schemas(SAMPLE_BENCH, 10_000)


def _generate(server: RunningServer, max_tokens: int) -> list[dict[str, Any]]:
    """One answer per sampled schema (auto), as the service gives it."""
    from corral.server.errors import ApiError
    from corral.server.openai.frontend import OpenAIFrontend
    from corral.server.openai.protocol import ChatCompletionRequest
    from corral.server.serving import Service

    service = server.service
    assert isinstance(service, Service)
    schemas = _schemas()

    async def one(name: str, schema: Any) -> dict[str, Any]:
        req = ChatCompletionRequest(
            messages=[{"role": "user", "content": f"Give an instance of {name}"}],
            structured_outputs={"json": schema, "backend": "auto"},
            max_tokens=max_tokens,
            seed=7,
        )
        try:
            prepared = await OpenAIFrontend(service, service.settings).prepare_chat(req)
        except ApiError as exc:
            assert exc.status == 400, exc.message  # refused schemas are a clear 400, never a 500
            return {"name": name, "compiled": False, "refusal": exc.code}
        done = await service.run(prepared)
        assert prepared.compiled is not None
        return {
            "name": name,
            "compiled": True,
            "backend": done.prepared.compiled.backend,
            "first_backend": prepared.compiled.backend,
            "fallback": done.fallback_from,
            "finish": done.finish_reason,
            "check": done.check,
            "text": done.text,
        }

    async def all_of_them() -> list[dict[str, Any]]:
        limit = asyncio.Semaphore(16)  # the engine's batch size

        async def bounded(name: str, schema: Any) -> dict[str, Any]:
            async with limit:
                return await one(name, schema)

        return await asyncio.gather(*(bounded(n, s) for n, s in schemas))

    # Service is loop-agnostic (each request binds its own loop), so a private loop here is fine.
    return asyncio.run(all_of_them())


@pytest.mark.timeout(1500)
def test_finished_answers_validate_against_full_schema(server: RunningServer) -> None:
    results = _generate(server, 256)
    ended = [r for r in results if r.get("finish") in ("stop", "closed")]  # closed: ended early, still valid
    invalid = [(r["name"], r["check"].error, r["text"][:200]) for r in ended if not r["check"].valid]
    assert not invalid, invalid
    compiled = [r for r in results if r["compiled"]]
    refusals = [(r["name"], r["refusal"]) for r in results if not r["compiled"]]
    assert len(compiled) >= 0.8 * len(results), f"only {len(compiled)}/{len(results)} compiled: {refusals}"
    assert len(ended) >= 0.5 * len(compiled), f"only {len(ended)}/{len(compiled)} answers finished"
    by_backend: dict[str, int] = {}
    for r in compiled:
        by_backend[r["first_backend"]] = by_backend.get(r["first_backend"], 0) + 1
    fallbacks = [(r["name"], r["fallback"], r["finish"]) for r in compiled if r["fallback"]]
    finishes = {f: sum(1 for r in compiled if r["finish"] == f) for f in {r["finish"] for r in compiled}}
    print(
        f"\nschemas={len(results)} compiled={len(compiled)} first_backend={by_backend} "
        f"finish={finishes} fallbacks={fallbacks}"
    )


@pytest.mark.timeout(1500)
def test_answers_cut_by_a_small_budget_close_validly(server: RunningServer) -> None:
    """With max_tokens far below what the model would write, every answer that closed is valid, and a good share
    of the cut answers closed. The rest either needed more than the budget to close at all (a schema with many
    required properties) or had no completion the search found (a string with a format such as `uri` midway,
    or optional properties it chose before the required ones): measured on the 48-schema sample, 10 of 20; on
    the committed sample (no ../shared) 15 of 37, then 12 of 34 once forwards chose their CPU threads (other
    greedy answers, not fewer closings of the same ones), and 8 of 31 (d058ad8) / 9 of 32 (2f5ebc9) after the
    drafts changed which near-ties greedy answers take. Which near-ties the answers take also moves with the
    threads each forward chose, so the count moves from run to run: 7 or 8 of 29-30 on the committed sample at
    64258fa and at 02fa2c4 alike (the test alone, then in the whole suite), 10 of 19 on the 48-schema sample. A
    fifth is the floor."""
    results = [r for r in _generate(server, 24) if r["compiled"]]
    closed = [r for r in results if r["finish"] == "closed"]
    invalid = [(r["name"], r["check"].error, r["text"][:200]) for r in closed if not r["check"].valid]
    assert not invalid, invalid
    cut = [r for r in results if r["finish"] in ("closed", "length")]
    finishes = {f: sum(1 for r in results if r["finish"] == f) for f in {r["finish"] for r in results}}
    print(f"\nmax_tokens=24: schemas={len(results)} finish={finishes}")
    assert len(closed) >= 0.2 * len(cut), finishes
