"""Run a benchmark selection (resuming past results) and write report.md, results.json and plots."""

from __future__ import annotations

import asyncio
import logging
import platform
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from corral.benchmarks.harness import write_json
from corral.benchmarks.jsonschemabench import plots
from corral.benchmarks.jsonschemabench.dataset import SchemaCase, load_cases
from corral.benchmarks.jsonschemabench.generate import (
    GenerateOptions,
    Generator,
    InProcessGenerator,
    ServerGenerator,
    run_generate,
)
from corral.benchmarks.jsonschemabench.masks import MaskContext, encode_instances, run_masks
from corral.benchmarks.jsonschemabench.report import (
    Table,
    finish_table,
    generate_table,
    keyword_table,
    masks_table,
    summarize_generate,
    summarize_masks,
)
from corral.benchmarks.jsonschemabench.results import ResultStore, record_key
from corral.benchmarks.jsonschemabench.tokenizer import load_tokenizer_spec
from corral.grammar_engines.compilation import GrammarCache
from corral.grammar_engines.registry import AUTO, BackendSet, backend_names
from corral.grammar_engines.sandbox import DEFAULT_WORKERS

log = logging.getLogger(__name__)

MODES = ("masks", "generate")
OnRecord = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class BenchConfig:
    data: Path
    out: Path
    backends: list[str]
    mode: str = "masks"
    subsets: list[str] | None = None
    limit: int | None = None
    workers: int = 1
    tokenizer: Path | None = None
    server: str | None = None
    compile_timeout_s: float = 10.0
    gen_timeout_s: float = 60.0
    max_tokens: int = 512
    temperature: float = 0.0
    isolate: bool = False
    compile_workers: int | None = None  # --isolate: compile worker processes (None: see sandbox_workers)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        known = {AUTO, *backend_names()}
        unknown = [b for b in self.backends if b not in known]
        if unknown or not self.backends:
            raise ValueError(f"unknown backend(s) {', '.join(unknown) or '(none given)'}; "
                             f"available: {', '.join(sorted(known))}")
        if self.workers < 1:
            raise ValueError("--workers must be at least 1")
        if self.isolate and self.mode != "masks":
            raise ValueError("--isolate only applies to --mode masks (generate compiles as its server does)")
        if self.server and self.mode != "generate":
            raise ValueError("--server only applies to --mode generate")
        if self.compile_workers is not None:
            if not self.isolate:
                raise ValueError("--compile-workers only applies with --isolate")
            if self.compile_workers < 1:
                raise ValueError("--compile-workers must be at least 1")

    @property
    def sandbox_workers(self) -> int:
        """Compile worker processes under --isolate: as given, else one per thread (at least the server's 2),
        so no thread waits for a free worker."""
        return self.compile_workers if self.compile_workers is not None else max(DEFAULT_WORKERS, self.workers)


@dataclass
class Plan:
    cases: list[SchemaCase]
    todo: list[tuple[SchemaCase, list[str]]] = field(default_factory=list)

    @property
    def pending(self) -> int:
        return sum(len(backends) for _, backends in self.todo)


def plan(config: BenchConfig, store: ResultStore) -> Plan:
    cases = load_cases(config.data, config.subsets, config.limit)
    done = store.done()
    result = Plan(cases)
    for case in cases:
        backends = [b for b in config.backends if (b, case.subset, case.name) not in done]
        if backends:
            result.todo.append((case, backends))
    return result


def run_masks_plan(config: BenchConfig, work: Plan, store: ResultStore, on_record: OnRecord) -> None:
    tokenizer = load_tokenizer_spec(config.tokenizer)
    backends = BackendSet(tokenizer)  # every registered backend, so `auto` can route and fall back
    backends.warm_up()  # tokenizer tables once, up front: not part of the first schema's GCT
    if config.isolate:
        # Boot the compile workers before timing anything; the first cache over `backends` sizes the pool.
        GrammarCache(backends, isolate=True, workers=config.sandbox_workers).warm_up()
    ctx = MaskContext(backends, tokenizer, config.compile_timeout_s, config.isolate)

    def one_case(item: tuple[SchemaCase, list[str]]) -> None:
        case, names = item
        try:
            encoded = encode_instances(case, tokenizer)
            for name in names:
                record = run_masks(ctx, case, name, encoded)
                store.append(record)
                on_record(record)
        except Exception:  # one bad schema must not end a multi-hour run; it is retried on resume
            log.exception("masks run failed on %s", case.case_id)

    with ThreadPoolExecutor(config.workers, thread_name_prefix="bench") as pool:
        list(pool.map(one_case, work.todo))


def run_generate_plan(config: BenchConfig, work: Plan, store: ResultStore, on_record: OnRecord) -> None:
    options = GenerateOptions(config.max_tokens, config.gen_timeout_s, config.compile_timeout_s, config.temperature)

    async def main() -> None:
        generator: Generator = (
            ServerGenerator(config.server, options) if config.server else InProcessGenerator(options, config.backends)
        )
        limit = asyncio.Semaphore(config.workers)

        async def one(case: SchemaCase, backend: str) -> None:
            async with limit:
                try:
                    record = await run_generate(generator, case, backend, options)
                except Exception:
                    log.exception("generate run failed on %s with %s", case.case_id, backend)
                    return
                store.append(record)
                on_record(record)

        try:
            await asyncio.gather(*(one(case, b) for case, names in work.todo for b in names))
        finally:
            await generator.close()

    asyncio.run(main())


@dataclass(frozen=True)
class Report:
    tables: dict[str, Table]
    files: list[Path]


def write_report(config: BenchConfig, store: ResultStore, cases: list[SchemaCase], wall_s: float | None) -> Report:
    """Summarise the records of the selected schemas and backends (old runs included when resumed)."""
    selected = {(c.subset, c.name) for c in cases}
    subsets = list(dict.fromkeys(c.subset for c in cases))
    records = [r for r in store.records()
               if (r["subset"], r["schema"]) in selected and r["backend"] in config.backends]
    records.sort(key=record_key)
    out = config.out
    files: list[Path] = []
    if config.mode == "masks":
        rows = summarize_masks(records, subsets, config.backends)
        tables = {"Masks (teacher-forced test instances)": masks_table(rows),
                  "Strictness failures per keyword (all subsets)": keyword_table(rows)}
        if rows:
            files.append(plots.coverage_bars(rows, out / "coverage.png", [("declared_pct", "declared")]))
            files.append(plots.mask_latency_cdf(records, config.backends, out / "mask_latency_cdf.png"))
    else:
        rows = summarize_generate(records, subsets, config.backends)
        tables = {"Generation": generate_table(rows), "How declared answers ended (all subsets)": finish_table(rows)}
        if rows:
            files.append(plots.coverage_bars(rows, out / "coverage.png",
                                             [("declared_pct", "declared"), ("empirical_pct", "empirical")]))
    meta = _run_meta(config, wall_s)
    results = write_json(out, {"meta": meta, "rows": rows})
    report = out / "report.md"
    report.write_text(_markdown(meta, tables), encoding="utf-8")
    return Report(tables, [report, results, *files])


def _run_meta(config: BenchConfig, wall_s: float | None) -> dict[str, Any]:
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()}
    return {
        "config": settings,
        "wall_s_this_invocation": None if wall_s is None else round(wall_s, 1),
        "machine": f"{platform.machine()}, {platform.system()} {platform.release()}, "
                   f"python {platform.python_version()}",
        "generated_at": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def _markdown(meta: dict[str, Any], tables: dict[str, Table]) -> str:
    cfg = meta["config"]
    lines = [f"# JSONSchemaBench — {cfg['mode']} mode", "",
             f"- data: `{cfg['data']}`, limit per subset: {cfg['limit'] or 'all'}, "
             f"backends: {', '.join(cfg['backends'])}",
             f"- machine: {meta['machine']}; generated {meta['generated_at']}", ""]
    for title, table in tables.items():
        lines += [f"## {title}", "", table.markdown(), ""]
    return "\n".join(lines)
