"""The naive baseline: transformers `model.generate` with xgrammar's Hugging Face logits processor, one
request at a time, greedy, on the same default model and prompts. It runs in the benchmark process."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from corral.benchmarks.jsonschemabench.dataset import SchemaCase
from corral.benchmarks.serve.stats import mean, percentile
from corral.benchmarks.serve.workload import messages
from corral.grammars.contract import validate_output
from corral.grammars.spec import GrammarSpec

log = logging.getLogger(__name__)


@dataclass
class TokenClock:
    """A `generate` streamer that only timestamps: the first `put` is the prompt, each later one a new token."""

    stamps: list[float] = field(default_factory=list)

    def put(self, value: Any) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


@dataclass(frozen=True)
class BaselineRequest:
    case_id: str
    tokens: int
    ttft_ms: float | None
    tpot_ms: float | None
    total_ms: float
    finished: bool  # stopped on a stop token before max_tokens
    valid: bool | None


def _compile_all(cases: Sequence[SchemaCase], loaded: Any, timeout_s: float) -> dict[str, Any]:
    """xgrammar-compile every schema (untimed), in a child process killed on timeout (see xgrammar_compile)."""
    import xgrammar

    from corral.benchmarks.serve.xgrammar_compile import compile_schemas

    info = xgrammar.TokenizerInfo.from_huggingface(
        loaded.tokenizer, vocab_size=loaded.vocab_size, stop_token_ids=list(loaded.stop_token_ids))
    unique = list({c.case_id: c for c in cases}.values())  # a workload repeats schemas when it has more requests
    compiled: dict[str, Any] = {}
    for case, grammar in zip(unique, compile_schemas(info, [c.schema for c in unique], timeout_s), strict=True):
        if isinstance(grammar, str):
            log.warning("baseline: xgrammar could not compile %s: %s", case.case_id, grammar[:300])
        else:
            compiled[case.case_id] = grammar
    return compiled


def _generate_one(loaded: Any, case: SchemaCase, grammar: Any, max_tokens: int) -> BaselineRequest:
    from transformers import LogitsProcessorList
    from xgrammar.contrib.hf import LogitsProcessor

    encoded = loaded.tokenizer.apply_chat_template(
        messages(case), add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
    input_ids = encoded["input_ids"].to(loaded.device)
    clock = TokenClock()
    stops = list(loaded.stop_token_ids)
    start = time.perf_counter()
    with torch.inference_mode():
        output = loaded.model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens, do_sample=False,
            logits_processor=LogitsProcessorList([LogitsProcessor(grammar)]),  # one per call: it is stateful
            streamer=clock, eos_token_id=stops, pad_token_id=stops[0])
    total_ms = (time.perf_counter() - start) * 1000
    new = [int(t) for t in output[0, input_ids.shape[1]:]]
    finished = bool(new) and new[-1] in stops
    content = new[:-1] if finished else new
    token_stamps = clock.stamps[1:]  # drop the prompt's put
    ttft = (token_stamps[0] - start) * 1000 if token_stamps else None
    # Per output token after the first, counting the stop token's step as the server counts its own.
    tpot = ((token_stamps[-1] - token_stamps[0]) * 1000 / (len(token_stamps) - 1)) if len(token_stamps) > 1 else None
    valid = None
    if finished:
        text = loaded.tokenizer.decode(content, skip_special_tokens=True)
        valid = validate_output(GrammarSpec.json_schema(case.schema), text).valid
    return BaselineRequest(case.case_id, len(content), ttft, tpot, total_ms, finished, valid)


def run_baseline(cases: Sequence[SchemaCase], max_tokens: int, *, compile_timeout_s: float = 30.0,
                 on_start: Callable[[int], None] | None = None, on_done: Callable[[], None] | None = None,
                 ) -> dict[str, Any]:
    """Compile (untimed), warm up once (untimed), then one request per schema, sequentially."""
    from corral.server.models import load_model

    loaded = load_model("corral-tiny", device="cpu", model_impl="transformers")  # the baseline is HF generate
    compiled = _compile_all(cases, loaded, compile_timeout_s)
    # Same torch thread count as corral's server uses on CPU (cores - 1): on 2 busy cores torch's default of
    # 2 threads was measured ~10x slower per token, which would flatter corral unfairly.
    threads_before = torch.get_num_threads()
    threads = max(1, (os.cpu_count() or 2) - 1)
    torch.set_num_threads(threads)
    try:
        result = _timed_requests(loaded, cases, compiled, max_tokens, on_start, on_done)
    finally:
        torch.set_num_threads(threads_before)
    return {**result, "torch_threads": threads}


def _timed_requests(loaded: Any, cases: Sequence[SchemaCase], compiled: dict[str, Any], max_tokens: int,
                    on_start: Callable[[int], None] | None, on_done: Callable[[], None] | None) -> dict[str, Any]:
    runnable = [c for c in cases if c.case_id in compiled]
    if on_start is not None:
        on_start(len(runnable))
    if runnable:
        _generate_one(loaded, runnable[0], compiled[runnable[0].case_id], max_tokens)  # warm-up
    requests: list[BaselineRequest] = []
    start = time.perf_counter()
    for case in runnable:
        requests.append(_generate_one(loaded, case, compiled[case.case_id], max_tokens))
        if on_done is not None:
            on_done()
    wall_s = time.perf_counter() - start
    tokens = sum(r.tokens for r in requests)
    finished = [r for r in requests if r.finished]
    valid = sum(1 for r in finished if r.valid)
    return {
        "mode": "baseline", "concurrency": 1, "requests": len(requests),
        "skipped_schemas": len(cases) - len(runnable), "completion_tokens": tokens, "wall_s": wall_s,
        "throughput_tok_s": tokens / wall_s if wall_s > 0 else None,
        "requests_per_s": len(requests) / wall_s if wall_s > 0 else None,
        "ttft_ms_p50": percentile((r.ttft_ms for r in requests), 50),
        "ttft_ms_p99": percentile((r.ttft_ms for r in requests), 99),
        "tpot_ms_p50": percentile((r.tpot_ms for r in requests), 50),
        "tpot_ms_p99": percentile((r.tpot_ms for r in requests), 99),
        "latency_ms_p50": percentile((r.total_ms for r in requests), 50),
        "latency_ms_mean": mean(r.total_ms for r in requests),
        "finished": len(finished), "valid": valid,
        "compliance": valid / len(finished) if finished else None,
        "per_request": [vars(r) for r in requests],
    }
