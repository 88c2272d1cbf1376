"""Prompt blocks kept in host memory after their slot is reused, so a prompt that comes back finds them.

The prefix cache's capacity is otherwise its slots: with more distinct prompts in rotation than slots (16
conversations on 8 slots, a RAG corpus of a few documents), each one evicts another before it returns and
every prompt is computed again. When a slot is reused, the full blocks it is about to forget that no other slot
holds are copied here, keyed by the same chained digest, and so are its last tokens past its last full block;
admitting a prompt continues its match here after the slots' blocks run out, copies the found blocks back into
its slot, then the stored entry after them that begins the most of the prompt's remaining tokens (a short
prompt's whole unique part often lies there). A copy of a block is a few hundred KB of memory traffic, against a
forward over its 16 tokens.

llama.cpp's llama-server keeps prompt states in host memory the same way (`--cache-ram`, 8 GiB by default);
vLLM offloads KV blocks to CPU memory. Bounded by bytes, least recently used first out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# One block's keys and values on the host: every layer's keys, then every layer's values, stacked on the first
# axis (one allocation per block, not one per layer).
BlockKV = torch.Tensor


def block_bytes(block: BlockKV) -> int:
    return block.nbytes


@dataclass(frozen=True)
class _Entry:
    parent: bytes  # the digest of the block before it (b"" for a prompt's first)
    tokens: tuple[int, ...]  # the tokens whose KV it holds: a full block's 16, or a slot's last few
    kv: BlockKV


class HostBlockStore:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"the host block store's capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.bytes = 0
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        # (parent, first token) -> entries after that parent starting with that token: where a prompt's tokens
        # past its last full block are matched, one token at a time, against what is stored.
        self._children: dict[tuple[bytes, int], set[bytes]] = {}
        self.kept_blocks = 0  # entries ever stored
        self.restored_blocks = 0  # entries ever copied back into a slot, whole or in part

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keep(self, digest: bytes, parent: bytes, tokens: Sequence[int], block: BlockKV) -> None:
        """Store the KV of `tokens` (already copied off their slot), following the block `parent`, under
        `digest`; the least recently used entries go to make room."""
        size = block_bytes(block)
        if size > self.capacity_bytes or not tokens:
            return
        self._drop(digest)
        while self._entries and self.bytes + size > self.capacity_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[digest] = _Entry(parent, tuple(tokens), block)
        self._children.setdefault((parent, tokens[0]), set()).add(digest)
        self.bytes += size
        self.kept_blocks += 1

    def take_run(self, digests: Sequence[bytes]) -> list[BlockKV]:
        """The stored blocks of a chain's run, in order. They stay stored, now the most recently used, the
        run's first block last of all: the store evicts the least recently used, and a chain needs its head."""
        blocks = [self._entries[d].kv for d in digests]
        for digest in reversed(digests):
            self._entries.move_to_end(digest)
        self.restored_blocks += len(blocks)
        return blocks

    def run_length(self, digests: Sequence[bytes], start: int) -> int:
        """How many of `digests[start:]`, in order, are stored: a chain stops at its first missing block."""
        end = start
        while end < len(digests) and digests[end] in self._entries:
            end += 1
        return end - start

    def longest_start(self, parent: bytes, wanted: Sequence[int]) -> tuple[int, BlockKV | None]:
        """The stored entry after `parent` whose tokens begin the most of `wanted` (tokens past a prompt's last
        full block): (how many, its KV, whose first that many positions are theirs), or (0, None)."""
        if not wanted:
            return 0, None
        best, chosen = 0, None
        for digest in self._children.get((parent, wanted[0]), ()):
            tokens = self._entries[digest].tokens
            n = 1
            while n < len(tokens) and n < len(wanted) and tokens[n] == wanted[n]:
                n += 1
            if n > best:
                best, chosen = n, digest
        if chosen is None:
            return 0, None
        self._entries.move_to_end(chosen)
        self.restored_blocks += 1
        return best, self._entries[chosen].kv

    def _drop(self, digest: bytes) -> None:
        entry = self._entries.pop(digest, None)
        if entry is None:
            return
        self.bytes -= block_bytes(entry.kv)
        key = (entry.parent, entry.tokens[0])
        siblings = self._children[key]
        siblings.discard(digest)
        if not siblings:
            del self._children[key]
