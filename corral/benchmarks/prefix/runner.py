"""Times admission with the prefix cache on and off, on the engine itself (no HTTP), in the same run.

Two scenarios, each alternated between an engine with the cache and one without (`--no-prefix-cache`), so
both see the same load:

- `system prompt`: a request with a long system prompt runs to its end, then a second request with the same
  system prompt and another question arrives; timed is the second one's time to first token. The first
  one's TTFT is the cold number (a long prompt's prefill).
- `n samples`: `n` copies of one long prompt are submitted together (the `n` of one request); timed is the
  time until the last of them has its first token, and until all have finished.
- `returning prompts`: twice as many distinct long prompts as the engine has slots (documents a RAG client
  asks about, conversations), sent one at a time, then all again; timed is the median TTFT of the second
  round. Each slot has been reused by then, so only the host block store (`--prefix-cache-ram-mb`) holds
  them: its row with the store, and one with the slots alone (`--prefix-cache-ram-mb 0`), both against off.

Times are wall milliseconds from `add_request` to the step that produced the token; on CUDA each step ends
in a device sync (the sampled tokens are read back), so the times include the GPU work.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from corral.benchmarks.timing_report import speedup_of
from corral.server.engine import Engine, EngineConfig, SamplingParams
from corral.server.engine import Sequence as Seq
from corral.server.models import LoadedModel

FILLER = "The assistant answers in JSON that matches the caller's schema and adds no prose around it. "


@dataclass(frozen=True)
class PrefixResult:
    scenario: str  # "system prompt: cold", "system prompt: repeated", "n samples: last first token", ...
    prompt_tokens: int
    cached_ms: float  # median over repeats, prefix cache on
    plain_ms: float  # median over repeats, prefix cache off
    hit_tokens: int  # prompt tokens the cache served in the timed part (cache on)

    @property
    def speedup(self) -> float:
        return speedup_of(self.plain_ms, self.cached_ms)

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "speedup": self.speedup}


def long_prompt(loaded: LoadedModel, tokens: int) -> list[int]:
    """A system prompt of exactly `tokens` token ids (repeated filler text)."""
    piece = loaded.tokenizer.encode(FILLER, add_special_tokens=False)
    ids = piece * (tokens // max(len(piece), 1) + 1)
    return [int(t) for t in ids[:tokens]]


def _seq(name: str, prompt: list[int], max_tokens: int) -> Seq:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Seq(request_id=name, prompt_ids=prompt, params=params, sink=lambda out: None, streaming=False)


def _run(engine: Engine, seqs: list[Seq]) -> tuple[list[float], float]:
    """Submit `seqs` together and step until all end: (each one's first-token ms, ms until all ended)."""
    start = time.perf_counter()
    for seq in seqs:
        engine.add_request(seq)
    first: list[float | None] = [None] * len(seqs)
    while not all(seq.is_finished for seq in seqs):
        engine.step()
        now = (time.perf_counter() - start) * 1000
        for i, seq in enumerate(seqs):
            if first[i] is None and seq.output_ids:
                first[i] = now
    end = (time.perf_counter() - start) * 1000
    return [end if f is None else f for f in first], end


def _engine(loaded: LoadedModel, prompt_tokens: int, samples: int, cached: bool, ram_mb: int = 512) -> Engine:
    return Engine(loaded, EngineConfig(max_batch=max(samples, 2), max_model_len=prompt_tokens + 256,
                                       prefix_cache=cached, prefix_cache_ram_mb=ram_mb))


def _system_prompt(loaded: LoadedModel, system: list[int], max_tokens: int, cached: bool) -> tuple[float, float, int]:
    """(cold TTFT ms, repeated-system-prompt TTFT ms, tokens the cache served the second request)."""
    engine = _engine(loaded, len(system) + 16, 2, cached)
    question = [int(t) for t in loaded.tokenizer.encode(" First question?", add_special_tokens=False)]
    other = [int(t) for t in loaded.tokenizer.encode(" Another question?", add_special_tokens=False)]
    (cold,), _ = _run(engine, [_seq("cold", system + question, max_tokens)])
    before = engine.runner.prefix.hit_tokens
    (warm,), _ = _run(engine, [_seq("warm", system + other, max_tokens)])
    return cold, warm, engine.runner.prefix.hit_tokens - before


def _n_samples(
    loaded: LoadedModel, prompt: list[int], samples: int, max_tokens: int, cached: bool
) -> tuple[float, float, int]:
    """(ms until the last sample's first token, ms until all ended, tokens served from the cache)."""
    engine = _engine(loaded, len(prompt), samples, cached)
    firsts, end = _run(engine, [_seq(f"n{i}", list(prompt), max_tokens) for i in range(samples)])
    return max(firsts), end, engine.runner.prefix.hit_tokens


ROTATION_SLOTS = 2


def _returning(
    loaded: LoadedModel, prompt_tokens: int, max_tokens: int, cached: bool, ram_mb: int
) -> tuple[float, int]:
    """(median TTFT ms of the second round, tokens the cache served it) for 2 x ROTATION_SLOTS distinct
    prompts sent one at a time, twice over."""
    prompts = [[int(t) for t in loaded.tokenizer.encode(f"Document {i}.", add_special_tokens=False)]
               + long_prompt(loaded, prompt_tokens) for i in range(2 * ROTATION_SLOTS)]
    engine = _engine(loaded, prompt_tokens + 16, ROTATION_SLOTS, cached, ram_mb)
    for i, prompt in enumerate(prompts):
        _run(engine, [_seq(f"first {i}", prompt, max_tokens)])
    before = engine.runner.prefix.hit_tokens
    ttfts = [_run(engine, [_seq(f"again {i}", prompt, max_tokens)])[0][0] for i, prompt in enumerate(prompts)]
    return _median(ttfts), engine.runner.prefix.hit_tokens - before


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def run_prefix_bench(
    loaded: LoadedModel,
    prompt_tokens: int,
    samples: int,
    max_tokens: int,
    repeats: int,
    on_repeat: Callable[[int], None],
) -> list[PrefixResult]:
    system = long_prompt(loaded, prompt_tokens)
    times: dict[tuple[str, bool], list[float]] = {}  # (scenario, cache on) -> ms per repeat
    hit_tokens: dict[str, int] = {}  # scenario -> tokens the cache served (cache on)

    def record(name: str, cached: bool, ms: float, hits: int) -> None:
        times.setdefault((name, cached), []).append(ms)
        if cached:
            hit_tokens[name] = hits

    for repeat in range(repeats):
        for cached in (True, False):  # alternate: both see the same load
            cold, warm, hits = _system_prompt(loaded, system, max_tokens, cached)
            record("system prompt: first request (cold)", cached, cold, 0)
            record("system prompt: next request, same system prompt", cached, warm, hits)
            last_first, end, hits = _n_samples(loaded, system, samples, max_tokens, cached)
            record(f"n={samples} samples: last sample's first token", cached, last_first, hits)
            record(f"n={samples} samples: all finished ({max_tokens} tokens each)", cached, end, hits)
            returning = f"returning prompts ({2 * ROTATION_SLOTS} on {ROTATION_SLOTS} slots): second round's TTFT"
            ms, hits = _returning(loaded, prompt_tokens, max_tokens, cached, 512)
            record(f"{returning}, host store", cached, ms, hits)
            if cached:
                ms, hits = _returning(loaded, prompt_tokens, max_tokens, cached, 0)
            record(f"{returning}, slots alone", cached, ms, hits)
        on_repeat(repeat)
    return [
        PrefixResult(name, prompt_tokens, _median(times[name, True]), _median(times[name, False]), hits)
        for name, hits in hit_tokens.items()
    ]
