"""How the gateway and its worker processes are configured (the engines' own settings are in
engine/config.py)."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

from cache.redis_tier import TierConfig
from engine.config import EngineConfig
from gateway.workers.router import RoutingConfig


@dataclass(frozen=True)
class WorkersConfig:
    model_path: str
    engine: EngineConfig
    n_workers: int = 1
    arena_path: Path | None = None  # None: a unique name under /dev/shm
    routing: RoutingConfig = RoutingConfig()
    max_queue: int = 128  # requests waiting for a sequence, beyond those running
    cache_dir: Path | None = None  # where the pool's blocks survive a restart
    redis: TierConfig | None = None  # the Redis tier shared with other gateways
    pin_budget_mb: int | None = None  # pinned blocks at most; None: a quarter of the pool
    # Past this share of the pool, a tenant makes room from its own least recently used
    # prefixes first, and other tenants' allocations take from it before anyone else.
    tenant_cache_share: float = 0.5
    # How long prompt_cache_retention "24h" pins, and the longest any pin lasts (cache_control
    # TTLs are capped at it). Shorter in tests.
    pin_hours: float = 24.0
    log_level: str = "info"
    # A worker with requests in flight that sends nothing for this long is stuck (inside
    # llama.cpp, say): killed and replaced. None: never. A step here takes 2 s at the most.
    step_timeout: float | None = 120.0


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a sampling parameter out gets, on every API (llama-server's
    --temp, --top-p, --top-k, --min-p): agent clients never send a temperature, and a model's
    recommended values are set once, on the server."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: all tokens
    min_p: float = 0.0


@dataclass(frozen=True)
class ModelConfig:
    """One model the gateway serves: the names clients send for it, how its prompts are
    rendered and sampled, and the engine workers that run it (`workers.model_path`: its GGUF)."""

    name: str  # the id /v1/models lists and requests send
    workers: WorkersConfig
    aliases: tuple[str, ...] = ()  # other names (fnmatch patterns) it answers to
    chat_template: str | None = None  # instead of the GGUF's own
    sampling: SamplingDefaults = SamplingDefaults()  # for requests that leave them out

    def answers_to(self, name: str) -> int:
        """How closely `name` names this model: 0 not at all; otherwise the more literal
        characters its closest alias has, the higher, and its own name above any alias. So
        `claude-haiku-*` on a small model wins over `claude-*` on the main one, whichever of
        the two is listed first."""
        if name == self.name:
            return 1 << 30
        return max((1 + len(alias.replace("*", "").replace("?", "")) for alias in self.aliases
                    if fnmatch.fnmatchcase(name, alias)), default=0)


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 16 << 20  # far above any prompt a context holds
    max_tokens: int | None = None  # completion tokens a request may ask for; None: its room
    request_timeout: float | None = 600.0  # seconds from arrival to the last token
    max_n: int = 8  # choices one request may ask for
