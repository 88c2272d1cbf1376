"""The host block store: prompt blocks a reused slot forgets, found again when their prompt returns."""

from __future__ import annotations

import pytest
import torch

from corral.server.engine import Engine, EngineConfig, SamplingParams, SeqOutput
from corral.server.engine import Sequence as Seq
from corral.server.engine.host_block_store import BlockKV, HostBlockStore
from corral.server.engine.prefix_cache import BLOCK_SIZE, PrefixCache
from corral.server.models import LoadedModel, load_model


def _block(value: float, nbytes: int = 64) -> BlockKV:
    return torch.full((nbytes // 4,), value, dtype=torch.float32)


def test_the_least_recently_used_block_goes_first_and_a_chain_keeps_its_head() -> None:
    store = HostBlockStore(3 * 64)
    for name, parent, token in ((b"c", b"b", 3), (b"b", b"a", 2), (b"a", b"", 1)):  # a chain, kept last first
        store.keep(name, parent, [token], _block(1.0))
    assert store.run_length([b"a", b"b", b"c"], 0) == 3
    store.keep(b"x", b"", [9], _block(2.0))  # full: the least recently kept block, the chain's tail, goes
    assert store.run_length([b"a", b"b", b"c"], 0) == 2 and b"x" in store and store.bytes == 3 * 64
    store.take_run([b"a", b"b"])  # used again: the head is now the last to go
    store.keep(b"y", b"", [7], _block(3.0))
    store.keep(b"z", b"", [8], _block(3.0))
    assert b"a" in store and b"b" not in store and b"x" not in store
    store.keep(b"huge", b"", [6], _block(4.0, nbytes=4 * 64))  # larger than the whole store: not kept
    assert b"huge" not in store and len(store) == 3
    with pytest.raises(ValueError, match="capacity"):
        HostBlockStore(-1)


def test_the_entry_that_begins_the_most_of_a_prompts_last_tokens_is_found() -> None:
    store = HostBlockStore(1 << 20)
    store.keep(b"one", b"p", [5, 6, 7, 8], _block(1.0))
    store.keep(b"two", b"p", [5, 6, 9], _block(2.0))
    store.keep(b"elsewhere", b"q", [5, 6, 7, 8, 9], _block(3.0))
    count, kv = store.longest_start(b"p", [5, 6, 7, 1])
    assert count == 3 and kv is not None and kv[0].item() == 1.0
    assert store.longest_start(b"p", [5, 6, 9, 9])[0] == 3
    assert store.longest_start(b"p", [4, 6]) == (0, None)  # nothing after `p` starts with 4
    store.keep(b"x", b"r", [1], _block(0.0, nbytes=(1 << 20) - 128))  # evicts the least recently used: "elsewhere"
    assert store.longest_start(b"q", [5, 6]) == (0, None) and b"one" in store


class _TensorKV:
    """Slots of one float per position, so restored blocks can be checked by value."""

    def __init__(self, slots: int, length: int) -> None:
        self.buf = torch.zeros(slots, length)
        self.writes: list[tuple[int, int]] = []

    def copy_positions(self, src: int, dst: int, start: int, end: int) -> None:
        self.buf[dst, start:end] = self.buf[src, start:end]

    def read_positions(self, slot: int, start: int, end: int) -> BlockKV:
        return self.buf[slot, start:end].clone()

    def write_positions(self, slot: int, start: int, block: BlockKV, count: int | None = None) -> None:
        self.writes.append((slot, start))
        part = block if count is None else block[:count]
        self.buf[slot, start : start + part.shape[0]] = part


def _run(cache: PrefixCache, kv: _TensorKV, prompt: list[int], free: list[int]) -> tuple[int, int]:
    """Admit `prompt`, 'compute' its uncached positions (KV = the token id), release the slot."""
    slot, hit = cache.place(prompt, free)
    kv.buf[slot, hit : len(prompt)] = torch.tensor(prompt[hit:], dtype=torch.float32)
    cache.written(slot, hit, prompt[hit:])
    cache.release(slot)
    return slot, hit


def test_a_prompt_that_returns_after_its_slot_was_reused_finds_its_blocks() -> None:
    kv = _TensorKV(1, 256)
    cache = PrefixCache(1, kv, store=HostBlockStore(1 << 20))
    first = list(range(100, 100 + 3 * BLOCK_SIZE + 4))
    other = list(range(500, 500 + 2 * BLOCK_SIZE))
    _run(cache, kv, first, [0])
    assert _run(cache, kv, other, [0]) == (0, 0)  # takes the only slot: `first`'s 3 blocks go to the store
    # Its 3 full blocks and its last 4 tokens (kept apart when the slot was taken): only its last token is fed.
    assert _run(cache, kv, first, [0])[1] == len(first) - 1
    assert kv.writes == [(0, i * BLOCK_SIZE) for i in range(4)]
    assert kv.buf[0, : len(first)].tolist() == first  # the restored KV is `first`'s own
    # Without a store the slot alone holds the cache: the same sequence recomputes it all.
    plain_kv = _TensorKV(1, 256)
    plain = PrefixCache(1, plain_kv)
    for prompt in (first, other):
        _run(plain, plain_kv, prompt, [0])
    assert _run(plain, plain_kv, first, [0]) == (0, 0)


def test_a_full_store_evicts_before_it_is_searched() -> None:
    kv = _TensorKV(1, 256)
    block_bytes = BLOCK_SIZE * 4  # one float per position
    cache = PrefixCache(1, kv, store=HostBlockStore(2 * block_bytes))
    first = list(range(100, 100 + 2 * BLOCK_SIZE))
    other = list(range(500, 500 + 2 * BLOCK_SIZE + 1))
    _run(cache, kv, first, [0])
    _run(cache, kv, other, [0])  # the store now holds `first`'s two blocks: full
    # Taking the slot back stores `other`'s blocks, which evicts `first`'s: it is computed, not half-restored.
    assert _run(cache, kv, first, [0]) == (0, 0)
    assert kv.buf[0, : len(first)].tolist() == first


def test_blocks_another_slot_still_holds_are_not_stored_twice() -> None:
    kv = _TensorKV(2, 256)
    store = HostBlockStore(1 << 20)
    cache = PrefixCache(2, kv, store=store)
    shared = list(range(2 * BLOCK_SIZE))
    a, _ = _run(cache, kv, [*shared, *range(900, 900 + BLOCK_SIZE)], [0, 1])
    _run(cache, kv, [*shared, *range(700, 700 + BLOCK_SIZE)], [1 - a])
    # Reusing `a` for something unrelated stores only its own third block: `b` holds the first two.
    _run(cache, kv, list(range(300, 300 + BLOCK_SIZE + 1)), [a])
    assert len(store) == 1


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("corral-tiny", device="cpu")


def test_restored_blocks_decode_exactly_as_without_a_cache(loaded: LoadedModel) -> None:
    system = "You are a careful assistant that answers in JSON. " * 5
    prompts = []
    for user in ("the first question", "a different question", "the first question"):
        messages = [{"role": "system", "content": system + user}, {"role": "user", "content": user}]
        ids = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)
        prompts.append([int(t) for t in ids["input_ids"]])

    def generate(config: EngineConfig, hits: list[int]) -> list[list[int]]:
        engine = Engine(loaded, config)
        engine.runner.prefix.on_lookup = lambda queried, hit: hits.append(hit)
        outputs = []
        for i, prompt in enumerate(prompts):
            done: list[SeqOutput] = []
            seq = Seq(request_id=str(i), prompt_ids=prompt, sink=done.append, streaming=False,
                      params=SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
            engine.add_request(seq)
            while not seq.is_finished:
                engine.step()
            outputs.append(seq.output_ids)
        return outputs

    hits: list[int] = []
    stored = generate(EngineConfig(max_batch=1, max_model_len=512, prefix_cache_ram_mb=16), hits)
    assert stored == generate(EngineConfig(max_batch=1, max_model_len=512, prefix_cache=False), [])
    # The third prompt's own tokens after the shared system text came back from the store.
    assert hits[2] == len(prompts[2]) - 1 > hits[1]  # all of it: full blocks and the last few tokens
    slots_only: list[int] = []
    generate(EngineConfig(max_batch=1, max_model_len=512, prefix_cache_ram_mb=0), slots_only)
    assert slots_only[2] == slots_only[1] < hits[2]


@pytest.mark.parametrize("layout", ["in_place", "transformers"])
def test_both_kv_caches_read_a_block_out_and_write_it_back(layout: str) -> None:
    from corral.server.engine.kv_cache import SlotKVCache
    from corral.server.engine.slot_attention import InPlaceKVCache

    shape = {"num_layers": 3, "num_slots": 2, "num_kv_heads": 2, "head_dim": 4, "max_len": 40,
             "dtype": torch.float16, "device": torch.device("cpu")}
    cache: InPlaceKVCache | SlotKVCache
    cache = InPlaceKVCache(num_heads=4, **shape) if layout == "in_place" else SlotKVCache(**shape)  # type: ignore[arg-type]
    for buf in (*cache.keys, *cache.values):
        buf.copy_(torch.randn(buf.shape))
    block = cache.read_positions(0, BLOCK_SIZE, 2 * BLOCK_SIZE)
    assert block.device.type == "cpu" and block.shape[0] == 6
    cache.keys[0][0].zero_()  # the source changes afterwards: the copy must not follow it
    cache.write_positions(1, 0, block)
    axis = 1 if layout == "in_place" else 2
    for i, buf in enumerate((*cache.keys, *cache.values)):
        written = buf[1].narrow(axis - 1, 0, BLOCK_SIZE)
        assert torch.equal(written, block[i]), i
    assert torch.count_nonzero(block[0]) > 0
    # The first few positions alone (a prompt's last tokens past its last full block).
    before = cache.values[2][1].clone()
    cache.write_positions(1, 2 * BLOCK_SIZE, block, count=5)
    changed = (cache.values[2][1] != before).any(dim=-1)
    positions = changed.nonzero()[:, axis - 1].unique().tolist()
    assert positions == list(range(2 * BLOCK_SIZE, 2 * BLOCK_SIZE + 5))
