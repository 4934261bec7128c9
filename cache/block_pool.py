"""Reference counts and the free list of the KV block slots in an arena.

The bytes live in a shared-memory `BlockArena`; this bookkeeping lives only in the process that
owns the cache index (the gateway), which is the single writer of block metadata. Workers read and
write block bytes at slots it assigns, and never allocate or free one themselves.
"""

from __future__ import annotations

import numpy as np


class BlockPool:
    def __init__(self, n_slots: int, block_size: int) -> None:
        if n_slots < 1:
            raise ValueError("a block pool needs at least one slot")
        self.n_slots = n_slots
        self.block_size = block_size
        self.refcounts = np.zeros(n_slots, np.int32)
        self._free = list(range(n_slots - 1, -1, -1))  # pop() hands out low slots first

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_used(self) -> int:
        return self.n_slots - len(self._free)

    @property
    def n_held(self) -> int:
        """Slots referenced by someone besides the tree."""
        return int((self.refcounts > 1).sum())

    def allocate(self) -> int | None:
        """A free slot with one reference, or None when the pool is full."""
        if not self._free:
            return None
        slot = self._free.pop()
        self.refcounts[slot] = 1
        return slot

    def retain(self, slot: int) -> None:
        assert self.refcounts[slot] > 0, "retaining a free block"
        self.refcounts[slot] += 1

    def release(self, slot: int) -> None:
        assert self.refcounts[slot] > 0, "releasing a free block"
        self.refcounts[slot] -= 1
        if self.refcounts[slot] == 0:
            self._free.append(slot)
