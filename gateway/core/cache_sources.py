"""Where the KV of a prompt is held before it runs (live sequences, the local pool, Redis), and
the header that tells a client what its request got from them:

    x-prefix-cache: cached=<n>; prompt=<m>; source=pool|live|redis|none

`cached` is the request's usage's cached tokens exactly (the worker's count); `source` names the
tier that held the most of them when the request was routed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.messages import GenerationRequest
from gateway.core.engines import Engines

HEADER = "x-prefix-cache"


@dataclass(frozen=True)
class Held:
    live: int = 0  # prompt tokens a request in flight of the namespace holds or computes
    pool: int = 0  # in the local pool, before anything was adopted from Redis
    redis: int = 0  # adopted from Redis into the pool for this request

    def source(self, cached: int) -> str:
        if cached == 0:
            return "none"
        # A live sequence's cells are shared first, the pool's blocks load beyond them; ties go
        # that way too.
        tiers = {"live": self.live, "pool": self.pool, "redis": self.redis}
        if not any(tiers.values()):  # stored after routing: a request in flight finished first
            return "pool"
        return max(tiers, key=lambda tier: min(tiers[tier], cached))


def held_for(engines: Engines, request: GenerationRequest, adopted: int, in_pool: int) -> Held:
    """What the tiers hold of a request about to be submitted: `in_pool` tokens of it in the
    pool, `adopted` of them just brought from Redis."""
    prompt = np.asarray(request.prompt_tokens, dtype=np.int32)
    live, _ = engines.live_match(prompt, request.namespace)
    return Held(live, max(0, in_pool - adopted), adopted)


def header_value(cached: int, prompt_tokens: int, held: Held) -> str:
    return f"cached={cached}; prompt={prompt_tokens}; source={held.source(cached)}"
