"""The Redis tier: KV blocks shared by gateways that do not share an arena (other pods, other
machines)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TierStats:
    hit_tokens: int = 0  # prompt tokens loaded from Redis into the pool instead of computed
    stored_blocks: int = 0
    errors: int = 0
