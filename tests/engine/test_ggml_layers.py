"""Steps of few tokens through ggml graphs (corral/kernels/ggml_layers.py) give the logits of the same fp16
model computed op by op in torch (its products on the same ggml kernels), on every decoder variant the family
has: biases (Qwen2), per-head q/k norms (Qwen3, Gemma 3), scaled RoPE (Llama 3.1), sliding windows, Gemma's
sandwich norms, GELU gate and two RoPE tables. Steps of few tokens a row run the one-graph decoder with ggml's
attention over the KV cache: one token a row or several (a sampled token and the grammar's forced ones, a short
prompt), rows in consecutive slots, out of slot order or with free slots between them; steps over a cache the
graph cannot read run the per-layer graphs with torch's attention; rows grow past a sliding window and a key
bucket.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from small_llama_configs import CONFIGS as ALL_CONFIGS
from small_llama_configs import VOCAB, qwen3_config

from corral.kernels.choice import KernelOptions, use_kernels
from corral.kernels.ggml_layers import GgmlLayerSteps
from corral.kernels.row_kernel import LAYER_MAX_ROWS, layer_graphs_available
from corral.server.engine.model_runner import ForwardRow, ModelRunner
from corral.server.models.llama_family import LlamaFamilyModel, load_llama_family
from corral.server.models.loading import LoadedModel

pytestmark = pytest.mark.skipif(
    not layer_graphs_available(),
    reason="ggml layer graphs are off: the ggml extra is not installed (pip install -e '.[ggml]')",
)

# The decoder variants of the equivalence tests, Mistral with its sliding window only (its plain form adds nothing).
CONFIGS = {name: build for name, build in ALL_CONFIGS.items() if name != "mistral"}


def _fp16_model(config: Any, directory: Path) -> LlamaFamilyModel:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model: Any = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            gain = name.endswith("norm.weight")
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if gain else 0.08 * noise)
            if name.endswith(".bias"):
                param.add_(0.2)  # Qwen2's q/k/v biases: large enough that dropping one would show
    model.save_pretrained(directory)
    return load_llama_family(directory, model.config, torch.float32, torch.device("cpu"), quantization="fp16")


def _runner(model: LlamaFamilyModel) -> ModelRunner:
    loaded = LoadedModel(
        model=model,
        tokenizer=None,
        path=Path("."),
        name="test",
        vocab_size=VOCAB,
        stop_token_ids=(),
        revision_token_id=None,
        context_length=256,
        device=torch.device("cpu"),
        dtype=torch.float32,
        impl="corral",
    )
    return ModelRunner(loaded, max_batch=4, max_len=128)


class _Pair:
    """The same model decoding in two runners (two KV caches): one with the layer graphs, one without."""

    def __init__(self, model: LlamaFamilyModel) -> None:
        assert isinstance(model.layer_steps, GgmlLayerSteps)
        # Both multiply fp16 weights by fp16-rounded inputs and sum in other orders (measured: up to 9e-4 of
        # the largest logit); ggml's GELU reads a table at the fp16-rounded gate (Gemma: 2.7e-3). A RoPE
        # base 1 % off or a dropped bias moves them by more.
        self.tolerance = 1e-2 if model.shape.activation == "gelu_tanh" else 3e-3
        self.model, self.steps = model, model.layer_steps
        self.graphs, self.torch = _runner(model), _runner(model)
        self.worst = 0.0

    def forward(self, rows: list[ForwardRow], *, readable: bool = True) -> torch.Tensor:
        """readable=False: the graphs' cache hides its layout this step (as one the decoder graph cannot read)."""
        with torch.inference_mode():
            self.model.layer_steps = self.steps
            cache: Any = self.graphs.cache
            if not readable:
                cache.decode_layout = lambda: None
            ours = self.graphs.forward(rows)
            if not readable:
                del cache.decode_layout
            self.model.layer_steps = None
            reference = self.torch.forward(rows)
            self.model.layer_steps = self.steps
        assert torch.isfinite(ours).all()
        scale = float(reference.abs().max())
        diff = float((ours - reference).abs().max())
        self.worst = max(self.worst, diff / scale)
        assert diff <= self.tolerance * scale, f"logits differ by {diff} (logits up to {scale})"
        return reference


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_layer_graphs_give_the_torch_path_logits(name: str, tmp_path: Path) -> None:
    model = _fp16_model(CONFIGS[name](), tmp_path)
    pair = _Pair(model)
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (9, 5, LAYER_MAX_ROWS + 3, 3)]
    # Prefill: a row of more than LAYER_MAX_ROWS tokens takes the torch path in both runners; rows of 9, 5 and 3
    # tokens take the one-graph decoder (causal within the row).
    lengths = [0] * 4
    for slot in range(3):
        pair.forward([ForwardRow(slot=slot, start=0, tokens=prompts[slot])])
        lengths[slot] = len(prompts[slot])
    pair.forward([ForwardRow(slot=3, start=0, tokens=prompts[3])])
    lengths[3] = 3
    picks = torch.randint(0, VOCAB, (96, 10), generator=generator).tolist()
    for step, tokens in enumerate(picks):
        active = [slot for slot in range(4) if slot <= step % 4]  # 1, 2, 3 and 4 rows in turn
        if step in (10, 30):  # one row fed a chunk of 3 tokens (forced tokens), beside another row's single token
            rows = [
                ForwardRow(slot=0, start=lengths[0], tokens=tokens[:3]),
                ForwardRow(slot=1, start=lengths[1], tokens=[tokens[3]]),
            ]
        elif step % 11 == 3:  # every row a different number of tokens: query blocks of 4, padded
            at = [0, 1, 5, 7, 10]
            rows = [ForwardRow(slot=s, start=lengths[s], tokens=tokens[at[s] : at[s + 1]]) for s in range(4)]
        elif step % 11 == 8:  # several tokens a row in slots that do not start at slot 0
            rows = [ForwardRow(slot=2, start=lengths[2], tokens=tokens[:2]), ForwardRow(3, lengths[3], tokens[2:5])]
        elif step % 7 == 5:  # rows in slots that are not consecutive (a free slot between): gathered blocks
            rows = [ForwardRow(slot=slot, start=lengths[slot], tokens=[tokens[slot]]) for slot in (1, 3)]
        elif step % 7 == 6:  # two consecutive slots that do not start at slot 0
            rows = [ForwardRow(slot=slot, start=lengths[slot], tokens=[tokens[slot]]) for slot in (2, 3)]
        elif step % 7 == 4:  # rows out of slot order, one of them fed 2 tokens
            rows = [ForwardRow(slot=3, start=lengths[3], tokens=tokens[:2]), ForwardRow(0, lengths[0], [tokens[2]]),
                    ForwardRow(slot=2, start=lengths[2], tokens=[tokens[3]])]
        else:
            rows = [ForwardRow(slot=slot, start=lengths[slot], tokens=[tokens[slot]]) for slot in active]
        assert sum(len(r.tokens) for r in rows) <= LAYER_MAX_ROWS
        pair.forward(rows, readable=step % 9 != 7)  # the per-layer graphs every ninth step
        for row in rows:
            lengths[row.slot] += len(row.tokens)
    assert max(lengths) > 64  # past the sliding windows (20, 24) and the first key bucket (64)
    steps = pair.steps
    assert steps.decoder_steps > 70 and steps.boundary_steps > 8  # both forms served steps
    assert steps.multi_query_steps >= 25  # 3 prompts, the forced chunks, the uneven rows and those out of order
    assert pair.worst > 0.0  # the graphs did run (ggml's roundings differ from torch's order somewhere)


def test_products_switch_keeps_the_layers_in_torch(tmp_path: Path) -> None:
    use_kernels(KernelOptions(row_kernel="products"))  # tests/conftest.py restores the default after
    model = _fp16_model(qwen3_config(), tmp_path)
    assert model.layer_steps is None
    use_kernels(KernelOptions(row_kernel="torch"))
    assert load_llama_family(tmp_path, model.config, torch.float32, torch.device("cpu"), "fp16").layer_steps is None


def test_graphs_refuse_steps_of_more_tokens_than_they_were_built_for(tmp_path: Path) -> None:
    model = _fp16_model(qwen3_config(), tmp_path)
    steps = model.layer_steps
    assert steps is not None and steps.takes(LAYER_MAX_ROWS) and not steps.takes(LAYER_MAX_ROWS + 1)
    with pytest.raises(ValueError, match=f"1 to {LAYER_MAX_ROWS} tokens"):
        tokens = LAYER_MAX_ROWS + 1
        steps.hidden(torch.zeros(tokens, 64), torch.arange(tokens), torch.arange(tokens), lambda *a: a[1])


def test_unquantized_models_have_no_graphs(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    config = qwen3_config()
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    assert load_llama_family(tmp_path, config, torch.float32, torch.device("cpu")).layer_steps is None
