"""Prefix caching through the real Engine: admission starts after the cached prefix, outputs do not change."""

from __future__ import annotations

import pytest

from corral.server.engine import Engine, EngineConfig, SamplingParams, SeqOutput
from corral.server.engine import Sequence as Seq
from corral.server.engine.model_runner import ForwardRow
from corral.server.engine.prefix_cache import BLOCK_SIZE, PrefixCache
from corral.server.engine.scheduler import Scheduler
from corral.server.models import LoadedModel, load_model

SYSTEM = "You are a careful assistant that answers in JSON. " * 6


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("corral-tiny", device="cpu")


def _prompt(loaded: LoadedModel, user: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    ids = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return [int(t) for t in ids["input_ids"]]


def _generate(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """Runs the prompts one after another (each admitted after the previous one ended)."""
    outputs = []
    for i, prompt in enumerate(prompts):
        done: list[SeqOutput] = []
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        seq = Seq(request_id=str(i), prompt_ids=prompt, params=params, sink=done.append, streaming=False)
        engine.add_request(seq)
        while not seq.is_finished:
            engine.step()
        outputs.append(seq.output_ids)
    return outputs


def test_shared_system_prompt_skips_its_prefix_and_decodes_the_same(loaded: LoadedModel) -> None:
    prompts = [_prompt(loaded, "first question"), _prompt(loaded, "second question"), _prompt(loaded, "first question")]
    cached = Engine(loaded, EngineConfig(max_batch=2, max_model_len=512))
    plain = Engine(loaded, EngineConfig(max_batch=2, max_model_len=512, prefix_cache=False))
    hits: list[int] = []
    cached.runner.prefix.on_lookup = lambda queried, hit: hits.append(hit)
    with_cache = _generate(cached, prompts)
    without = _generate(plain, prompts)
    assert with_cache == without
    system_blocks = len(_prompt(loaded, "")) // BLOCK_SIZE * BLOCK_SIZE - BLOCK_SIZE
    assert hits[0] == 0
    assert hits[1] >= system_blocks > 0  # the shared system prompt
    assert hits[2] == len(prompts[2]) - 1  # the same prompt again: all of it but the last token, fed for its logits
    assert plain.runner.prefix.hit_tokens == 0


class _Copies:
    def __init__(self) -> None:
        self.copies: list[tuple[int, int, int, int]] = []

    def copy_positions(self, src: int, dst: int, start: int, end: int) -> None:
        self.copies.append((src, dst, start, end))


def test_rewritten_blocks_are_forgotten_and_the_rest_reused_token_by_token() -> None:
    kv = _Copies()
    cache = PrefixCache(2, kv)
    prompt = list(range(3 * BLOCK_SIZE))
    slot, hit = cache.place(prompt, [0, 1])
    assert hit == 0
    cache.written(slot, 0, prompt)
    # A revision lowers the length into the second block and writes something else there.
    cache.written(slot, BLOCK_SIZE + 3, [999])
    cache.release(slot)
    other, hit = cache.place(prompt, [0, 1])
    # Up to the rewritten position, no further: the empty slot takes it (the revised slot keeps its tokens).
    assert (other, hit) == (1 - slot, BLOCK_SIZE + 3)
    assert kv.copies == [(slot, other, 0, BLOCK_SIZE), (slot, other, BLOCK_SIZE, BLOCK_SIZE + 3)]


def test_a_prompt_again_reuses_all_but_its_last_token_in_place() -> None:
    kv = _Copies()
    cache = PrefixCache(1, kv)
    prompt = list(range(2 * BLOCK_SIZE + 5))  # not a whole number of blocks
    slot, _ = cache.place(prompt, [0])
    cache.written(slot, 0, prompt)
    cache.written(slot, len(prompt), [500, 501])  # the answer
    cache.release(slot)
    assert cache.place(prompt, [0]) == (slot, len(prompt) - 1)
    assert kv.copies == []
    # The next turn of the conversation starts with the whole previous one.
    cache.written(slot, len(prompt) - 1, prompt[-1:])
    cache.written(slot, len(prompt), [500, 501])
    cache.release(slot)
    turn = [*prompt, 500, 501, 7, 8]
    assert cache.place(turn, [0]) == (slot, len(prompt) + 2)
    # A different ending shares only what comes before it, even inside a block.
    cache.written(slot, len(prompt) + 2, [7, 8])
    cache.release(slot)
    assert cache.place([*prompt[:-3], 42, 43], [0]) == (slot, len(prompt) - 3)


def test_a_busy_twin_lends_its_partial_block_to_an_empty_slot() -> None:
    kv = _Copies()
    cache = PrefixCache(3, kv)
    prompt = list(range(BLOCK_SIZE + 9))
    first, _ = cache.place(prompt, [0, 1, 2])
    cache.written(first, 0, prompt)
    # Still running (never released): a second request with the same prompt copies blocks and the tail.
    twin, hit = cache.place(prompt, [s for s in range(3) if s != first])
    assert twin != first and hit == len(prompt) - 1
    assert kv.copies == [(first, twin, 0, BLOCK_SIZE), (first, twin, BLOCK_SIZE, len(prompt))]
    # Short prompts (no full block) share token by token too.
    cache.written(twin, hit, prompt[hit:])
    short = [0, 1, 2, 3, 99]
    third, hit = cache.place(short, [s for s in range(3) if s not in (first, twin)])
    assert hit == 4 and kv.copies[-1][1:] == (third, 0, 4)


def _seq(name: str, prompt: list[int]) -> Seq:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return Seq(request_id=name, prompt_ids=prompt, params=params, sink=lambda out: None, streaming=False)


def test_prompts_arriving_together_compute_their_shared_prefix_once() -> None:
    kv = _Copies()
    cache = PrefixCache(4, kv)
    scheduler = Scheduler(4, placer=cache)
    prompt = list(range(2 * BLOCK_SIZE + 8))
    first, sibling, other, twin = _seq("a", prompt), _seq("b", prompt), _seq("c", [7] * 40), _seq("d", prompt)
    for seq in (first, sibling, other, twin):
        scheduler.add(seq)
    batch = scheduler.schedule()
    # The siblings wait one step for the first one's KV; the unrelated prompt behind them does not.
    assert batch == [first, other]
    assert list(scheduler.waiting) == [sibling, twin]
    cache.written(first.slot, 0, first.pending)
    cache.written(other.slot, 0, other.pending)
    batch = scheduler.schedule()
    assert batch == [first, other, sibling, twin]
    for seq in (sibling, twin):  # all of the prompt but its last token: full blocks and the tail
        assert seq.num_cached == len(prompt) - 1 and seq.pending == prompt[-1:]
    assert {(src, start) for src, _, start, _ in kv.copies} == {(first.slot, 0), (first.slot, BLOCK_SIZE),
                                                               (first.slot, 2 * BLOCK_SIZE)}


def test_short_or_already_cached_prompts_do_not_wait() -> None:
    cache = PrefixCache(6, _Copies())
    scheduler = Scheduler(6, placer=cache)
    short = [1] * BLOCK_SIZE  # no full block before its last token: nothing to share
    pair = [_seq("a", short), _seq("b", short)]
    for seq in pair:
        scheduler.add(seq)
    assert scheduler.schedule() == pair
    # A prompt whose shared blocks are all cached already gains nothing by waiting.
    long = list(range(3 * BLOCK_SIZE))
    held = _seq("c", long)
    scheduler.add(held)
    scheduler.schedule()
    cache.written(held.slot, 0, held.pending)
    again = [_seq("d", [*long, 1, 2]), _seq("e", [*long, 3, 4])]
    for seq in again:
        scheduler.add(seq)
    assert scheduler.schedule()[-2:] == again


def test_n_samples_admitted_together_decode_as_without_the_cache(loaded: LoadedModel) -> None:
    prompt = _prompt(loaded, "one question, three samples")
    results = []
    for enabled in (True, False):
        engine = Engine(loaded, EngineConfig(max_batch=4, max_model_len=512, prefix_cache=enabled))
        hits: list[int] = []
        engine.runner.prefix.on_lookup = lambda queried, hit, hits=hits: hits.append(hit)
        seqs = [_seq(str(i), list(prompt)) for i in range(3)]
        for seq in seqs:
            engine.add_request(seq)
        while not all(seq.is_finished for seq in seqs):
            engine.step()
        results.append(([seq.output_ids for seq in seqs], hits))
    (cached_out, cached_hits), (plain_out, _) = results
    assert cached_out == plain_out
    assert cached_hits == [0] + [min(len(prompt) // BLOCK_SIZE * BLOCK_SIZE, len(prompt) - 1)] * 2


def test_a_forward_that_fails_midway_unindexes_what_it_was_writing(loaded: LoadedModel) -> None:
    engine = Engine(loaded, EngineConfig(max_batch=1, max_model_len=256))
    prompt = _prompt(loaded, "a question")
    _generate(engine, [prompt])
    runner = engine.runner

    def fails(rows: object, dense: bool = False) -> None:
        raise RuntimeError("the step died after writing some layers")

    runner._impl.decode = fails  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        runner.decode([ForwardRow(slot=0, start=20, tokens=[5, 6, 7])])
    # KV from position 20 on may be half-written: a later prompt reuses only what lies before it.
    assert runner.prefix.place(prompt, [0]) == (0, 20)
