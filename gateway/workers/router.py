"""Which worker serves a request.

Cache-aware (as NVIDIA Dynamo's KV router): each worker's cost is the prompt blocks it would have
to compute (what its live sequences or the shared pool hold counts as cached) plus the blocks its
requests in flight hold (its decode load); the lowest cost wins. An imbalance guard (as SGLang's
router) overrides it: when the busiest worker has more requests than the idlest by both an
absolute and a relative margin, the idlest gets the request, whatever it would have to compute.
Round-robin ignores all that; it exists to pin consecutive requests to different workers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from cache.tokens import common_prefix

POLICIES = ("cache-aware", "round-robin")


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = "cache-aware"
    balance_abs: int = 8  # requests
    balance_rel: float = 1.5


@dataclass
class WorkerLoad:
    """One ready worker as the gateway sees it: the prompts of all its requests in flight
    (its load, whoever sent them), and of those a new request may share cells with (its own
    namespace's: another tenant's would answer faster, a timing side channel)."""

    worker_id: int
    prompts: list[np.ndarray] = field(default_factory=list)
    shareable: list[np.ndarray] = field(default_factory=list)

    @property
    def n_requests(self) -> int:
        return len(self.prompts)

    def live_prefix(self, prompt: np.ndarray) -> int:
        """The longest prefix of `prompt` one of its shareable requests holds or computes."""
        return max((common_prefix(other, prompt) for other in self.shareable), default=0)


class Router:
    def __init__(self, config: RoutingConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self._turn = 0

    def choose(self, prompt: np.ndarray, workers: list[WorkerLoad],
               pool_cached: int) -> tuple[WorkerLoad, str]:
        """The worker for `prompt`, and why: only, round_robin, balance or cache_aware."""
        if len(workers) == 1:
            return workers[0], "only"
        if self.config.policy == "round-robin":
            self._turn += 1
            return workers[self._turn % len(workers)], "round_robin"
        busiest = max(workers, key=lambda w: w.n_requests)
        idlest = min(workers, key=lambda w: w.n_requests)
        if (busiest.n_requests - idlest.n_requests > self.config.balance_abs
                and busiest.n_requests > self.config.balance_rel * idlest.n_requests):
            return idlest, "balance"
        return min(workers, key=lambda w: (self.cost(prompt, w, pool_cached), w.n_requests,
                                           w.worker_id)), "cache_aware"

    def cost(self, prompt: np.ndarray, worker: WorkerLoad, pool_cached: int) -> int:
        cached = max(pool_cached, worker.live_prefix(prompt))
        to_compute = math.ceil((len(prompt) - cached) / self.block_size)
        active = sum(math.ceil(len(p) / self.block_size) for p in worker.prompts)
        return to_compute + active
