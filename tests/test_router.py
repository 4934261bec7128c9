from __future__ import annotations

import numpy as np

from gateway.workers.affinity import CacheKeyAffinity
from gateway.workers.router import Router, RoutingConfig, WorkerLoad

BLOCK = 16
SYSTEM = np.arange(256, dtype=np.int32)


def prompt(question: int) -> np.ndarray:
    return np.concatenate([SYSTEM, np.full(20, 1000 + question, np.int32)])


def load(worker_id: int, prompts: list[np.ndarray]) -> WorkerLoad:
    """A worker whose requests are all of the caller's namespace."""
    return WorkerLoad(worker_id, prompts, list(prompts))


def test_a_request_goes_where_its_prefix_is_live():
    router = Router(RoutingConfig(), BLOCK)
    workers = [load(0, [np.arange(500, 600, dtype=np.int32)]), load(1, [prompt(1)])]
    chosen, reason = router.choose(prompt(2), workers, pool_cached=0)
    assert chosen.worker_id == 1 and reason == "cache_aware"


def test_with_the_prefix_in_the_pool_the_less_loaded_worker_wins():
    router = Router(RoutingConfig(), BLOCK)
    workers = [load(0, [prompt(1), prompt(3)]), load(1, [])]
    chosen, _ = router.choose(prompt(2), workers, pool_cached=len(SYSTEM))
    assert chosen.worker_id == 1


def test_the_imbalance_guard_overrides_the_cache():
    router = Router(RoutingConfig(balance_abs=4, balance_rel=1.5), BLOCK)
    busy = load(0, [prompt(i) for i in range(6)])
    idle = load(1, [np.arange(700, 710, dtype=np.int32)])
    chosen, reason = router.choose(prompt(9), [busy, idle], pool_cached=0)
    assert chosen.worker_id == 1 and reason == "balance"
    # Within the margins the live prefix still decides.
    busy.prompts = busy.shareable = busy.prompts[:4]
    assert router.choose(prompt(9), [busy, idle], pool_cached=0)[1] == "cache_aware"


def test_round_robin_alternates_and_one_worker_is_the_only_choice():
    router = Router(RoutingConfig(policy="round-robin"), BLOCK)
    workers = [WorkerLoad(0), WorkerLoad(1)]
    picks = [router.choose(prompt(0), workers, 0)[0].worker_id for _ in range(4)]
    assert sorted(picks[:2]) == [0, 1] and picks[:2] == picks[2:]
    assert router.choose(prompt(0), workers[:1], 0) == (workers[0], "only")


def test_another_tenants_requests_count_as_load_but_share_nothing():
    """Tenant A's 8 requests run on worker 0; tenant B's request goes to the idle worker 1,
    and A's prefix, live on worker 0, does not draw B there."""
    router = Router(RoutingConfig(), BLOCK)
    busy = WorkerLoad(0, prompts=[prompt(i) for i in range(8)], shareable=[])
    idle = WorkerLoad(1)
    chosen, reason = router.choose(prompt(9), [busy, idle], pool_cached=0)
    assert chosen.worker_id == 1 and reason == "cache_aware"
    assert busy.live_prefix(prompt(9)) == 0


def test_prompt_cache_keys_are_each_tenants_own_and_bounded():
    affinity = CacheKeyAffinity(capacity=2)
    affinity.record("tenant:a", "support-bot", 0)
    assert affinity.owner("tenant:b", "support-bot") is None  # B learns nothing of A's key
    affinity.record("tenant:b", "support-bot", 1)
    assert affinity.owner("tenant:a", "support-bot") == 0
    affinity.record("tenant:a", "other", 1)  # the least recently used goes
    assert affinity.owner("tenant:a", "support-bot") is None and affinity.requests == 3
