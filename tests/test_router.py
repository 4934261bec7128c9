from __future__ import annotations

import numpy as np

from gateway.router import Router, RoutingConfig, WorkerLoad

BLOCK = 16
SYSTEM = np.arange(256, dtype=np.int32)


def prompt(question: int) -> np.ndarray:
    return np.concatenate([SYSTEM, np.full(20, 1000 + question, np.int32)])


def test_a_request_goes_where_its_prefix_is_live():
    router = Router(RoutingConfig(), BLOCK)
    workers = [WorkerLoad(0, [np.arange(500, 600, dtype=np.int32)]), WorkerLoad(1, [prompt(1)])]
    chosen, reason = router.choose(prompt(2), workers, pool_cached=0)
    assert chosen.worker_id == 1 and reason == "cache_aware"


def test_with_the_prefix_in_the_pool_the_less_loaded_worker_wins():
    router = Router(RoutingConfig(), BLOCK)
    workers = [WorkerLoad(0, [prompt(1), prompt(3)]), WorkerLoad(1, [])]
    chosen, _ = router.choose(prompt(2), workers, pool_cached=len(SYSTEM))
    assert chosen.worker_id == 1


def test_the_imbalance_guard_overrides_the_cache():
    router = Router(RoutingConfig(balance_abs=4, balance_rel=1.5), BLOCK)
    busy = WorkerLoad(0, [prompt(i) for i in range(6)])
    idle = WorkerLoad(1, [np.arange(700, 710, dtype=np.int32)])
    chosen, reason = router.choose(prompt(9), [busy, idle], pool_cached=0)
    assert chosen.worker_id == 1 and reason == "balance"
    # Within the margins the live prefix still decides.
    busy.prompts = busy.prompts[:4]
    assert router.choose(prompt(9), [busy, idle], pool_cached=0)[1] == "cache_aware"


def test_round_robin_alternates_and_one_worker_is_the_only_choice():
    router = Router(RoutingConfig(policy="round-robin"), BLOCK)
    workers = [WorkerLoad(0), WorkerLoad(1)]
    picks = [router.choose(prompt(0), workers, 0)[0].worker_id for _ in range(4)]
    assert sorted(picks[:2]) == [0, 1] and picks[:2] == picks[2:]
    assert router.choose(prompt(0), workers[:1], 0) == (workers[0], "only")
