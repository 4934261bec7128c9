from __future__ import annotations

import pytest

from cache.block_pool import HEADER_BYTES, BlockPool, PoolMismatch


def test_pool_never_exceeds_its_budget_and_recycles_slots():
    budget = HEADER_BYTES + 10 * (1000 + 4) + 500
    pool = BlockPool("test-budget", 1000, budget, "fp", 8)
    try:
        assert pool.n_slots == 10
        assert HEADER_BYTES + pool.n_slots * (pool.slot_bytes + 4) <= budget
        slots = [pool.allocate() for _ in range(10)]
        assert pool.allocate() is None and pool.n_free == 0
        pool.retain(slots[0])
        pool.release(slots[0])
        assert pool.n_free == 0
        pool.release(slots[0])
        assert pool.n_free == 1 and pool.allocate() == slots[0]
    finally:
        pool.close()


def test_another_process_attaches_only_with_the_same_fingerprint():
    pool = BlockPool("test-attach", 64, 1 << 20, "model-a", 8)
    try:
        slot = pool.allocate()
        pool.block(slot)[:4] = [1, 2, 3, 4]
        other = BlockPool.attach("test-attach", "model-a")
        assert list(other.block(slot)[:4]) == [1, 2, 3, 4]
        assert other.refcounts[slot] == 1 and other.block_size == 8
        other.close(unlink=False)
        with pytest.raises(PoolMismatch):
            BlockPool.attach("test-attach", "model-b")
    finally:
        pool.close()
