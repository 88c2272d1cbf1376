"""A GGUF served from its own quantized blocks, every step on ggml, as llama.cpp serves it.

The file is memory-mapped (corral/server/models/gguf_file.py) and its weights go to ggml's quantized products where
they lie: no float copy on disk or in memory, and every step size (a decode token, forced tokens, a prompt
chunk) runs as one graph (corral/kernels/ggml_step_graph.py). The head multiplies the file's output weight (or
the tied embedding) the same way; a grammar-restricted row computes its allowed logits exactly from the
weight's decoded rows, and full rows' best logits are recomputed so (`refine`), so both kinds of row see the
same values where a pick is decided.

The configuration (shape, RoPE tables, windows) is the Hugging Face config that transformers derives from
the file's metadata (corral/server/models/gguf_import.py writes it with the tokenizer, once). The tensors follow
llama.cpp's names and conventions: Gemma's norm gains are stored with their +1 already in, and a `llama`
file's q/k rows are interleaved for RoPE on adjacent pairs, which ggml's normal RoPE mode then applies (the
keys in the cache stay in that order; attention does not depend on it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from corral.kernels.block_screen import ggml_q8_0_blocks
from corral.kernels.ggml_graph_parts import ROPE_NEOX, ROPE_NORMAL, LayerParts, StepShape
from corral.kernels.ggml_step_graph import Embedding, StepGraphs
from corral.kernels.half_sums import attention_sums_in_half
from corral.kernels.logit_refinement import BestAmong, refine_near_top
from corral.kernels.row_kernel import LLAMA_CPP_GGML, RowKernel, ggml_modules, ggml_version, llamafile_built
from corral.kernels.timed_choice import TimedChoice
from corral.server.models.decoded_rows import DecodedRows
from corral.server.models.decoder_config import DecoderShape, decoder_shape, rope_frequencies, unsupported_reason
from corral.server.models.gguf_file import GgufFile, GGUFTensorError, MappedWeight
from corral.server.models.repack_check import repacked_agree
from corral.server.models.repack_verdicts import read_verdict, write_verdict
from corral.server.models.wide_rows import settle_wide_rows

log = logging.getLogger(__name__)

# llama.cpp's RoPE layout per architecture: `llama` files hold q/k rows interleaved for adjacent pairs.
ROPE_MODES = {"llama": ROPE_NORMAL, "mistral": ROPE_NORMAL, "qwen2": ROPE_NEOX, "qwen3": ROPE_NEOX,
              "gemma3": ROPE_NEOX}
KV_DTYPE = torch.float16  # llama.cpp's default cache type: half the memory of float32
HEAD_MAX_ROWS = 1 << 16
DOT_ROWS_MAX = 16  # past it llamafile's tiles win (Gemma 3's head, 16 rows: 24.5 against 36.8 ms on an AMD EPYC)
LAYER_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# Where repacking every layer weight fails the probe (repack_check.py), the MLP's alone are tried: on the CPU
# where it failed they were right and carry most of the gain (Qwen2.5 1.5B's 128-token prompt: 59-63 tok/s with
# them repacked against 32.5-33 with none; docs/models.md).
REPACK_STAGES = (LAYER_PARTS, ("ffn_gate", "ffn_up", "ffn_down"))


class GgufHead:
    """The vocabulary projection over the file's blocks: ggml's quantized product for whole rows (its input
    rounded to 8 bits, as llama.cpp computes it), exact float32 dot products of decoded rows for `select`."""

    rounds_outputs = True

    def __init__(self, file: GgufFile, weight: MappedWeight) -> None:
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self.nbytes = weight.nbytes
        self.ggml_weight = weight.ggml_weight  # for step graphs that end in the head (StepGraphs.hidden_and_logits)
        self._kernel = RowKernel(weight, max_rows=HEAD_MAX_ROWS)
        # A Q8_0 head's products of a few rows: llamafile's tiles or ggml's own dot products, whichever the first
        # calls of each row count time faster (timed_choice.py).
        self._dots = None
        if weight.ggml_type == ggml_modules()[0].GGML_TYPE_Q8_0 and llamafile_built():
            self._dots = RowKernel(weight, max_rows=DOT_ROWS_MAX, input_blocks=True, dot_products=True)
        self.choice = TimedChoice()
        self._rows = DecodedRows(lambda ids: file.dequantized_rows(weight.name, ids), self.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows, dots = int(x.shape[0]), self._dots
        if dots is None or not 2 <= rows <= DOT_ROWS_MAX:
            return self._kernel(x.float())
        return self.choice.run(rows, lambda: self._kernel(x.float()), lambda: dots(ggml_q8_0_blocks(x)))

    def in_graph(self, rows: int) -> bool:
        """Whether a step's head of `rows` full rows may end the decoder's graph, whose product takes llamafile's
        tiles: not while this head's own calls of that many rows try both routes, nor where the dot products
        won them."""
        return self._dots is None or not 2 <= rows <= DOT_ROWS_MAX or self.choice.chosen(rows) == 0

    def select(self, x: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """Logits of (row, column) pairs, each a float32 dot product with the column's decoded weight row."""
        if len(rows) and bool((rows == rows[0]).all()):  # one row's (a stream's refinement): no gather, same sums
            return (torch.from_numpy(self._rows(columns.numpy())) * x[int(rows[0])].float()).sum(-1)
        unique, inverse = torch.unique(columns, return_inverse=True)
        decoded = torch.from_numpy(self._rows(unique.numpy()))
        return (decoded.index_select(0, inverse) * x.index_select(0, rows).float()).sum(-1)


class GgufDecoder(torch.nn.Module):
    """The decoder and head of a GGUF; the interface corral's packed forward drives (model_runner.py)."""

    quantization = "gguf"

    def __init__(
        self, file: GgufFile, config: Any, arch: str, repack: tuple[str, ...] = LAYER_PARTS
    ) -> None:
        """repack: the layer parts (LAYER_PARTS' names) whose weights ggml may repack for its kernels."""
        super().__init__()
        reason = unsupported_reason(config)
        if reason is not None:
            raise ValueError(f"corral's decoder cannot run this model: {reason}")
        self.file, self.config, self.arch = file, config, arch
        self.shape: DecoderShape = decoder_shape(config)
        # A ggml build that sums float16 products in float16 overflows in attention over float16 keys.
        self.kv_dtype = torch.float32 if attention_sums_in_half() else KV_DTYPE
        if repack:  # before the graphs take the weights
            file.repack(name for name in self._layer_weight_names() if name.split(".")[2] in repack)
        s = self.shape
        self.rope_types = tuple(dict.fromkeys(s.layer_types))
        ropes = [self._rope(config, t) for t in self.rope_types]
        scale = s.attn_scale if s.attn_scale is not None else s.head_dim**-0.5
        step_shape = StepShape(s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, s.rms_eps, s.activation, scale,
                               ROPE_MODES.get(arch, ROPE_NEOX))
        layers = [self._layer(i) for i in range(s.num_layers)]
        embed = self._weight("token_embd.weight", s.hidden_size, s.vocab_size)
        head_name = "output.weight" if "output.weight" in file else "token_embd.weight"
        self.head = GgufHead(file, self._weight(head_name, s.hidden_size, s.vocab_size))
        self._layer_bytes = sum(file.nbytes(name) for name in self._layer_weight_names())
        final_norm = file.floats("output_norm.weight")
        self.graphs = StepGraphs(step_shape, layers, ropes, final_norm, Embedding(embed.ggml_weight, s.embed_scale),
                                 self.head.ggml_weight)
        self.screens = None

    def _rope(self, config: Any, layer_type: str) -> tuple[torch.Tensor, float]:
        inv_freq, scale = rope_frequencies(config, self.shape.head_dim, layer_type)
        if "rope_freqs.weight" in self.file:  # llama.cpp's per-pair factors (Llama 3.1's scaling) win
            exponents = torch.arange(0, self.shape.head_dim, 2, dtype=torch.float64) / self.shape.head_dim
            base = float(getattr(config, "rope_theta", None) or 10000.0)
            inv_freq = (1.0 / (base**exponents) / self.file.floats("rope_freqs.weight").double()).float()
        return inv_freq, scale

    def _weight(self, name: str, in_features: int, out_features: int) -> MappedWeight:
        weight = self.file.weight(name)
        if (weight.in_features, weight.out_features) != (in_features, out_features):
            raise GGUFTensorError(
                f"{name} in {self.file.path.name} is {weight.out_features} x {weight.in_features}, the config says "
                f"{out_features} x {in_features}"
            )
        return weight

    def _optional(self, name: str) -> torch.Tensor | None:
        return self.file.floats(name) if name in self.file else None

    def _layer_weight_names(self) -> Iterable[str]:
        for i in range(self.shape.num_layers):
            for part in LAYER_PARTS:
                yield f"blk.{i}.{part}.weight"

    def _layer(self, i: int) -> LayerParts:
        s, f, p = self.shape, self.file, f"blk.{i}."
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        q = self._weight(p + "attn_q.weight", s.hidden_size, q_size)
        k = self._weight(p + "attn_k.weight", s.hidden_size, kv_size)
        v = self._weight(p + "attn_v.weight", s.hidden_size, kv_size)
        biases = [self._optional(p + f"attn_{x}.bias") for x in "qkv"]
        if any(b is not None for b in biases) and not all(b is not None for b in biases):
            raise GGUFTensorError(f"{f.path.name} has biases on some but not all of layer {i}'s q/k/v")
        qkv_bias = torch.cat([b for b in biases if b is not None]) if biases[0] is not None else None
        qk_norm_gain = None
        if s.qk_norm:
            q_norm, k_norm = f.floats(p + "attn_q_norm.weight"), f.floats(p + "attn_k_norm.weight")
            qk_norm_gain = torch.cat([q_norm.expand(s.num_heads, -1), k_norm.expand(s.num_kv_heads, -1)])
        ffn = self.file.weight(p + "ffn_gate.weight").out_features
        return LayerParts(
            input_norm=f.floats(p + "attn_norm.weight"),
            qkv=(q, k, v),
            qkv_bias=qkv_bias,
            qk_norm_gain=qk_norm_gain,
            o=self._weight(p + "attn_output.weight", q_size, s.hidden_size),
            o_bias=self._optional(p + "attn_output.bias"),
            attn_out_norm=f.floats(p + "post_attention_norm.weight") if s.sandwich_norms else None,
            mlp_norm=f.floats(p + "ffn_norm.weight"),
            gate_up=(self._weight(p + "ffn_gate.weight", s.hidden_size, ffn),
                     self._weight(p + "ffn_up.weight", s.hidden_size, ffn)),
            gate_up_bias=None,
            down=self._weight(p + "ffn_down.weight", ffn, s.hidden_size),
            down_bias=None,
            mlp_out_norm=f.floats(p + "post_ffw_norm.weight") if s.sandwich_norms else None,
            rope_table=self.rope_types.index(s.layer_types[i]),
            window=s.layer_windows[i],
        )

    def step_read_bytes(self) -> int:
        """Bytes of weights a decode step of one row reads: the layers' blocks and the head's."""
        return self._layer_bytes + self.head.nbytes

    def weight_memory_bytes(self) -> int:
        """Bytes the weights hold in memory once served: what a step reads, and the repacked copies' file blocks
        where wide products read those too (wide_rows.py)."""
        wide = self.file.wide_rows.start is not None
        return self.step_read_bytes() + (self.file.repacked_bytes if wide else 0)

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, last: torch.Tensor, attend: Any) -> torch.Tensor:
        """Each row's last token's final-normed hidden state [B, hidden]; `attend` is the KV cache, whose layout
        the graphs read and write in place (corral/kernels/decode_layout.py)."""
        return self.graphs.hidden(input_ids, positions, last, attend)

    def head_in_graph(self, rows: int) -> bool:
        """Whether a step wanting every logit of `rows` rows runs its head in the decoder's graph
        (`hidden_and_logits`) rather than through `head` (GgufHead.in_graph)."""
        return self.head.in_graph(rows)

    def hidden_and_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, last: torch.Tensor, attend: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden`, and the rows' logits over the whole vocabulary from the same graph (what `head` would give
        them): a step whose rows all want every logit runs one graph, not two."""
        return self.graphs.hidden_and_logits(input_ids, positions, last, attend)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, last: torch.Tensor, attend: Any
    ) -> torch.Tensor:
        return self.head(self.hidden(input_ids, positions, last, attend))

    def restricted_logits(
        self, hidden: torch.Tensor, allowed: Mapping[int, torch.Tensor], best_only: Iterable[int] = ()
    ) -> tuple[torch.Tensor, None]:
        """Float32 logits [B, vocab]; a row in `allowed` gets only those ids' logits (exact), the rest -inf. No row
        is screened (the second value, as `LlamaFamilyModel.restricted_logits` gives it)."""
        if not allowed:
            return self.head(hidden), None
        batch = hidden.shape[0]
        logits = torch.full((batch, self.head.out_features), float("-inf"))
        full = [row for row in range(batch) if row not in allowed]
        if full:
            index = torch.tensor(full)
            logits.index_copy_(0, index, self.head(hidden.index_select(0, index)))
        keys = sorted(allowed)
        columns = torch.cat([allowed[row] for row in keys])
        counts = torch.tensor([len(allowed[row]) for row in keys], dtype=torch.long)
        rows = torch.repeat_interleave(torch.tensor(keys, dtype=torch.long), counts)
        if len(columns):
            logits[rows, columns] = self.head.select(hidden, rows, columns)
        return logits, None

    def refine(
        self, logits: torch.Tensor, hidden: torch.Tensor, rows: list[int], depths: list[int], screened: None = None
    ) -> BestAmong:
        """Each given row's logits near its best recomputed exactly (the product rounds its input to 8 bits)."""
        return refine_near_top(self.head, logits, hidden, rows, depths)


def load_gguf_decoder(path: Path, config: Any, arch: str) -> GgufDecoder:
    """The decoder over `path`'s blocks; ValueError (GGUFTensorError) where the file does not fit the config.
    Weights ggml repacks are kept so only where a probe prompt shows them right on this CPU (repack_check.py):
    every layer weight, else the MLP's alone, else none. A verdict is probed once per file, CPU and ggml build
    (repack_verdicts.py). Products of many rows may take the file's own blocks instead (wide_rows.py)."""
    version = ggml_version()
    if version and version[:2] < LLAMA_CPP_GGML:
        log.warning("ggml %s is older than llama.cpp's (%s): prompts through K-quant weights run slower; build it as "
                    "`make install` does (deploy/ggml/build-ggml.sh)", ".".join(map(str, version)),
                    ".".join(map(str, LLAMA_CPP_GGML)))
    plain: GgufDecoder | None = None
    for stage, parts in enumerate(REPACK_STAGES):
        verdict = read_verdict(path, parts)  # probed at an earlier load on this CPU and ggml build
        if verdict is not None and not verdict[0]:
            _warn_wrong(parts, path, verdict[1])  # known wrong: not repacked again only to be dropped
            continue
        decoder = GgufDecoder(GgufFile(path), config, arch, repack=parts).eval()
        if not decoder.file.repacked_bytes:
            if stage == 0:
                return decoder  # nothing on this CPU to repack
            decoder.file.close()
            continue
        if verdict is None:
            plain = plain or GgufDecoder(GgufFile(path), config, arch, repack=()).eval()
            verdict = repacked_agree(decoder, plain, decoder.head.out_features)
            for probed in (decoder, plain):  # the probe's steps are not the server's
                probed.graphs.decode_steps = probed.graphs.prompt_steps = 0
            write_verdict(path, parts, *verdict)
        agree, gap = verdict
        if agree:
            log.log(logging.WARNING if stage else logging.DEBUG,  # a later stage: say what is served
                    "repacked weights (%s) of %s agree with its blocks (gap %.2g of the logits' scale): served so",
                    ", ".join(parts), path.name, gap)
            if plain is not None:
                plain.file.close()
            settle_wide_rows(decoder.file)  # after the probe, which must see the repacked weights
            decoder.graphs.drop_kept()
            return decoder
        _warn_wrong(parts, path, gap)
        decoder.file.close()
    log.warning("serving %s's blocks where they lie, none repacked (slower prompts)", path.name)
    return plain or GgufDecoder(GgufFile(path), config, arch, repack=()).eval()


def _warn_wrong(parts: tuple[str, ...], path: Path, gap: float) -> None:
    log.warning("ggml's repacked weights (%s) give %s wrong logits on this CPU (off by %.0f %% of their scale on "
                "a probe prompt): not used", ", ".join(parts), path.name, 100 * gap)
