"""The KV cache's attention against attention written out by hand: prompts, decode steps whose pack is used as
the query block directly (one token per row, consecutive slots), and steps that need the general layout."""

from __future__ import annotations

import pytest
import torch

from corral.server.engine.slot_attention import InPlaceKVCache

HEADS, KV_HEADS, HEAD_DIM, WINDOW = 4, 2, 8, 6
LAYERS = [None, WINDOW]  # a full-attention layer and a sliding-window one


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int | None) -> torch.Tensor:
    """One query token at the last of `keys` positions: [heads, head_dim], in float64."""
    group = HEADS // KV_HEADS
    length = keys.shape[0]
    first = 0 if window is None else max(0, length - window)
    out = []
    for head in range(HEADS):
        k, v = keys[first:, head // group].double(), values[first:, head // group].double()
        weights = torch.softmax(k @ q[head].double() / HEAD_DIM**0.5, dim=0)
        out.append(weights @ v)
    return torch.stack(out)


class _Rows:
    """A cache with its contents also kept by hand, to check what it attends."""

    def __init__(self) -> None:
        self.cache = InPlaceKVCache(num_layers=2, num_slots=4, num_heads=HEADS, num_kv_heads=KV_HEADS,
                                    head_dim=HEAD_DIM, max_len=32, dtype=torch.float32, device=torch.device("cpu"),
                                    layer_windows=LAYERS)
        self.kv: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.generator = torch.Generator().manual_seed(0)

    def step(self, slots: list[int], counts: list[int]) -> tuple[bool, list[torch.Tensor]]:
        starts = [len(self.kv.get((0, slot), [])) for slot in slots]
        plan = self.cache.plan(slots, starts, counts)
        total = sum(counts)
        outputs = []
        for layer in range(2):
            q, k, v = (torch.randn(total, n, HEAD_DIM, generator=self.generator) for n in (HEADS, KV_HEADS, KV_HEADS))
            out = self.cache(layer, q, k, v)
            offset = 0
            for slot, count in zip(slots, counts, strict=True):
                stored = self.kv.setdefault((layer, slot), [])
                stored.extend(zip(k[offset : offset + count], v[offset : offset + count], strict=True))
                last = offset + count - 1  # check each row's last token (the one a decode step samples from)
                keys = torch.stack([key for key, _ in stored])
                values = torch.stack([value for _, value in stored])
                expected = _reference(q[last], keys, values, LAYERS[layer])
                torch.testing.assert_close(out[last].double(), expected, rtol=1e-5, atol=1e-5)
                offset += count
            outputs.append(out)
        return plan.direct, outputs


def test_prompts_then_decode_steps_attend_what_they_should() -> None:
    rows = _Rows()
    assert rows.step([0, 1, 2], [3, 5, 4])[0] is False  # prompts: several tokens a row
    assert rows.step([0], [1])[0] is True  # one row, within the window: no mask
    for _ in range(4):  # slot 0 reaches 8 keys, past the 6-key window: the windowed layer masks
        assert rows.step([0], [1])[0] is True
    assert rows.step([0, 1, 2], [1, 1, 1])[0] is True  # consecutive slots, different lengths: masked
    assert rows.step([1, 2], [1, 1])[0] is True  # a range not starting at slot 0


@pytest.mark.parametrize(("slots", "counts"), [([0, 2], [1, 1]), ([1, 0], [1, 1]), ([0, 1], [1, 2])])
def test_steps_that_are_not_one_token_per_consecutive_slot_take_the_general_layout(
    slots: list[int], counts: list[int]
) -> None:
    rows = _Rows()
    rows.step([0, 1, 2], [3, 5, 4])
    direct, _ = rows.step(slots, counts)
    assert direct is False


@pytest.mark.parametrize("slots", [[0], [2], [0, 1, 2], [1, 2], [3, 0, 2], [2, 1]])
def test_a_step_of_one_token_a_row_is_laid_out_as_the_general_plan_lays_it_out(slots: list[int]) -> None:
    """`plan`'s path for one token a row (the usual decode step) against its general one, field by field."""
    cache = _Rows().cache
    starts = [5 + 3 * slot for slot in slots]  # slot 3 past the window
    fast = cache.plan(slots, starts, [1] * len(slots))
    general = cache._plan_any(slots, starts, [1] * len(slots))
    for name in ("write_index", "decode_tokens", "decode_slots", "decode_query", "positions", "decode_mask",
                 "decode_window_mask"):
        mine, theirs = getattr(fast, name), getattr(general, name)
        assert (mine is None) == (theirs is None), name
        if mine is not None:
            assert torch.equal(mine, theirs), name
    for name in ("slot_lo", "slot_count", "span", "queries", "multi", "direct", "group", "window"):
        assert getattr(fast, name) == getattr(general, name), name
