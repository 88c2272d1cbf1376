"""Products of many rows take a GGUF's own blocks, products of few its repacked weights
(corral/server/models/wide_rows.py): the choice from timings, the routing by a step's rows, the same logits."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_models import VOCAB, write_small_gguf

import corral.server.models.gguf_file as gguf_file
from corral.kernels.row_kernel import layer_graphs_available
from corral.server.engine.model_runner import ForwardRow, ModelRunner
from corral.server.models.gguf_decoder import GgufDecoder
from corral.server.models.loading import LoadedModel
from corral.server.models.wide_rows import settle_wide_rows, timed_rows, wide_start

pytestmark = pytest.mark.skipif(
    not layer_graphs_available(),
    reason="ggml is off: the ggml extra is not installed (pip install -e '.[ggml]') or CORRAL_ROW_KERNEL says so",
)

TOLERANCE = 0.04  # of the logits' scale, as tests/engine/test_gguf_decoder.py allows the blocks' rounding


def test_the_blocks_are_chosen_from_the_first_count_where_they_win_at_every_larger_one() -> None:
    assert wide_start([(8, 1.0, 1.2), (16, 1.0, 0.8), (32, 2.0, 1.0)]) == 16
    assert wide_start([(8, 1.0, 0.5), (16, 1.0, 1.5), (32, 2.0, 1.0)]) == 32  # a loss at 16 keeps 8 and 16 repacked
    assert wide_start([(8, 1.0, 0.95), (16, 1.0, 0.95)]) is None  # inside the margin: noise, not a win
    assert wide_start([(8, 1.0, 2.0), (16, 1.0, 1.1)]) is None
    assert wide_start([]) is None


def _decoder(path: Path, config: Any, repack: bool) -> GgufDecoder:
    parts = gguf_file.GgufFile(path)
    return GgufDecoder(parts, config, "llama", repack=("attn_v", "attn_output", "ffn_up") if repack else ()).eval()


def _runner(model: GgufDecoder) -> ModelRunner:
    loaded = LoadedModel(model=model, tokenizer=None, path=Path("."), name="small", vocab_size=VOCAB,
                         stop_token_ids=(), revision_token_id=None, context_length=256,
                         device=torch.device("cpu"), dtype=torch.float32, impl="corral", quantization="gguf")
    return ModelRunner(loaded, max_batch=2, max_len=64, prefix_cache=False)


def _spoil_layer_zero(file: gguf_file.GgufFile) -> None:
    """Every float16 scale of layer 0's repacked copies NaN (layer 0's products see every token of a step)."""
    for name in file.repacked_names():
        if name.startswith("blk.0."):
            weight = file.weight(name)
            junk = bytes([0xFF]) * weight.nbytes
            gguf_file._tensor_set(weight.ggml_weight, ctypes.cast(ctypes.c_char_p(junk), ctypes.c_void_p).value or 0,
                                  weight.nbytes)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("wide") / "llama.gguf"
    return path, write_small_gguf(path, "llama").config


def test_a_step_of_many_rows_multiplies_the_blocks_and_one_of_few_the_repacked_copy(small: tuple[Path, Any]) -> None:
    """With products of 4 rows and more settled on the blocks and layer 0's repacked copies spoiled, a prompt of 8
    tokens gives the logits of the file served unrepacked, and a decode step of one token is spoiled: the step's
    rows pick the weights."""
    path, config = small
    wide = _decoder(path, config, repack=True)
    if not wide.file.repacked_bytes:
        pytest.skip("ggml repacks none of these weights on this CPU (no AVX2)")
    wide.file.settle_wide_rows(4)
    _spoil_layer_zero(wide.file)
    plain = _decoder(path, config, repack=False)
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    ours, theirs = _runner(wide), _runner(plain)
    first, reference = ours.forward([ForwardRow(0, 0, prompt[:8])]), theirs.forward([ForwardRow(0, 0, prompt[:8])])
    scale = float(reference.abs().max())
    assert float((first - reference).abs().max()) <= TOLERANCE * scale
    step, expected = ours.forward([ForwardRow(0, 8, prompt[8:])]), theirs.forward([ForwardRow(0, 8, prompt[8:])])
    assert not torch.isfinite(step).all() or float((step - expected).abs().max()) > TOLERANCE * scale


def test_never_wide_keeps_every_product_on_the_repacked_copy(small: tuple[Path, Any]) -> None:
    path, config = small
    decoder = _decoder(path, config, repack=True)
    if not decoder.file.repacked_bytes:
        pytest.skip("ggml repacks none of these weights on this CPU (no AVX2)")
    decoder.file.settle_wide_rows(None)
    _spoil_layer_zero(decoder.file)
    prompt = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(4)).tolist()
    logits = _runner(decoder).forward([ForwardRow(0, 0, prompt)])
    reference = _runner(_decoder(path, config, repack=False)).forward([ForwardRow(0, 0, prompt)])
    assert not torch.isfinite(logits).all() or float((logits - reference).abs().max()) > TOLERANCE * float(
        reference.abs().max())


def test_the_timed_choice_serves_the_same_logits_at_every_step_size(
    small: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Whatever the timings choose on this CPU, prompts and decode steps of one and several tokens a row give the
    unrepacked file's logits."""
    monkeypatch.setenv("CORRAL_CACHE_DIR", str(tmp_path))
    path, config = small
    decoder = _decoder(path, config, repack=True)
    if not decoder.file.repacked_bytes:
        pytest.skip("ggml repacks none of these weights on this CPU (no AVX2)")
    largest = max(decoder.file.repacked_names(), key=decoder.file.nbytes)
    assert [rows for rows, *_ in timed_rows(decoder.file.weight(largest), (2, 8))] == [2, 8]
    start = settle_wide_rows(decoder.file)
    assert start is None or start >= 8
    plain = _decoder(path, config, repack=False)
    ours, theirs = _runner(decoder), _runner(plain)
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    for position, rows in ((0, prompt[:32]), (32, prompt[32:33]), (33, prompt[33:40])):
        a, b = ours.forward([ForwardRow(0, position, rows)]), theirs.forward([ForwardRow(0, position, rows)])
        assert float((a - b).abs().max()) <= TOLERANCE * float(b.abs().max())



def test_the_choice_is_timed_once_per_file_cpu_and_ggml_build(
    small: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A restart reads the choice the first load timed (the same products, so the same answers, on every start),
    a kept choice of no blocks included."""
    import corral.server.models.wide_rows as wide_rows

    path, config = small
    monkeypatch.setenv("CORRAL_CACHE_DIR", str(tmp_path / "cache"))
    decoder = _decoder(path, config, repack=True)
    if not decoder.file.repacked_bytes:
        pytest.skip("ggml repacks none of these weights on this CPU (no AVX2)")
    monkeypatch.setattr(wide_rows, "timed_rows", lambda weight: [(8, 1.0, 0.5), (16, 1.0, 0.5)])
    assert settle_wide_rows(decoder.file) == 8

    def untimed(weight: Any) -> None:
        raise AssertionError("timed again")

    monkeypatch.setattr(wide_rows, "timed_rows", untimed)
    again = _decoder(path, config, repack=True)
    assert settle_wide_rows(again.file) == 8 and again.file.wide_rows.start == 8
    monkeypatch.setenv("CORRAL_CACHE_DIR", str(tmp_path / "other"))
    monkeypatch.setattr(wide_rows, "timed_rows", lambda weight: [(8, 1.0, 2.0), (16, 1.0, 2.0)])
    assert settle_wide_rows(_decoder(path, config, repack=True).file) is None
    monkeypatch.setattr(wide_rows, "timed_rows", untimed)
    assert settle_wide_rows(_decoder(path, config, repack=True).file) is None


def test_the_memory_a_decoder_holds_counts_the_blocks_kept_beside_repacked_copies(small: tuple[Path, Any]) -> None:
    """The start-up memory check counts what the weights hold: with wide products the repacked weights' blocks
    too, without them what a step reads alone."""
    path, config = small
    decoder = _decoder(path, config, repack=True)
    if not decoder.file.repacked_bytes:
        pytest.skip("ggml repacks none of these weights on this CPU (no AVX2)")
    decoder.file.settle_wide_rows(16)
    assert decoder.weight_memory_bytes() == decoder.step_read_bytes() + decoder.file.repacked_bytes
    decoder.file.settle_wide_rows(None)
    assert decoder.weight_memory_bytes() == decoder.step_read_bytes()
