"""Prompt blocks kept in host memory after their slot is reused, so a prompt that comes back finds them.

The prefix cache's capacity is otherwise its slots: with more distinct prompts in rotation than slots (16
conversations on 8 slots, a RAG corpus of a few documents), each one evicts another before it returns and
every prompt is computed again. When a slot is reused, the full blocks it is about to forget that no other slot
holds are copied here, keyed by the same chained digest; admitting a prompt continues its match here after the
slots' blocks run out and copies the found blocks back into its slot. A copy of a block is a few hundred KB of
memory traffic, against a forward over its 16 tokens.

llama.cpp's llama-server keeps prompt states in host memory the same way (`--cache-ram`, 8 GiB by default);
vLLM offloads KV blocks to CPU memory. Bounded by bytes, least recently used first out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

# One block's keys and values on the host: every layer's keys, then every layer's values, stacked on the first
# axis (one allocation per block, not one per layer).
BlockKV = torch.Tensor


def block_bytes(block: BlockKV) -> int:
    return block.nbytes


class HostBlockStore:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"the host block store's capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.bytes = 0
        self._blocks: OrderedDict[bytes, BlockKV] = OrderedDict()
        self.kept_blocks = 0  # blocks ever stored
        self.restored_blocks = 0  # blocks ever copied back into a slot

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def keep(self, digest: bytes, block: BlockKV) -> None:
        """Store one block (already copied off its slot), evicting the least recently used ones to fit."""
        size = block_bytes(block)
        if size > self.capacity_bytes:
            return
        old = self._blocks.pop(digest, None)
        if old is not None:
            self.bytes -= block_bytes(old)
        while self._blocks and self.bytes + size > self.capacity_bytes:
            _, evicted = self._blocks.popitem(last=False)
            self.bytes -= block_bytes(evicted)
        self._blocks[digest] = block
        self.bytes += size
        self.kept_blocks += 1

    def take_run(self, digests: Sequence[bytes]) -> list[BlockKV]:
        """The stored blocks of a chain's run, in order. They stay stored, now the most recently used, the
        run's first block last of all: the store evicts the least recently used, and a chain needs its head."""
        blocks = [self._blocks[d] for d in digests]
        for digest in reversed(digests):
            self._blocks.move_to_end(digest)
        self.restored_blocks += len(blocks)
        return blocks

    def run_length(self, digests: Sequence[bytes], start: int) -> int:
        """How many of `digests[start:]`, in order, are stored: a chain stops at its first missing block."""
        end = start
        while end < len(digests) and digests[end] in self._blocks:
            end += 1
        return end - start
