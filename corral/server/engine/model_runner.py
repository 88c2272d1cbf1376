"""Owns the model and its KV cache; turns a batch of rows into next-token logits.

A step is two calls that hand values on: `decode(rows)` runs the decoder (`DecodedStep`), and `head(step,
allowed)` gives the logits (`StepLogits`), the rows the grammar narrowed to their allowed ids computing only
those; the logits carry what refining them needs (`StepLogits.refine`). The engine settles its grammar masks
between the two. Two decoders sit behind them: corral's own decoder for the Llama family
(corral/server/models/llama_family.py, every row's tokens packed into one batch, KV attended in place) and
transformers' model for every other architecture (rows padded into a shared forward over a slot cache).
Both keep one KV region per slot, so the prefix cache (corral/server/engine/prefix_cache.py) serves both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain
from typing import Any, Protocol

import torch

from corral.kernels.logit_refinement import BestAmong
from corral.server.engine.host_block_store import HostBlockStore
from corral.server.engine.kv_cache import SlotKVCache
from corral.server.engine.prefix_cache import KVCopier, PrefixCache
from corral.server.engine.slot_attention import InPlaceKVCache
from corral.server.models import LoadedModel
from corral.server.models.gguf_decoder import GgufDecoder
from corral.server.models.llama_family import LlamaFamilyModel

SHARED_FORWARD_MAX = 32  # transformers path: rows feeding up to this many tokens join the shared (padded) forward


@dataclass(frozen=True)
class ForwardRow:
    """Feed `tokens` to the sequence in `slot`, whose cache already holds `start` tokens. `best_only`: the row
    needs only its best token's id (greedy, nothing reported), which the head may prove without every logit."""

    slot: int
    start: int
    tokens: Sequence[int]
    best_only: bool = False
    drafted: int = 0  # the last `drafted` tokens are a draft (corral/server/engine/speculation.py)
    draft_outputs: Sequence[int] = ()  # the draft places (0 = its first token) whose logits are wanted
    draft_allowed: Mapping[int, torch.Tensor] = field(default_factory=dict)  # {output: allowed ids} where few


class _Decoder(Protocol):
    """What refining a packed step's logits needs of corral's decoders."""

    def refine(
        self, logits: torch.Tensor, hidden: torch.Tensor, rows: list[int], depths: list[int], screened: Any = None
    ) -> BestAmong: ...


@dataclass(frozen=True)
class Refiner:
    """What makes a step's rounded logits exact near each row's best: the decoder's head, the step's hidden
    states and the rows its head screened."""

    model: _Decoder
    hidden: torch.Tensor
    screened: Any = None

    def refine(self, logits: torch.Tensor, rows: list[int], depths: list[int]) -> BestAmong:
        return self.model.refine(logits, self.hidden, rows, depths, self.screened)


@dataclass(frozen=True)
class StepLogits:
    """A step's float32 logits: `rows` [len(rows), V] after each row's last real token (rows with allowed ids
    computed only there), `drafts` [sum of draft outputs, V] after each wanted draft place, in row order, exact
    near their best."""

    rows: torch.Tensor
    drafts: torch.Tensor
    dense_rows: int = 0  # logit rows the head computed over the whole vocabulary (the step's costly part)
    refiner: Refiner | None = None  # None: the logits are exact already (transformers' heads)

    def refine(self, logits: torch.Tensor, rows: list[int], depths: list[int]) -> BestAmong:
        """After masking `logits` (these `rows`, or the engine's view of them): recompute exactly, in place, the
        given rows' logits near their best (down to the depths[i]-th) where the head rounds them
        (corral/kernels/logit_refinement.py). Returns the rows whose best lies among the columns given."""
        return self.refiner.refine(logits, rows, depths) if self.refiner is not None else {}


@dataclass(frozen=True)
class DecodedStep:
    """A step's decoder output: the rows' and wanted draft places' hidden states (corral's decoder), and/or the
    finished logits (transformers', whose head runs with its decoder; a GGUF's dense step, whose graph ends in
    the head)."""

    rows: Sequence[ForwardRow]
    hidden: torch.Tensor | None = None
    logits: torch.Tensor | None = None


# The step's grammar masks settled, for the head: {row: allowed token ids} for rows whose head may compute
# only those ids (every other id of such a row is forbidden).
Allowed = Mapping[int, torch.Tensor]


class _Forward(Protocol):
    @property
    def cache(self) -> KVCopier: ...

    @property
    def restricts_head(self) -> bool: ...

    def decode(self, rows: Sequence[ForwardRow], dense: bool = False) -> DecodedStep: ...

    def head(self, step: DecodedStep, allowed: Allowed) -> StepLogits: ...


class ModelRunner:
    def __init__(
        self, loaded: LoadedModel, *, max_batch: int, max_len: int, prefix_cache: bool = True,
        prefix_cache_ram_bytes: int = 0,
    ) -> None:
        """prefix_cache_ram_bytes: host memory for prompt blocks kept after their slot is reused (0: none)."""
        self.loaded = loaded
        self.device = loaded.device
        self.max_len = max_len
        impl: _Forward
        if isinstance(loaded.model, LlamaFamilyModel | GgufDecoder):
            impl = PackedForward(loaded.model, max_batch=max_batch, max_len=max_len, device=loaded.device)
        else:
            impl = TransformersForward(loaded, max_batch=max_batch, max_len=max_len)
        self._impl = impl
        self.cache = impl.cache
        store = HostBlockStore(prefix_cache_ram_bytes) if prefix_cache_ram_bytes > 0 else None
        self.prefix = PrefixCache(max_batch, impl.cache, enabled=prefix_cache, store=store)
        # Rows may feed drafts on corral's decoder (transformers' path pads rows: drafts would cost every row).
        self.drafts = isinstance(impl, PackedForward)

    @property
    def restricts_head(self) -> bool:
        """Whether `head` computes only the allowed ids of the rows it is given them for (else every row gets
        full logits, to be masked after)."""
        return self._impl.restricts_head

    @torch.inference_mode()
    def decode(self, rows: Sequence[ForwardRow], dense: bool = False) -> DecodedStep:
        """Feed each row's tokens (writing their KV); the step's hidden states, ready for `head`. `dense`: no row
        feeds a draft and `head` will be given no allowed ids (every row wants every logit, as free text does):
        the decoder may compute the logits with the step, which `head` then hands on."""
        try:
            step = self._impl.decode(rows, dense)
        except BaseException:
            for row in rows:
                self.prefix.discard(row.slot, row.start)
            raise
        for row in rows:
            self.prefix.written(row.slot, row.start, row.tokens)
        return step

    @torch.inference_mode()
    def head(self, step: DecodedStep, allowed: Allowed | None = None) -> StepLogits:
        """The decoded step's logits, with those after every draft token of the rows that feed one (`drafts`).
        Where `restricts_head`, the rows in `allowed` get only their allowed logits (the rest -inf)."""
        return self._impl.head(step, allowed if allowed is not None and self.restricts_head else {})

    def forward(self, rows: Sequence[ForwardRow], restrict: Callable[[], Allowed] | None = None) -> torch.Tensor:
        """`decode` then `head`: float32 logits [len(rows), V] for the last fed token of each row. `restrict`,
        if given, is asked once between the two for the rows to restrict (the engine's masks, in tests)."""
        step = self.decode(rows)
        return self.head(step, restrict() if restrict is not None and self.restricts_head else None).rows


class PackedForward:
    """corral's decoder: all rows' new tokens in one [T, hidden] pack; attention per slot, in place."""

    def __init__(
        self, model: LlamaFamilyModel | GgufDecoder, *, max_batch: int, max_len: int, device: torch.device
    ) -> None:
        self.model = model
        shape = model.shape
        self.cache = InPlaceKVCache(
            num_layers=shape.num_layers,
            num_slots=max_batch,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            max_len=max_len,
            dtype=model.kv_dtype,
            device=device,
            layer_windows=shape.layer_windows,
            scale=shape.attn_scale,
        )
        self.device = device
        # On CPU the vocabulary projection is most of a step, and a grammar often allows a few hundred of
        # its rows. On CUDA the whole projection is one cheap kernel; gathers per row would cost more.
        self.restricts_head = device.type == "cpu"

    def decode(self, rows: Sequence[ForwardRow], dense: bool = False) -> DecodedStep:
        counts = [len(r.tokens) for r in rows]
        starts = [r.start for r in rows]
        plan = self.cache.plan([r.slot for r in rows], starts, counts)
        input_ids = torch.tensor(list(chain.from_iterable(r.tokens for r in rows)), device=self.device)
        positions = plan.positions if plan.positions is not None else plan.write_index % self.cache.max_len
        ends = list(accumulate(counts))
        mains = [end - 1 - r.drafted for end, r in zip(ends, rows, strict=True)]
        drafted = [end - r.drafted + j for end, r in zip(ends, rows, strict=True) for j in r.draft_outputs]
        # The decoder gives the wanted positions' states in pack order; the rows' come first in the logits.
        wanted = sorted(mains + drafted)
        last = torch.tensor(wanted, device=self.device)
        if dense and not drafted and isinstance(self.model, GgufDecoder) and self.model.head_in_graph(len(wanted)):
            states, logits = self.model.hidden_and_logits(input_ids, positions, last, self.cache)
            return DecodedStep(rows, hidden=states, logits=logits)
        states = self.model.hidden(input_ids, positions, last, self.cache)
        if drafted:
            place = {position: i for i, position in enumerate(wanted)}
            states = states[torch.tensor([place[p] for p in mains + drafted], device=self.device)]
        return DecodedStep(rows, hidden=states)

    def head(self, step: DecodedStep, allowed: Allowed) -> StepLogits:
        rows, states = step.rows, step.hidden
        assert states is not None
        if step.logits is not None and not allowed:  # computed with the decoder (`decode(dense=True)`)
            return StepLogits(step.logits, step.logits[len(rows) :], len(rows), Refiner(self.model, states))
        allowed = dict(allowed)
        best_only = [i for i, r in enumerate(rows) if r.best_only]
        # One head for the rows and the draft places (a head's cost grows slower than its rows); the draft
        # places are settled at once: each is a greedy pick, needing its best logit exact.
        dense: list[int] = []
        offset = len(rows)
        for row in rows:
            allowed.update({offset + i: ids for i, ids in row.draft_allowed.items()})
            dense += [offset + i for i in range(len(row.draft_outputs)) if i not in row.draft_allowed]
            offset += len(row.draft_outputs)
        logits, screened = self.model.restricted_logits(states, allowed, best_only + dense)
        refiner = Refiner(self.model, states, screened)
        if dense:
            refiner.refine(logits, dense, [1] * len(dense))
        return StepLogits(logits[: len(rows)], logits[len(rows) :], len(states) - len(allowed), refiner)


class TransformersForward:
    """Any transformers causal LM: decode rows share one forward padded to the longest; long prompts run alone."""

    def __init__(self, loaded: LoadedModel, *, max_batch: int, max_len: int) -> None:
        self.model = loaded.model
        self.device = loaded.device
        config: Any = loaded.model.config
        text_config: Any = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = int(text_config.num_attention_heads)
        head_dim = int(getattr(text_config, "head_dim", None) or text_config.hidden_size // heads)
        self.max_len = max_len
        # Decoder + output projection, when the architecture exposes them plainly (Llama, Qwen, Mistral...).
        # Models that post-process logits (e.g. soft-capping) fall back to the full forward.
        has_plain_head = getattr(text_config, "final_logit_softcapping", None) is None
        model: Any = loaded.model
        self._decoder: Any = model.get_decoder() if has_plain_head and hasattr(model, "get_decoder") else None
        self._head: Any = model.get_output_embeddings() if self._decoder is not None else None
        self.restricts_head = False
        # Models whose layers alternate sliding-window and full attention (Gemma 3) take one mask per kind:
        # a single 4-D mask would be used as given by every layer, letting sliding layers see past the window.
        window = getattr(text_config, "sliding_window", None)
        layer_types = getattr(text_config, "layer_types", None) or []
        self._window: int | None = window if isinstance(window, int) and "sliding_attention" in layer_types else None
        self.cache = SlotKVCache(
            num_layers=int(text_config.num_hidden_layers),
            num_slots=max_batch,
            num_kv_heads=int(getattr(text_config, "num_key_value_heads", None) or heads),
            head_dim=head_dim,
            max_len=max_len,
            dtype=loaded.dtype,
            device=self.device,
        )

    def decode(self, rows: Sequence[ForwardRow], dense: bool = False) -> DecodedStep:
        if any(r.drafted for r in rows):
            raise ValueError("transformers' forward takes no drafts (ModelRunner.drafts is False)")
        out: list[torch.Tensor | None] = [None] * len(rows)
        shared = [
            i
            for i, r in enumerate(rows)
            if len(r.tokens) <= SHARED_FORWARD_MAX and r.start + SHARED_FORWARD_MAX <= self.max_len
        ]
        if shared:
            logits = self._run([rows[i] for i in shared])
            for j, i in enumerate(shared):
                out[i] = logits[j]
        for i, row in enumerate(rows):
            if out[i] is None:
                out[i] = self._run([row])[0]
        return DecodedStep(rows, logits=torch.stack([t for t in out if t is not None]))

    def head(self, step: DecodedStep, allowed: Allowed) -> StepLogits:
        """transformers' heads ran with the decoder and return their logits unrounded: nothing to refine."""
        assert step.logits is not None
        return StepLogits(step.logits, torch.zeros((0, 0)), len(step.rows))

    def _run(self, rows: Sequence[ForwardRow]) -> torch.Tensor:
        lengths = [len(r.tokens) for r in rows]
        q_len = max(lengths)
        span = self.cache.bind([r.slot for r in rows], [r.start for r in rows], q_len, self.device)
        # Shorter rows are right-padded; their padding writes KV past the row's real end, where it is
        # masked from every real query and overwritten by the row's next tokens.
        padded = [list(r.tokens) + [0] * (q_len - len(r.tokens)) for r in rows]
        input_ids = torch.tensor(padded, device=self.device)
        starts = torch.tensor([r.start for r in rows], device=self.device)
        positions = starts[:, None] + torch.arange(q_len, device=self.device)[None, :]
        key_index = torch.arange(span, device=self.device)
        # Row b's query i (at absolute position starts[b] + i) sees keys at positions <= its own.
        mask = key_index[None, None, :] <= positions[:, :, None]
        attention_mask: torch.Tensor | dict[str, torch.Tensor] = mask[:, None, :, :]
        if self._window is not None:
            in_window = mask & (key_index[None, None, :] > positions[:, :, None] - self._window)
            attention_mask = {"full_attention": mask[:, None, :, :], "sliding_attention": in_window[:, None, :, :]}
        inputs = {
            "input_ids": input_ids,
            "position_ids": positions,
            "attention_mask": attention_mask,
            "past_key_values": self.cache,
            "use_cache": True,
        }
        last = torch.tensor(lengths, device=self.device) - 1
        if self._decoder is not None and self._head is not None:
            # Project only each row's last real position: the vocabulary projection is the big matmul.
            hidden = self._decoder(**inputs).last_hidden_state
            picked = hidden[torch.arange(len(rows), device=self.device), last]
            logits: torch.Tensor = self._head(picked).float()
            return logits
        full = self.model(**inputs, logits_to_keep=0).logits
        gathered: torch.Tensor = full[torch.arange(len(rows), device=self.device), last].float()
        return gathered
