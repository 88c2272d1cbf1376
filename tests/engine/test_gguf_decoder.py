"""A GGUF served from its own blocks (corral/server/models/gguf_decoder.py): every step on ggml, the weights where the
file lies. Small Llama, Qwen2 and Gemma 3 models are written as GGUF files the way llama.cpp's converter writes
them (tests/engine/gguf_models.py) and checked against transformers' forward over the values their blocks
decode to: prompts alone and beside decode rows in one step, decode rows of one and several tokens, rows past a
sliding window, several slots; a restricted row's logits against the full head's; the weights never copied."""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_models import VOCAB, write_small_gguf

from corral.kernels.half_sums import attention_sums_in_half
from corral.kernels.row_kernel import layer_graphs_available
from corral.server.engine.model_runner import ForwardRow, ModelRunner
from corral.server.models.gguf_decoder import GgufDecoder, load_gguf_decoder
from corral.server.models.gguf_file import GgufFile
from corral.server.models.loading import LoadedModel

pytestmark = pytest.mark.skipif(
    not layer_graphs_available(),
    reason="ggml is off: the ggml extra is not installed (pip install -e '.[ggml]') or CORRAL_ROW_KERNEL says so",
)

ARCHS = ("llama", "qwen2", "gemma3")
# The products round their inputs to 8 bits (as llama.cpp's do) and the cache holds float16: logits agree with
# float32's within a few hundredths of their scale, where a wrong row, position or mask is off by the scale.
TOLERANCE = 0.04


@pytest.fixture(scope="module", params=ARCHS)
def written(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    arch = str(request.param)
    path = tmp_path_factory.mktemp(f"gguf-{arch}") / f"{arch}.gguf"
    reference = write_small_gguf(path, arch)
    decoder = load_gguf_decoder(path, reference.config, arch)
    yield decoder, reference


def _runner(model: GgufDecoder, slots: int = 4) -> ModelRunner:
    loaded = LoadedModel(model=model, tokenizer=None, path=Path("."), name="small", vocab_size=VOCAB,
                         stop_token_ids=(), revision_token_id=None, context_length=256,
                         device=torch.device("cpu"), dtype=torch.float32, impl="corral", quantization="gguf")
    return ModelRunner(loaded, max_batch=slots, max_len=128, prefix_cache=False)


@torch.inference_mode()
def _reference(model: Any, tokens: list[int]) -> torch.Tensor:
    """transformers' logits at every position of `tokens` (one forward, no cache)."""
    return model(torch.tensor([tokens])).logits[0].float()


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    scale = float(theirs.abs().max())
    assert float((ours - theirs).abs().max()) <= TOLERANCE * scale


def _sequence(seed: int, length: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prompts_and_decode_rows_match_transformers(written: tuple[Any, Any]) -> None:
    """A 40-token prompt alone (past Gemma's 16-token window), then a step holding a second prompt beside the
    first row's decode token (short and long rows in one graph), then decode steps of one and of three tokens a
    row (a sampled token and forced ones) in two slots."""
    decoder, reference = written
    runner = _runner(decoder)
    first, second = _sequence(1, 48), _sequence(2, 30)
    logits = runner.forward([ForwardRow(1, 0, first[:40])])
    _close(logits[0], _reference(reference, first[:40])[-1])
    steps = decoder.graphs.prompt_steps
    logits = runner.forward([ForwardRow(1, 40, first[40:41]), ForwardRow(3, 0, second[:25])])
    assert decoder.graphs.prompt_steps == steps + 1
    _close(logits[0], _reference(reference, first[:41])[-1])
    _close(logits[1], _reference(reference, second[:25])[-1])
    logits = runner.forward([ForwardRow(3, 25, second[25:28]), ForwardRow(1, 41, first[41:42])])
    _close(logits[0], _reference(reference, second[:28])[-1])
    _close(logits[1], _reference(reference, first[:42])[-1])
    decode = decoder.graphs.decode_steps
    for step in range(42, 48):
        logits = runner.forward([ForwardRow(1, step, first[step : step + 1]), ForwardRow(3, step - 14, [7])])
        _close(logits[0], _reference(reference, first[: step + 1])[-1])
    assert decoder.graphs.decode_steps == decode + 6


def test_one_row_and_a_batch_agree_on_every_row(written: tuple[Any, Any]) -> None:
    """The same prompt in four slots at once (out of slot order) and alone: the same logits a row."""
    decoder, _ = written
    prompt = _sequence(3, 12)
    batch = _runner(decoder).forward([ForwardRow(slot, 0, prompt) for slot in (2, 0, 3, 1)])
    alone = _runner(decoder).forward([ForwardRow(0, 0, prompt)])
    for row in range(4):
        torch.testing.assert_close(batch[row], alone[0], atol=1e-4, rtol=1e-4)


def test_a_restricted_row_gets_the_exact_logits_of_its_allowed_tokens(written: tuple[Any, Any]) -> None:
    """A grammar-restricted row's allowed logits are the head's exact products (float32 dot products of the decoded
    rows), every other token -inf; a full row's best logits are made the same exact values by `refine`."""
    decoder, _ = written
    runner = _runner(decoder)
    prompt = _sequence(4, 10)
    allowed = torch.tensor([3, 17, 200, 5])
    step = runner.decode([ForwardRow(0, 0, prompt)])
    restricted = runner.head(step, {0: allowed}).rows
    full = _runner(decoder).forward([ForwardRow(0, 0, prompt)])
    assert torch.isinf(restricted[0]).sum() == VOCAB - len(allowed)
    hidden = step.hidden
    assert hidden is not None
    exact = decoder.head.select(hidden, torch.zeros(len(allowed), dtype=torch.long), allowed)
    torch.testing.assert_close(restricted[0, allowed], exact)
    torch.testing.assert_close(full[0, allowed], exact, atol=0.05 * float(exact.abs().max()), rtol=0.0)
    best = int(full[0].argmax())
    with torch.inference_mode():
        decoder.refine(full, hidden, [0], [1])
    exact_best = decoder.head.select(hidden, torch.zeros(1, dtype=torch.long), torch.tensor([best]))
    assert float(full[0, best]) == pytest.approx(float(exact_best[0]), abs=1e-5)


def test_a_dense_step_ends_its_graph_in_the_head_with_the_same_logits(written: tuple[Any, Any]) -> None:
    """A step whose rows all want every logit (free text: `decode(dense=True)`) computes them in the decoder's
    graph: bit for bit the head's own product, for a step with a prompt and for decode steps of one and two
    rows; given allowed ids after all, `head` still restricts the row."""
    decoder, _ = written
    prompt = _sequence(5, 24)
    steps = [[ForwardRow(0, 0, prompt[:20]), ForwardRow(2, 0, prompt[:7])]]
    steps += [[ForwardRow(0, 20 + i, [prompt[20 + i]]), ForwardRow(2, 7 + i, [prompt[i]])] for i in range(3)]
    steps += [[ForwardRow(0, 23, [prompt[23]])]]
    results = []
    for dense in (False, True):
        runner = _runner(decoder)
        got = []
        for rows in steps:
            step = runner.decode(rows, dense)
            assert (step.logits is not None) == dense
            got.append(runner.head(step, {}).rows)
        results.append(got)
    for separate, fused in zip(*results, strict=True):
        assert torch.equal(separate, fused)
    runner = _runner(decoder)
    step = runner.decode([ForwardRow(0, 0, prompt[:9])], dense=True)
    allowed = torch.tensor([3, 17, 5])
    restricted = runner.head(step, {0: allowed}).rows
    assert torch.isinf(restricted[0]).sum() == VOCAB - len(allowed)


def test_weights_stay_in_the_files_mapping_or_are_repacked_once(written: tuple[Any, Any]) -> None:
    """Every weight ggml multiplies lies inside the file's memory map, except those repacked for ggml's GEMM
    kernels (on AVX2 the Q4_0 ones here), whose blocks stay where they lie for products of many rows
    (wide_rows.py): nothing converted to float."""
    decoder, _ = written
    file = decoder.file
    base, end = int(file._map.ctypes.data), int(file._map.ctypes.data) + file._map.size
    names = [name for name in file.index if name.endswith(".weight") and "norm" not in name]
    assert names
    repacked = 0
    for name in names:
        pointer = int(file.weight(name).ggml_weight.contents.data)
        if base <= pointer < end:
            continue
        assert file.info(name).ggml_type == 2 and name.startswith("blk.")  # Q4_0 layer weights only
        assert int(file.weight(name).blocks.contents.data) == base + file.info(name).offset
        repacked += file.nbytes(name)
    assert repacked == file.repacked_bytes
    if file.repacked_bytes:
        assert repacked > 0
    assert decoder.step_read_bytes() == sum(file.nbytes(n) for n in names if n != "token_embd.weight") + (
        file.nbytes("token_embd.weight") if "output.weight" not in file else 0
    )


def test_repacked_weights_give_the_logits_of_the_files_own(written: tuple[Any, Any], tmp_path: Path) -> None:
    """The same file served without repacking (its weights where they lie): the same logits to rounding."""
    decoder, reference = written
    if not decoder.file.repacked_bytes:
        pytest.skip("ggml repacks none of these weights on this CPU (no AVX2)")
    plain = GgufDecoder(GgufFile(decoder.file.path), reference.config, decoder.arch, repack=()).eval()
    assert plain.file.repacked_bytes == 0
    prompt = _sequence(5, 20)
    ours = _runner(decoder).forward([ForwardRow(0, 0, prompt), ForwardRow(1, 0, prompt[:3])])
    theirs = _runner(plain).forward([ForwardRow(0, 0, prompt), ForwardRow(1, 0, prompt[:3])])
    # The interleaved kernels sum in another order (Gemma's sandwich norms amplify it to ~1 % of the scale here);
    # a weight laid out wrong would be off by the scale itself.
    torch.testing.assert_close(ours, theirs, atol=2e-2 * float(theirs.abs().max()), rtol=0.0)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def _spoil_repacked(monkeypatch: pytest.MonkeyPatch, spoils: Any, cache: Path) -> None:
    """Repacking then spoils the repacked weights `spoils(name)` picks: every float16 scale NaN. The verdicts go
    to `cache`, apart from the right ones the module's loads kept."""
    import corral.server.models.gguf_file as gguf_file
    monkeypatch.setenv("CORRAL_CACHE_DIR", str(cache))
    repack = gguf_file.GgufFile.repack

    def spoiled(self: gguf_file.GgufFile, names: Any) -> int:
        done = repack(self, names)
        for name, weight in self._weights.items():  # after repack, only the repacked weights are made
            if spoils(name):
                junk = bytes([0xFF]) * weight.nbytes
                address = ctypes.cast(ctypes.c_char_p(junk), ctypes.c_void_p).value or 0
                gguf_file._tensor_set(weight.ggml_weight, address, weight.nbytes)
        return done

    monkeypatch.setattr(gguf_file.GgufFile, "repack", spoiled)


def test_repacked_weights_that_compute_wrong_are_not_served(
    written: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """ggml's interleaved kernels are chosen per CPU, and on one (an AVX-512/AMX Xeon) they answered a real model's
    prompts with noise: a loaded decoder keeps its repacked weights only where a probe prompt gives it the plain
    decoder's logits (corral/server/models/repack_check.py). Here the repacked weights are spoiled after repacking
    (NaN scales), and the file is served where its blocks lie, with a warning that says so."""
    decoder, reference = written
    if not decoder.file.repacked_bytes:
        pytest.skip("ggml repacks none of these weights on this CPU (no AVX2)")
    _spoil_repacked(monkeypatch, lambda name: True, tmp_path)
    with caplog.at_level(logging.WARNING, logger="corral.server.models.gguf_decoder"):
        served = load_gguf_decoder(decoder.file.path, reference.config, decoder.arch)
    assert served.file.repacked_bytes == 0
    assert "wrong logits on this CPU" in caplog.text and "none repacked" in caplog.text
    prompt = _sequence(6, 12)
    ours = _runner(served).forward([ForwardRow(0, 0, prompt)])
    theirs = _runner(decoder).forward([ForwardRow(0, 0, prompt)])
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, theirs, atol=2e-2 * float(theirs.abs().max()), rtol=0.0)


def test_where_the_attention_weights_repack_wrong_the_mlps_alone_are_repacked(
    written: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """The second stage (on the CPU where repacking failed, the MLP's weights were right and carried most of the
    prompt speed): attention weights spoiled, MLP weights right, and the decoder served has the MLP's alone
    repacked, with the first stage's warning."""
    decoder, reference = written
    if not decoder.file.repacked_bytes:  # its Q4_0 weights, ffn_up among them
        pytest.skip("ggml repacks none of these weights on this CPU (no AVX2)")
    _spoil_repacked(monkeypatch, lambda name: ".ffn_" not in name, tmp_path)
    with caplog.at_level(logging.WARNING, logger="corral.server.models.gguf_decoder"):
        served = load_gguf_decoder(decoder.file.path, reference.config, decoder.arch)
    file = served.file
    base, end = int(file._map.ctypes.data), int(file._map.ctypes.data) + file._map.size
    repacked = [name for name in file.index if name.startswith("blk.") and name.endswith(".weight")
                and "norm" not in name and not base <= int(file.weight(name).ggml_weight.contents.data) < end]
    assert repacked and all(".ffn_" in name for name in repacked)
    assert file.repacked_bytes == sum(file.nbytes(name) for name in repacked)
    assert "wrong logits on this CPU" in caplog.text and "none repacked" not in caplog.text
    prompt = _sequence(7, 12)
    ours = _runner(served).forward([ForwardRow(0, 0, prompt)])
    theirs = _runner(decoder).forward([ForwardRow(0, 0, prompt)])
    torch.testing.assert_close(ours, theirs, atol=2e-2 * float(theirs.abs().max()), rtol=0.0)


def test_a_verdict_is_probed_once_per_file_cpu_and_ggml_build(
    written: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """A restart reads the probe's verdict from corral's cache instead of probing again, wrong verdicts included;
    a file changed since is probed again."""
    import corral.server.models.gguf_decoder as gguf_decoder

    decoder, reference = written
    if not decoder.file.repacked_bytes:
        pytest.skip("ggml repacks none of these weights on this CPU (no AVX2)")
    probes: list[float] = []
    probe = gguf_decoder.repacked_agree

    def counted(*args: Any) -> tuple[bool, float]:
        verdict = probe(*args)
        probes.append(verdict[1])
        return verdict

    monkeypatch.setattr(gguf_decoder, "repacked_agree", counted)
    path = tmp_path / "copy.gguf"
    path.write_bytes(decoder.file.path.read_bytes())
    _spoil_repacked(monkeypatch, lambda name: ".ffn_" not in name, tmp_path / "cache")

    def load() -> GgufDecoder:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="corral.server.models.gguf_decoder"):
            return load_gguf_decoder(path, reference.config, decoder.arch)

    first = load()
    assert len(probes) == 2 and first.file.repacked_bytes < decoder.file.repacked_bytes  # the MLP's alone
    again = load()
    assert len(probes) == 2, "the verdicts were probed again"
    assert again.file.repacked_bytes == first.file.repacked_bytes
    assert "wrong logits on this CPU" in caplog.text  # a kept verdict still says what is served
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000_000))
    load()
    assert len(probes) == 4


def test_the_installed_ggml_sums_attention_scores_in_float32() -> None:
    """`make install` builds ggml with float32 sums of float16 products (-mno-avx512fp16); a native build on a CPU
    with AVX512-FP16 sums them in float16 and overflows in attention over a float16 KV cache."""
    assert not attention_sums_in_half()


def test_scores_past_float16s_range_give_transformers_logits(tmp_path: Path) -> None:
    """Heads of 128 (ggml's vector sums start at 128 elements) and query and key biases of 30 make unscaled scores
    ~115,000 (Qwen2.5's layer 0 reaches ~87,000): a prompt and decode rows still give transformers' logits.
    Summed in float16, such scores overflow and two infinite ones make a head's softmax NaN
    (corral/kernels/half_sums.py)."""
    path = tmp_path / "large-keys.gguf"
    reference = write_small_gguf(path, "qwen2", head_dim=128, key_bias=30.0)
    decoder = GgufDecoder(GgufFile(path), reference.config, "qwen2", repack=())
    runner = _runner(decoder)
    tokens = _sequence(5, 24)
    _close(runner.forward([ForwardRow(0, 0, tokens[:20])])[0], _reference(reference, tokens[:20])[-1])
    for step in range(20, 24):
        _close(runner.forward([ForwardRow(0, step, tokens[step : step + 1])])[0],
               _reference(reference, tokens[: step + 1])[-1])


def test_a_ggml_that_sums_in_float16_gets_a_float32_kv_cache(
    written: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the check finds float16 sums, the decoder's cache is float32 (its attention then sums in float32)
    and its logits are those of the float16 cache's decoder."""
    from corral.server.models import gguf_decoder

    decoder, reference = written
    monkeypatch.setattr(gguf_decoder, "attention_sums_in_half", lambda: True)
    wide = GgufDecoder(GgufFile(decoder.file.path), reference.config, decoder.arch, repack=())
    assert wide.kv_dtype == torch.float32 and decoder.kv_dtype == torch.float16
    prompt = _sequence(6, 20)
    ours = _runner(wide).forward([ForwardRow(0, 0, prompt)])[0]
    _close(ours, _reference(reference, prompt)[-1])
