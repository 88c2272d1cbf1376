"""corral's own decoder equals transformers' forward on small random-weight Llama-family and Gemma 3 checkpoints.

Each config is built with transformers, given random weights (biases and norm gains too, which transformers
initialises to 0 and 1), saved as safetensors and loaded back through corral's path. The reference is
transformers' greedy generation and its logits over the whole generated sequence; corral decodes the same
prompts together in one batch, with rows of different lengths, a row fed several tokens at a time (as
forced tokens are), a revision rollback, and rows admitted through prefix-cache hits.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from small_llama_configs import CONFIGS, VOCAB, gemma3_config, llama3_config, mistral_config

from corral.kernels import projection, split_projection
from corral.server.engine.model_runner import ForwardRow, ModelRunner
from corral.server.engine.prefix_cache import BLOCK_SIZE
from corral.server.models.decoder_config import rope_frequencies, unsupported_reason
from corral.server.models.llama_family import LlamaFamilyModel, load_llama_family
from corral.server.models.loading import LoadedModel

STEPS = 64
TOLERANCE = 2e-4



MODES = ("plain", "onednn", "cuda")  # F.linear as served small; every projection packed for oneDNN; on a GPU
REAL = "gemma-3-270m"  # the built-in real model: its trained weights, as served
# Real logits reach ~30; 18 layers of 640-wide fp32 sums, summed in another order, differ by up to ~2e-3.
REAL_TOLERANCE = 5e-3


@dataclass
class Checkpoint:
    reference: Any  # the transformers model
    ours: LoadedModel
    tolerance: float = TOLERANCE


@pytest.fixture(scope="module",
                params=[*((name, mode) for name in sorted(CONFIGS) for mode in MODES), (REAL, "onednn")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """Each config three times: with the small weights on F.linear (as served), with every projection
    forced onto the oneDNN-packed path that real-sized weights take on CPU, the head split in slices, and on
    CUDA where there is a GPU (against the same transformers model on the CPU). Then the real Gemma 3 270M
    (real-sized, so packed as served), against transformers' Gemma3ForCausalLM."""
    from transformers import AutoModelForCausalLM

    name, mode = request.param
    if name == REAL:
        return _real_checkpoint()
    if mode == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA: corral's decoder on a GPU against transformers on the CPU")
    packed = mode == "onednn"
    device = torch.device("cuda" if mode == "cuda" else "cpu")
    config = CONFIGS[name]()
    torch.manual_seed(0)
    model: Any = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.08 * torch.randn(param.shape, generator=generator))
    model.eval()
    model_dir = tmp_path_factory.mktemp(name)
    # Qwen2 saves sharded (small shards + index), the others as one file: both layouts get loaded.
    model.save_pretrained(model_dir, max_shard_size="100KB" if name == "qwen2" else "50GB")
    assert unsupported_reason(model.config) is None
    with pytest.MonkeyPatch.context() as patch:
        if packed:
            patch.setattr(projection, "PACK_MIN_ELEMENTS", 0)
            patch.setattr(split_projection, "SPLIT_MIN_ELEMENTS", 0)  # the head in slices, as served
        ours = load_llama_family(model_dir, model.config, torch.float32, device)
    if packed and not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN: the packed path is not taken")
    assert ours.head.packed == packed and isinstance(ours.head, split_projection.SplitProjection) == packed
    loaded = LoadedModel(
        model=ours,
        tokenizer=None,
        path=model_dir,
        name=name,
        vocab_size=VOCAB,
        stop_token_ids=(),
        revision_token_id=None,
        context_length=256,
        device=device,
        dtype=torch.float32,
        impl="corral",
    )
    return Checkpoint(model, loaded)


@pytest.fixture(scope="module", autouse=True)
def _release_real_checkpoint() -> Iterator[None]:
    """The real model and its transformers twin hold ~2.2 GB: free them when this module is done."""
    yield
    _real_checkpoint.cache_clear()


@functools.cache
def _real_checkpoint() -> Checkpoint:
    from transformers import AutoModelForCausalLM

    from corral.server.models import load_model

    # The float decoder against transformers' (quantized serving is checked in test_quantized_projection.py).
    real = load_model(REAL, device="cpu", dtype="float32", model_impl="corral", quantization="none")
    reference = AutoModelForCausalLM.from_pretrained(real.path, dtype=torch.float32, attn_implementation="sdpa")
    assert type(reference).__name__ == "Gemma3ForCausalLM" and real.vocab_size == 262_144
    return Checkpoint(reference.eval(), real, REAL_TOLERANCE)


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass
class Row:
    """One sequence decoded greedily by corral; checked afterwards against one transformers forward over it."""

    prompt: list[int]
    chunk: int = 1  # >1: after each greedy token, feed chunk-1 extra tokens too (as forced tokens are fed)
    full: list[int] = field(default_factory=list)  # prompt + every token fed or chosen
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> corral's logits there
    greedy: set[int] = field(default_factory=set)  # positions whose next token corral chose by argmax
    slot: int = -1
    cached: int = 0
    pending: list[int] = field(default_factory=list)

    def done(self) -> bool:
        return len(self.greedy) >= STEPS


def _step(runner: ModelRunner, rows: list[Row]) -> None:
    """One shared forward for every unfinished row; each takes its argmax (plus forced extras)."""
    live = [r for r in rows if not r.done()]
    logits = runner.forward([ForwardRow(r.slot, r.cached, r.pending) for r in live])
    for row, got in zip(live, logits, strict=True):
        position = row.cached + len(row.pending) - 1
        del row.full[position + 1 :]
        row.logits[position] = got.cpu()  # the reference runs on the CPU
        row.greedy.add(position)
        token = int(got.argmax())
        forced = [(token * 7 + i) % VOCAB for i in range(1, row.chunk)]
        row.full += [token, *forced]
        row.cached = position + 1
        row.pending = [token, *forced]


def _check(ckpt: Checkpoint, row: Row) -> None:
    """transformers' logits over the whole sequence match corral's at every position it computed, and
    every greedy choice is transformers' argmax: by induction, identical greedy tokens."""
    with torch.no_grad():
        reference = ckpt.reference(torch.tensor([row.full])).logits[0].float()
    for position, got in row.logits.items():
        torch.testing.assert_close(got, reference[position], rtol=ckpt.tolerance, atol=ckpt.tolerance)
        if position in row.greedy:
            assert row.full[position + 1] == int(reference[position].argmax()), f"greedy differs at {position}"


def _admit(runner: ModelRunner, row: Row, free: list[int]) -> int:
    row.slot, hit = runner.prefix.place(row.prompt, free)
    free.remove(row.slot)
    row.cached, row.pending, row.full = hit, row.prompt[hit:], list(row.prompt)
    return hit


def test_rope_scaling_is_exercised() -> None:
    plain, _ = rope_frequencies(mistral_config(), 16)
    scaled, _ = rope_frequencies(llama3_config(), 16)
    assert not torch.equal(plain, scaled)


def test_logits_and_greedy_tokens_match_transformers(checkpoint: Checkpoint) -> None:
    """Rows of different lengths, a multi-token row and a rollback, all in one batch for 64 steps."""
    assert isinstance(checkpoint.ours.model, LlamaFamilyModel)
    runner = ModelRunner(checkpoint.ours, max_batch=4, max_len=256, prefix_cache=False)
    rows = [Row(_prompt(1, 37)), Row(_prompt(2, 5)), Row(_prompt(3, 20), chunk=3)]
    free = list(range(4))
    for row in rows:
        _admit(runner, row, free)
    steps = 0
    while not all(r.done() for r in rows):
        _step(runner, rows)
        steps += 1
        if steps == 30:
            # A revision: write a wrong token's KV, then roll back as Engine._revise does (lower the
            # length, re-feed the last kept token); the rest of the run must be unaffected.
            victim = rows[0]
            runner.forward([ForwardRow(victim.slot, victim.cached, [(victim.pending[0] + 1) % VOCAB])])
            victim.cached -= 1
            victim.pending = [victim.full[victim.cached]]
    assert steps >= STEPS
    for row in rows:
        _check(checkpoint, row)


def test_prefix_cache_hits_match_transformers(checkpoint: Checkpoint) -> None:
    """A shared system prompt, a second sample of the same prompt and a conversation's next turn reuse
    cached KV (copied between slots or found in place) and still decode exactly."""
    runner = ModelRunner(checkpoint.ours, max_batch=4, max_len=256)
    system = _prompt(10, 2 * BLOCK_SIZE + 5)
    first = Row(system + _prompt(11, 11))  # exactly 3 blocks
    free = list(range(4))
    assert _admit(runner, first, free) == 0
    _step(runner, [first])  # its prompt's KV is now written and indexed
    same_system = Row(system + _prompt(12, 3))
    same_prompt = Row(list(first.prompt))  # `n` > 1: another sample of the same prompt
    assert _admit(runner, same_system, free) == len(system)  # two blocks, then token by token
    # The whole prompt is cached; its last token is fed again for its logits.
    assert _admit(runner, same_prompt, free) == 3 * BLOCK_SIZE - 1
    rows = [first, same_system, same_prompt]
    while not all(r.done() for r in rows):
        _step(runner, rows)
    # The first sequence ends; its next turn (its whole text plus a new message) lands in its own slot.
    runner.prefix.release(first.slot)
    free.append(first.slot)
    next_turn = Row(first.full[:-1] + _prompt(13, 4))
    hit = _admit(runner, next_turn, free)
    assert next_turn.slot == first.slot
    assert hit == len(first.full) - 1  # every token it fed; its last sampled one was never fed
    while not next_turn.done():
        _step(runner, [next_turn])
    for row in (*rows, next_turn):
        _check(checkpoint, row)
    assert runner.prefix.hit_tokens == len(system) + 3 * BLOCK_SIZE - 1 + hit


def test_real_model_past_its_sliding_window() -> None:
    """Gemma 3 270M's sliding layers see 512 keys: a 600-token context, prefilled in two pieces and then
    decoded, matches transformers at every fed position past the window; the window changes the answer."""
    ckpt = _real_checkpoint()
    runner = ModelRunner(ckpt.ours, max_batch=2, max_len=1024, prefix_cache=False)
    tokens = torch.randint(10, 20_000, (620,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        reference = ckpt.reference(torch.tensor([tokens])).logits[0].float()
    got = {99: runner.forward([ForwardRow(0, 0, tokens[:100])])[0]}
    got[599] = runner.forward([ForwardRow(0, 100, tokens[100:600])])[0]
    for position in range(600, 620):  # decode steps beside a short row in slot 1 (one shared batch)
        both = runner.forward([ForwardRow(0, position, tokens[position : position + 1]),
                               ForwardRow(1, position - 600, tokens[position - 600 : position - 599])])
        got[position] = both[0]
    for position, logits in got.items():
        torch.testing.assert_close(logits, reference[position], rtol=ckpt.tolerance, atol=ckpt.tolerance)
        assert int(logits.argmax()) == int(reference[position].argmax())
    window = runner.cache.window
    assert window == 512
    runner.cache.window = None  # every layer attending fully: not what the model computes past 512
    try:
        unwindowed = runner.forward([ForwardRow(1, 0, tokens[:600])])[0]
    finally:
        runner.cache.window = window
    assert (unwindowed - reference[599]).abs().max() > 1.0


def test_transformers_path_keeps_sliding_layers_in_their_window() -> None:
    """`--model-impl transformers` on a model with sliding and full layers (Gemma 3, window 24 here) gives each
    kind its own mask: a row decoded past the window matches the model's own forward over the sequence."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model: Any = AutoModelForCausalLM.from_config(gemma3_config()).eval()
    loaded = LoadedModel(model=model, tokenizer=None, path=None, name="gemma3-small",  # type: ignore[arg-type]
                         vocab_size=VOCAB, stop_token_ids=(), revision_token_id=None, context_length=256,
                         device=torch.device("cpu"), dtype=torch.float32, impl="transformers")
    tokens = _prompt(21, 70)
    runner = ModelRunner(loaded, max_batch=2, max_len=256, prefix_cache=False)
    with torch.no_grad():
        reference = model(torch.tensor([tokens])).logits[0].float()
        got = {39: runner.forward([ForwardRow(0, 0, tokens[:40])])[0]}
        for position in range(40, 70):  # decode steps, beside a second row
            got[position] = runner.forward([ForwardRow(0, position, tokens[position : position + 1]),
                                            ForwardRow(1, position - 40, tokens[position - 40 : position - 39])])[0]
    for position, logits in got.items():
        torch.testing.assert_close(logits, reference[position], rtol=TOLERANCE, atol=TOLERANCE)
