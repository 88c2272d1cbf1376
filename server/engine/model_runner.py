"""Owns the model and its KV cache; turns a batch of rows into next-token logits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from server.engine.kv_cache import SlotKVCache
from server.models import LoadedModel


@dataclass(frozen=True)
class ForwardRow:
    """Feed `tokens` to the sequence in `slot`, whose cache already holds `start` tokens."""

    slot: int
    start: int
    tokens: Sequence[int]


class ModelRunner:
    def __init__(self, loaded: LoadedModel, *, max_batch: int, max_len: int) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        config: Any = loaded.model.config
        text_config: Any = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = int(text_config.num_attention_heads)
        head_dim = int(getattr(text_config, "head_dim", None) or text_config.hidden_size // heads)
        self.max_len = max_len
        self.cache = SlotKVCache(
            num_layers=int(text_config.num_hidden_layers),
            num_slots=max_batch,
            num_kv_heads=int(getattr(text_config, "num_key_value_heads", None) or heads),
            head_dim=head_dim,
            max_len=max_len,
            dtype=loaded.dtype,
            device=self.device,
        )

    @torch.inference_mode()
    def forward(self, rows: Sequence[ForwardRow]) -> torch.Tensor:
        """Float32 logits [len(rows), V] for the last fed token of each row.

        Rows that feed one token each run as one batch; a row feeding several (a prompt, or a token
        plus its forced continuation) runs on its own, so no row is ever padded."""
        singles = [i for i, r in enumerate(rows) if len(r.tokens) == 1]
        out: list[torch.Tensor | None] = [None] * len(rows)
        if singles:
            logits = self._run([rows[i] for i in singles])
            for j, i in enumerate(singles):
                out[i] = logits[j]
        for i, row in enumerate(rows):
            if len(row.tokens) != 1:
                out[i] = self._run([row])[0]
        return torch.stack([t for t in out if t is not None])

    def _run(self, rows: Sequence[ForwardRow]) -> torch.Tensor:
        q_len = len(rows[0].tokens)
        span = self.cache.bind([r.slot for r in rows], [r.start for r in rows], q_len, self.device)
        input_ids = torch.tensor([list(r.tokens) for r in rows], device=self.device)
        starts = torch.tensor([r.start for r in rows], device=self.device)
        positions = starts[:, None] + torch.arange(q_len, device=self.device)[None, :]
        key_index = torch.arange(span, device=self.device)
        # Row b's query i (at absolute position starts[b] + i) sees keys at positions <= its own.
        mask = key_index[None, None, :] <= positions[:, :, None]
        output = self.model(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=mask[:, None, :, :],
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits: torch.Tensor = output.logits[:, -1, :].float()
        return logits

    def move_slot(self, src: int, dst: int, length: int) -> None:
        self.cache.move(src, dst, length)
