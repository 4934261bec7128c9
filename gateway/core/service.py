"""What every handler shares: the server's configuration, the models it serves, the stored
responses, the metrics and the cache's hit-rate history."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, replace

from gateway.config import Limits, ModelConfig, WorkersConfig
from gateway.core.engines import Engines
from gateway.core.models import LoadPolicy, Models, ServedModel
from gateway.edge.auth import KeyRing
from gateway.edge.metrics import Metrics, draft_counts
from gateway.edge.ratelimit import RateLimiter, RateLimits
from gateway.responses.shared_store import SharedResponses
from gateway.responses.store import ResponseStore

log = logging.getLogger(__name__)

HISTORY_STEP, HISTORY_SECONDS = 10.0, 900.0  # the hit-rate history: a sample each, kept


@dataclass
class ServerConfig:
    models: tuple[ModelConfig, ...]  # the first is what the operator APIs show unless asked
    loading: LoadPolicy = LoadPolicy()  # which models are loaded at once, and for how long
    host: str = "127.0.0.1"
    port: int = 8000
    drain_seconds: float = 30.0  # on SIGTERM, how long requests in flight may finish
    keys: KeyRing | None = None  # None: open to anyone who can reach it
    admin_key: str | None = None  # the cache admin API (/v1/cache/*); None: no admin API
    metrics_key: str | None = None  # guards /metrics
    debug_key: str | None = None  # turns /debug/* on, behind it
    cors_origin: str | None = None  # None: no CORS headers, browsers on other origins refused
    limits: Limits = Limits()
    log_prompts: bool = False
    keep_billing_header: bool = False  # Claude Code's per-conversation system line
    response_store_mb: int = 256  # stored /v1/responses at most, oldest dropped first
    response_store_hours: float = 24.0  # and for at most this long
    rate_limits: RateLimits = RateLimits()  # per API key

    @property
    def tiers(self) -> WorkersConfig:
        """What every model has alike from the command line, and the stored responses use
        too: --cache-dir, --redis-url, --tenant-cache-share."""
        return self.models[0].workers


@dataclass(frozen=True)
class HistorySample:
    """One model's counts at a moment."""

    at: float  # monotonic
    wall: float
    queried: int
    hit: int
    evictions: int
    ttft_seconds: float
    ttft_count: int

    def between(self, previous: HistorySample) -> dict:
        """What happened from `previous` to this sample, per minute where a rate. The pool's
        counts start again from zero when the model reloads: one that went down counts from
        zero (as Prometheus's rate() reads a counter's reset)."""
        minutes = (self.at - previous.at) / 60
        reloaded = self.queried < previous.queried or self.evictions < previous.evictions
        before = replace(previous, queried=0, hit=0, evictions=0) if reloaded else previous
        queried = self.queried - before.queried
        first_tokens = self.ttft_count - previous.ttft_count
        return {"time": self.wall,
                "hit_rate": (self.hit - before.hit) / queried if queried else None,
                "ttft": (self.ttft_seconds - previous.ttft_seconds) / first_tokens
                if first_tokens else None,
                "evictions_per_minute": (self.evictions - before.evictions) / minutes}


class Gateway:
    """What the handlers share: the models served, the stored responses, the metrics. Models
    load on a background thread so that /health can answer 503 meanwhile."""

    def __init__(self, config: ServerConfig, engines: Engines | None = None) -> None:
        """`engines`: who runs the (one) model's requests; each model's own workers by
        default."""
        self.config = config
        self.models = Models([ServedModel(model, engines) for model in config.models],
                             config.loading)
        self.load_error: str | None = None  # no model could load: the server exits
        self.responses = ResponseStore(config.response_store_mb << 20,
                                       config.response_store_hours * 3600,
                                       config.tiers.tenant_cache_share)
        self.shared_responses: SharedResponses | None = None  # with --redis-url and a key
        self.metrics = Metrics(self.models.all, self.responses)
        self.rate_limiter = RateLimiter(config.rate_limits) if config.rate_limits.enabled \
            else None
        self.history: deque[dict[str, HistorySample]] = deque()  # each model's, by its name
        self._loaded = threading.Event()

    @property
    def default_model(self) -> ServedModel:
        """The first --model: what the operator APIs show unless asked for another, and what
        a Dynamo node or front serves."""
        return self.models.all[0]

    @property
    def ready(self) -> bool:
        return self._loaded.is_set() and self.load_error is None

    def load(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            failures = self.models.start(loop)
            if failures and not any(model.ready for model in self.models.all):
                self.load_error = "; ".join(failures) if len(self.models.all) > 1 \
                    else self.default_model.load_error
                return
            self._attach_responses()
            for line in self.served():  # before /health says ready
                log.info("%s", line)
        except Exception as exc:
            log.exception("starting failed")
            self.load_error = str(exc)
        finally:
            self._loaded.set()

    def _attach_responses(self) -> None:
        """The stored responses of earlier runs (--cache-dir) and of other replicas (Redis)."""
        tiers = self.config.tiers
        if tiers.cache_dir is not None:
            n = self.responses.load(tiers.cache_dir)
            log.info("%d stored responses read from %s", n, tiers.cache_dir)
        if tiers.redis is not None and not tiers.redis.key:
            log.warning("--redis-url without --redis-key: stored responses stay on this replica "
                        "(whole conversations are never put in Redis unencrypted); with "
                        "--redis-key they are shared, encrypted")
        elif tiers.redis is not None:
            self.shared_responses = SharedResponses(tiers.redis,
                                                    self.config.response_store_hours * 3600)

    def served(self) -> list[str]:
        """What the start-up log lists once the models are read: a line for each model (its
        id, file, state, aliases, workers, share of the cache), then where it is served."""
        caches = [model.config.workers.engine.cache for model in self.models.all]
        cache_mb = sum(cache.budget_mb for cache in caches if cache.enabled)
        return [*(model.summary(cache_mb) for model in self.models.all),
                f"serving {len(caches)} model(s) on http://{self.config.host}:{self.config.port}"]

    def sample_history(self) -> None:
        """Called every HISTORY_STEP seconds: what the figures over the last minutes read, each
        model's."""
        now, wall = time.monotonic(), time.time()
        self.history.append({model.name: self._sample(model, now, wall)
                             for model in self.models.all})
        while self.history and next(iter(self.history[0].values())).at < now - HISTORY_SECONDS:
            self.history.popleft()

    def _sample(self, model: ServedModel, now: float, wall: float) -> HistorySample:
        hits, pool = model.engines.tier_hits(), model.engines.pool
        return HistorySample(now, wall, hits.queried, hits.served,
                             pool.index.snapshot().evictions if pool is not None else 0,
                             self.metrics.ttft_seconds[model.name],
                             self.metrics.ttft_count[model.name])

    def cache_stats(self, model: ServedModel) -> dict:
        """The model's pool, cells, pins, drafts, hit rates and their history."""
        pool = model.require_pool()
        index, slot_bytes = pool.index.snapshot(), pool.arena.header.slot_bytes
        snaps = [v.snapshot for v in model.engines.views()]
        now, hits = time.monotonic(), model.engines.tier_hits()
        queried, hit = hits.queried, hits.served
        history = [step[model.name] for step in self.history]

        def hit_rate(seconds: float) -> float | None:
            past = next((h for h in history if h.at >= now - seconds), None)
            if past is None or queried <= past.queried:  # none since, or reloaded since
                return None
            return (hit - past.hit) / (queried - past.queried)

        return {
            "model": model.name,
            "pool": {"blocks_used": index.blocks_used, "blocks_free": index.blocks_free,
                     "blocks_held": index.blocks_held, "bytes_used": index.blocks_used * slot_bytes,
                     "bytes_capacity": (index.blocks_used + index.blocks_free) * slot_bytes},
            "cells": {"used": sum(s.cells_used for s in snaps),
                      "total": sum(s.cells_total for s in snaps)},
            "hit_rate": {"1m": hit_rate(60), "5m": hit_rate(300),
                         "all": hit / queried if queried else None},
            "evictions": index.evictions,
            "pins": {"blocks": index.blocks_pinned, "budget_blocks": index.pin_budget,
                     "fallbacks": index.pin_fallbacks, "hit_tokens": index.pinned_hit_tokens},
            "history": [step.between(previous) for previous, step
                        in itertools.pairwise(history)],
            "speculation": draft_counts(snaps),
        }

    def close(self) -> None:
        self.models.close()
        if self.shared_responses is not None:
            self.shared_responses.close()
        cache_dir = self.config.tiers.cache_dir
        if cache_dir is not None and self.ready:
            try:
                n = self.responses.save(cache_dir)
                log.info("%d stored responses written to %s", n, cache_dir)
            except OSError:
                log.exception("writing the stored responses to %s failed", cache_dir)

    def require_model(self, name: str) -> ServedModel:
        """The model a request names (Models.find)."""
        return self.models.find(name)
