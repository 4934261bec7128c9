from __future__ import annotations

from cache.block_pool import BlockPool


def test_pool_hands_out_each_slot_once_and_recycles_it():
    pool = BlockPool(10, 8)
    slots = [pool.allocate() for _ in range(10)]
    assert sorted(slots) == list(range(10))
    assert pool.allocate() is None and pool.n_free == 0
    pool.retain(slots[0])
    assert pool.n_held == 1
    pool.release(slots[0])
    assert pool.n_free == 0 and pool.n_held == 0
    pool.release(slots[0])
    assert pool.n_free == 1 and pool.allocate() == slots[0]
