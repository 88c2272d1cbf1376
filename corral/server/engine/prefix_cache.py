"""Prefix caching over slot regions: a request whose prompt starts like KV already held in some slot reuses it.

Every full block (BLOCK_SIZE tokens) of KV written to a slot is indexed by a chained digest of all tokens up
to its end, so equal digests mean equal KV. Admitting a sequence then:

1. picks, among the free slots, the one that loses the fewest tokens it holds: an empty one, or one holding
   only a prefix of the prompt (the previous turn, reused where it lies); among equals, the one holding the
   most of the prompt, then the least recently released one (so recent prefixes live longest);
2. copies the further matching blocks from whichever slot holds them (a running sibling sharing a system
   prompt, one of `n` samples, the previous turn of a conversation): one copy per hit, never per step;
3. past the last full block, reuses token by token what a slot holding those blocks also holds (the same
   prompt again, whose length is rarely a multiple of the block): the index finds blocks, the slots' own
   token lists finish the match;
4. starts the sequence at the hit length, so only the uncached suffix is computed. At least the prompt's
   last token is always fed, because its logits are needed.

Whatever a forward writes (including a re-fed token after a revision, which lowers the length first)
invalidates the blocks from the write on and indexes the blocks it completes. Capacity is the slots
themselves: a finished sequence's KV stays findable until its slot is reused.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from corral.server.engine.host_block_store import BlockKV, HostBlockStore

BLOCK_SIZE = 16


class KVCopier(Protocol):
    def copy_positions(self, src: int, dst: int, start: int, end: int) -> None: ...

    def read_positions(self, slot: int, start: int, end: int) -> BlockKV: ...

    def write_positions(self, slot: int, start: int, block: BlockKV, count: int | None = None) -> None: ...


def chained_digest(previous: bytes, tokens: Sequence[int], suffix: bytes = b"") -> bytes:
    """The digest of `tokens` following the block whose digest is `previous` (b"" at the start)."""
    return hashlib.blake2b(previous + array("q", tokens).tobytes() + suffix, digest_size=16).digest()


def block_digests(tokens: Sequence[int], count: int) -> list[bytes]:
    """Chained digests of the first `count` full blocks of `tokens`: digest i covers tokens[: (i+1)*BLOCK]."""
    digests: list[bytes] = []
    previous = b""
    for i in range(count):
        previous = chained_digest(previous, tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
        digests.append(previous)
    return digests


class PrefixCache:
    def __init__(
        self, num_slots: int, kv: KVCopier, *, enabled: bool = True, store: HostBlockStore | None = None
    ) -> None:
        """store: where blocks a reused slot forgets are kept for prompts that come back (None: nowhere)."""
        self.kv = kv
        self.enabled = enabled
        self.store = store if enabled else None
        self._tokens: list[list[int]] = [[] for _ in range(num_slots)]  # tokens whose KV the slot holds
        self._digests: list[list[bytes]] = [[] for _ in range(num_slots)]  # its indexed full blocks
        self._holders: dict[bytes, set[int]] = {}  # digest -> slots holding that block (at its position)
        self._released: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.on_lookup: Callable[[int, int], None] = lambda queried, hit: None

    # -- admission ---------------------------------------------------------------------------------
    def place(self, prompt: Sequence[int], free_slots: Sequence[int]) -> tuple[int, int]:
        """Choose a free slot for `prompt` and fill it with the cached prefix; returns (slot, cached tokens)."""
        if not self.enabled:
            slot = min(free_slots)
            self._forget_from(slot, 0)
            self._released.pop(slot, None)
            return slot, 0
        digests = block_digests(prompt, len(prompt) // BLOCK_SIZE)
        matched = 0
        while matched < len(digests) and digests[matched] in self._holders:
            matched += 1
        base = matched * BLOCK_SIZE
        # Token-level reach past the matched blocks, in every slot that holds them all.
        holders = self._holders[digests[matched - 1]] if matched else range(len(self._tokens))
        reach = {s: _common_prefix(prompt, self._tokens[s], base + BLOCK_SIZE, base) for s in holders}
        free = set(free_slots)
        order = [s for s in self._released if s in free] + sorted(free - self._released.keys())
        prefix = digests[:matched]
        own_reach = {s: reach.get(s, self._own_blocks(s, prefix) * BLOCK_SIZE) for s in order}
        # The free slot that forgets the fewest tokens it holds (an empty one, or one holding only a prefix of
        # this prompt: the previous turn of a conversation); among equals, the one holding the most of the
        # prompt in place, then the least recently used. Whatever another slot holds of the prompt is copied:
        # a copy costs far less than the forward that would recompute it.
        slot = min(order, key=lambda s: (len(self._tokens[s]) - own_reach[s], -own_reach[s]))
        own = own_reach[slot]
        source = max(reach, key=reach.__getitem__, default=slot)
        self._released.pop(slot, None)
        # What the slot forgets goes to the store first: keeping it may evict older entries, so the store is
        # searched after.
        self._store_forgotten(slot, own)
        self._forget_from(slot, own)
        # Past the slots' blocks, whole blocks kept in host memory beat a partial one from a slot; past those, the
        # tokens before the prompt's next block boundary come from whichever holds more of them.
        stored = self.store.run_length(digests, matched) if self.store is not None else 0
        blocks_end = (matched + stored) * BLOCK_SIZE
        from_slots = max(own, reach.get(source, base)) if not stored else blocks_end
        partial, partial_kv = 0, None
        if self.store is not None:
            parent = digests[matched + stored - 1] if matched + stored else b""
            partial, partial_kv = self.store.longest_start(parent, prompt[blocks_end : blocks_end + BLOCK_SIZE])
        total = max(from_slots, blocks_end + partial)
        for i in range(own // BLOCK_SIZE, matched):
            holder = next(iter(self._holders[digests[i]]))
            self.kv.copy_positions(holder, slot, i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)
            self._index(slot, digests[i])
        if stored:
            assert self.store is not None
            for i, block in enumerate(self.store.take_run(digests[matched : matched + stored]), start=matched):
                self.kv.write_positions(slot, i * BLOCK_SIZE, block)
                self._index(slot, digests[i])
        if partial_kv is not None and blocks_end + partial > from_slots:
            self.kv.write_positions(slot, blocks_end, partial_kv, partial)
        elif not stored and total > max(own, base):
            self.kv.copy_positions(source, slot, max(own, base), total)
        self._tokens[slot] = list(prompt[:total])
        hit = min(total, len(prompt) - 1)
        self.queried_tokens += len(prompt)
        self.hit_tokens += hit
        self.on_lookup(len(prompt), hit)
        return slot, hit

    def worth_waiting(self, prompt: Sequence[int], computing: Sequence[Sequence[int]]) -> bool:
        """Whether `prompt` should wait one step: a prompt admitted in this step (`computing`, not written yet)
        shares more of its full blocks than the cache holds now. Next step they are cached and copied, so
        `n` samples of one prompt, or requests arriving together with one system prompt, compute it once."""
        if not self.enabled or not computing:
            return False
        usable = (len(prompt) - 1) // BLOCK_SIZE  # the last token is fed anyway: blocks before it
        if usable == 0:
            return False
        digests = block_digests(prompt, usable)
        cached = 0
        while cached < usable and digests[cached] in self._holders:
            cached += 1
        limit = (cached + 1) * BLOCK_SIZE  # sharing at least one more block than the cache already gives
        return any(_common_prefix(prompt, other, limit) >= limit for other in computing)

    def release(self, slot: int) -> None:
        """The slot's sequence ended; its KV stays findable until the slot is reused."""
        self._released.pop(slot, None)
        self._released[slot] = None

    # -- writes ------------------------------------------------------------------------------------
    def written(self, slot: int, start: int, tokens: Sequence[int]) -> None:
        """A forward wrote `tokens`' KV to `slot` from `start`: drop blocks from there on, index full ones."""
        if not self.enabled:
            return
        held = self._tokens[slot]
        if start < len(held) or start // BLOCK_SIZE < len(self._digests[slot]):
            self._forget_from(slot, start)
            held = self._tokens[slot]
        if start > len(held):
            # KV before `start` that this index never saw (cannot happen through place()): index nothing.
            return
        held.extend(tokens)
        complete = len(held) // BLOCK_SIZE
        indexed = len(self._digests[slot])
        if complete > indexed:
            previous = self._digests[slot][-1] if indexed else b""
            for i in range(indexed, complete):
                previous = chained_digest(previous, held[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
                self._index(slot, previous)

    def discard(self, slot: int, start: int) -> None:
        """A forward meant to write `slot` from `start` failed midway: what lies there is unknown, so unindex it."""
        self._forget_from(slot, start)

    # -- bookkeeping ---------------------------------------------------------------------------------
    def _store_forgotten(self, slot: int, position: int) -> None:
        """Keep in the host store what `slot` holds from `position` on: its tokens past its last full block,
        then its full blocks that no other slot holds. Last first: the store evicts the least recently kept,
        and a chain is of no use without its head."""
        if self.store is None:
            return
        own, held = self._digests[slot], self._tokens[slot]
        full = len(own) * BLOCK_SIZE
        if len(held) > max(full, position):
            parent = own[-1] if own else b""
            tail = held[full:]
            block = self.kv.read_positions(slot, full, len(held))
            self.store.keep(chained_digest(parent, tail, b"/tail"), parent, tail, block)
        for i in range(len(own) - 1, position // BLOCK_SIZE - 1, -1):
            if self._holders.get(own[i]) == {slot} and own[i] not in self.store:
                block = self.kv.read_positions(slot, i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)
                self.store.keep(own[i], own[i - 1] if i else b"", held[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE], block)

    def _own_blocks(self, slot: int, digests: Sequence[bytes]) -> int:
        own = self._digests[slot]
        count = 0
        while count < len(digests) and count < len(own) and own[count] == digests[count]:
            count += 1
        return count

    def _index(self, slot: int, digest: bytes) -> None:
        self._digests[slot].append(digest)
        self._holders.setdefault(digest, set()).add(slot)

    def _forget_from(self, slot: int, position: int) -> None:
        """Positions >= `position` of `slot` are about to change: unindex the blocks that cover them."""
        del self._tokens[slot][position:]
        keep = position // BLOCK_SIZE
        for digest in self._digests[slot][keep:]:
            holders = self._holders.get(digest)
            if holders is not None:
                holders.discard(slot)
                if not holders:
                    del self._holders[digest]
        del self._digests[slot][keep:]


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int, start: int = 0) -> int:
    """Length of the common prefix of `a` and `b`, counted up to `limit`, given that they agree before `start`."""
    n = min(len(a), len(b), limit)
    for i in range(start, n):
        if a[i] != b[i]:
            return i
    return n
