"""The gateway's cache index: leases, store plans and what a worker that dies leaves behind."""

from __future__ import annotations

from collections import Counter

import numpy as np

from cache.index import CacheIndex

BLOCK = 4


def tokens(*values: int) -> np.ndarray:
    return np.array(values, np.int32)


def only_the_tree_holds(index: CacheIndex) -> bool:
    refcounts = index.pool.refcounts
    return (bool((refcounts[refcounts > 0] == 1).all()) and index.pool.n_used == len(index.tree)
            and index.problems(live_owners={0, 1}) == [])


def store(index: CacheIndex, owner: int, prompt: np.ndarray, hold: bool = False) -> int:
    plan = index.plan_store(owner, prompt, "", final=True, hold=hold)
    index.commit_store(plan.plan_id, written=True)
    return plan.plan_id


def test_a_plan_covers_only_the_missing_blocks_and_joins_the_tree_on_commit():
    index = CacheIndex(8, BLOCK)
    prompt = np.arange(10, dtype=np.int32)
    first = index.plan_store(0, prompt, "", final=True, hold=False)
    assert (first.begin, first.end, len(first.slots)) == (0, 10, 3)
    assert index.cached_length(prompt, "") == 0  # not matchable before its bytes are written
    index.commit_store(first.plan_id, written=True)
    assert index.cached_length(prompt, "") == 10
    longer = np.arange(14, dtype=np.int32)
    second = index.plan_store(1, longer, "", final=True, hold=False)
    # The partial third block [8, 10) is extended by a copy: copy-on-write, never in place.
    assert (second.begin, second.end, len(second.slots)) == (8, 14, 2)
    index.commit_store(second.plan_id, written=True)
    assert index.cached_length(longer, "") == 14 and only_the_tree_holds(index)


def test_an_unwritten_plan_gives_its_slots_back():
    index = CacheIndex(8, BLOCK)
    plan = index.plan_store(0, np.arange(8, dtype=np.int32), "", final=True, hold=False)
    assert index.pool.n_used == 2
    index.commit_store(plan.plan_id, written=False)
    assert index.pool.n_used == 0 and len(index.tree) == 0
    assert index.snapshot().uncached_requests == 1


def test_two_workers_storing_the_same_blocks_keep_one_copy():
    index = CacheIndex(8, BLOCK)
    prompt = np.arange(8, dtype=np.int32)
    a = index.plan_store(0, prompt, "", final=True, hold=False)
    b = index.plan_store(1, prompt, "", final=True, hold=False)
    assert index.pool.n_used == 4  # both are writing
    index.commit_store(a.plan_id, written=True)
    index.commit_store(b.plan_id, written=True)
    assert index.pool.n_used == len(index.tree) == 2 and only_the_tree_holds(index)


def test_the_prefix_a_plan_hangs_from_is_not_evicted_before_its_commit():
    index = CacheIndex(3, BLOCK)
    shared = tokens(1, 1, 1, 1)
    store(index, 0, shared)
    plan = index.plan_store(0, np.concatenate([shared, tokens(2, 2, 2, 2)]), "", final=True,
                            hold=False)
    # Another prompt needs room: only unreferenced leaves may go, and the plan holds its prefix.
    other = index.plan_store(1, tokens(3, 3, 3, 3, 4, 4, 4, 4), "", final=True, hold=False)
    assert len(other.slots) == 1 and index.pool.n_free == 0
    index.commit_store(plan.plan_id, written=True)
    index.commit_store(other.plan_id, written=True)
    assert index.cached_length(np.concatenate([shared, tokens(2, 2, 2, 2)]), "") == 8


def test_a_held_store_is_a_lease_until_released():
    index = CacheIndex(8, BLOCK)
    prompt = np.arange(8, dtype=np.int32)
    lease_id = store(index, 0, prompt, hold=True)
    assert index.snapshot().blocks_held == 2
    index.release(lease_id)
    assert index.snapshot().blocks_held == 0 and only_the_tree_holds(index)


def test_a_dead_workers_leases_and_plans_are_all_returned():
    index = CacheIndex(16, BLOCK)
    prompt = np.arange(12, dtype=np.int32)
    store(index, 0, prompt)
    index.match(0, prompt, "")  # loading when it died
    store(index, 0, np.arange(100, 108, dtype=np.int32), hold=True)  # preempted, held
    index.plan_store(0, np.arange(200, 208, dtype=np.int32), "", final=True,
                     hold=False)  # writing
    survivor = index.match(1, prompt, "")  # another worker's lease survives
    assert index.problems(live_owners={1}) == ["worker 0 holds leases or plans but does not run"]
    index.release_owner(0)
    assert index.problems(live_owners={1}) == []
    assert index.snapshot().blocks_held == 3
    index.release(survivor.lease_id)
    assert only_the_tree_holds(index) and index.cached_length(prompt, "") == 12


def test_namespaces_never_share_blocks():
    index = CacheIndex(8, BLOCK)
    prompt = np.arange(8, dtype=np.int32)
    plan = index.plan_store(0, prompt, "tenant-a", final=True, hold=False)
    index.commit_store(plan.plan_id, written=True)
    assert index.cached_length(prompt, "tenant-a") == 8
    assert index.cached_length(prompt, "tenant-b") == 0
    assert index.match(0, prompt, "tenant-b").n_tokens == 0


def flood(index: CacheIndex, n: int) -> None:
    for i in range(n):
        store(index, 0, np.arange(1000 + 8 * i, 1008 + 8 * i, dtype=np.int32))


def test_past_the_pin_budget_a_path_keeps_a_pinned_prefix_and_the_rest_can_go():
    """Budget 2, a pinned path of 6 blocks, a flood: the first 2 blocks stay, the other 4 are
    evicted like any. (Before, the ancestors were unpinned and the pinned leaves kept all 6.)"""
    index = CacheIndex(12, BLOCK, pin_budget=2)
    prompt = np.arange(24, dtype=np.int32)
    store(index, 0, prompt)
    index.pin(prompt, "", until=index.tree.clock() + 3600)
    assert index.tree.n_pinned == 2
    flood(index, 20)
    assert index.cached_length(prompt, "") == 2 * BLOCK
    assert only_the_tree_holds(index)


def test_one_tenants_pins_cannot_push_out_every_others():
    index = CacheIndex(16, BLOCK, pin_budget=4)
    mine, theirs = np.arange(16, dtype=np.int32), np.arange(500, 508, dtype=np.int32)
    for namespace, prompt in (("tenant:a", mine), ("tenant:b", theirs)):
        plan = index.plan_store(0, prompt, namespace, final=True, hold=False)
        index.commit_store(plan.plan_id, written=True)
    until = index.tree.clock() + 3600
    index.pin(theirs, "tenant:b", until)
    index.pin(mine, "tenant:a", until + 1)  # A's 4 blocks would take the whole budget
    pinned = Counter(n.namespace for n in index.tree._pins)
    assert pinned == {b"tenant:a": 2, b"tenant:b": 2}
