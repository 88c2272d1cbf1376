"""The grammar-restricted head: a masked row computes only its allowed logits, and decodes exactly what the
full projection followed by the mask decodes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import run_until_done

from corral.grammar_engines.compilation import GrammarCache
from corral.grammar_engines.protocol import TokenizerSpec
from corral.grammar_engines.registry import BackendSet
from corral.grammars.spec import GrammarSpec
from corral.server.engine import Engine, EngineConfig, SamplingParams
from corral.server.engine import Sequence as Seq
from corral.server.engine.model_runner import ForwardRow, ModelRunner
from corral.server.models import LoadedModel, load_model
from corral.server.models.llama_family import LlamaFamilyModel

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer"}},
        "required": ["colour", "n"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 2, "maxItems": 4},
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
    },
]


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("corral-tiny", device="cpu")


@pytest.fixture(scope="module")
def loaded_int8() -> LoadedModel:
    """A head whose kernel rounds its logits to bfloat16, refined where they decide (logit_refinement.py)."""
    return load_model("corral-tiny", device="cpu", quantization="int8")


def test_restricted_logits_equal_the_masked_full_projection(loaded: LoadedModel) -> None:
    model = loaded.model
    assert isinstance(model, LlamaFamilyModel)
    runner = ModelRunner(loaded, max_batch=3, max_len=64, prefix_cache=False)
    generator = torch.Generator().manual_seed(0)
    allowed = {0: torch.tensor([7, 128_000, 3, 42]), 2: torch.zeros(0, dtype=torch.int64)}
    rows = [ForwardRow(slot, 0, torch.randint(0, 1000, (5 + slot,), generator=generator).tolist()) for slot in range(3)]
    calls: list[int] = []

    def restrict() -> dict[int, torch.Tensor]:
        calls.append(1)
        return allowed

    restricted = runner.forward(rows, restrict)
    assert calls == [1] and runner.restricts_head
    full = ModelRunner(loaded, max_batch=3, max_len=64, prefix_cache=False).forward(rows)
    ids = allowed[0]
    torch.testing.assert_close(restricted[0, ids], full[0, ids], rtol=1e-5, atol=1e-5)
    others = torch.ones(full.shape[1], dtype=torch.bool)
    others[ids] = False
    assert torch.isneginf(restricted[0, others]).all()
    torch.testing.assert_close(restricted[1], full[1])  # not named: the whole projection
    assert torch.isneginf(restricted[2]).all()  # no token allowed: nothing computed


def _decode(
    loaded: LoadedModel, cache: GrammarCache, backends: BackendSet, *, restricted: bool
) -> tuple[list[Any], int]:
    engine = Engine(loaded, EngineConfig(max_batch=4, max_model_len=512, revision_token_id=loaded.revision_token_id))
    engine.runner._impl.restricts_head = restricted  # type: ignore[attr-defined]  # the switch under test
    model = engine.runner._impl.model  # type: ignore[attr-defined]
    cut_rows: list[int] = []
    original = model.restricted_logits

    def counting(hidden: torch.Tensor, allowed: dict[int, torch.Tensor], best_only: list[int]) -> torch.Tensor:
        cut_rows.append(len(allowed))
        return original(hidden, allowed, best_only)

    model.restricted_logits = counting
    backend = backends.get("llguidance")
    seqs = []
    for i, schema in enumerate(SCHEMAS):
        compiled = cache.compile(GrammarSpec.json_schema(schema), "llguidance")
        prompt = loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"answer {i}"}], add_generation_prompt=True, tokenize=True
        )
        ids = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "input_ids") else prompt
        seq = Seq(
            request_id=f"r{i}",
            prompt_ids=[int(t) for t in ids],
            sink=lambda _: None,
            params=SamplingParams(temperature=0.0, max_tokens=48, logprobs=True, top_logprobs=3),
        )
        seq.matcher, seq.backend = backend.new_matcher(compiled.compiled), backend
        engine.add_request(seq)
        seqs.append(seq)
    run_until_done(engine, seqs, max_steps=400)
    return [(s.output_ids, s.finish_reason, s.logprobs) for s in seqs], sum(cut_rows)


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "int8"])
def test_restricted_head_decodes_what_the_masked_full_head_decodes(
    loaded: LoadedModel, loaded_int8: LoadedModel, quantized: bool
) -> None:
    loaded = loaded_int8 if quantized else loaded
    backends = BackendSet(TokenizerSpec(loaded.tokenizer, loaded.vocab_size, loaded.stop_token_ids))
    cache = GrammarCache(backends)
    cut, cut_rows = _decode(loaded, cache, backends, restricted=True)
    full, full_rows = _decode(loaded, cache, backends, restricted=False)
    assert cut_rows > 0, "no row was restricted: the test would not test the restricted head"
    assert full_rows == 0
    for (tokens, finish, logprobs), (tokens_full, finish_full, logprobs_full) in zip(cut, full, strict=True):
        assert tokens == tokens_full and finish == finish_full
        for got, want in zip(logprobs, logprobs_full, strict=True):
            assert got.token == want.token and [t for t, _ in got.top] == [t for t, _ in want.top]
            # int8: the full row's normaliser sums logits rounded to bfloat16 (only its best few are made exact).
            assert got.logprob == pytest.approx(want.logprob, abs=5e-3 if quantized else 1e-4)
