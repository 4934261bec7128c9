"""What every handler shares: the server's configuration, the vocabulary (for prompts), the
engine workers, the metrics and the cache's hit-rate history."""

from __future__ import annotations

import asyncio
import fnmatch
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from cache.fingerprint import gguf_fingerprint
from engine.llama import Model
from gateway.config import Limits, SamplingDefaults, WorkersConfig
from gateway.core.engines import Engines
from gateway.edge.auth import KeyRing
from gateway.edge.errors import APIError
from gateway.edge.metrics import Metrics, draft_counts
from gateway.edge.ratelimit import RateLimiter, RateLimits
from gateway.formats.prompts import PromptBuilder
from gateway.responses.shared_store import SharedResponses
from gateway.responses.store import ResponseStore
from gateway.workers.shared_pool import SharedPool
from gateway.workers.supervisor import Workers

log = logging.getLogger(__name__)

HISTORY_STEP, HISTORY_SECONDS = 10.0, 900.0  # the hit-rate history: a sample each, kept


@dataclass
class ServerConfig:
    model_name: str
    workers: WorkersConfig
    host: str = "127.0.0.1"
    port: int = 8000
    drain_seconds: float = 30.0  # on SIGTERM, how long requests in flight may finish
    keys: KeyRing | None = None  # None: open to anyone who can reach it
    admin_key: str | None = None  # the cache admin API (/v1/cache/*); None: no admin API
    metrics_key: str | None = None  # guards /metrics
    debug_key: str | None = None  # turns /debug/* on, behind it
    cors_origin: str | None = None  # None: no CORS headers, browsers on other origins refused
    limits: Limits = Limits()
    chat_template: str | None = None  # instead of the GGUF's own
    log_prompts: bool = False
    sampling: SamplingDefaults = SamplingDefaults()  # for requests that leave them out
    model_aliases: tuple[str, ...] = ()  # other names (fnmatch patterns) served by the model
    keep_billing_header: bool = False  # Claude Code's per-conversation system line
    response_store_mb: int = 256  # stored /v1/responses at most, oldest dropped first
    response_store_hours: float = 24.0  # and for at most this long
    rate_limits: RateLimits = RateLimits()  # per API key


@dataclass(frozen=True)
class HistorySample:
    at: float  # monotonic
    wall: float
    queried: int
    hit: int
    evictions: int
    ttft_seconds: float
    ttft_count: int

    def between(self, previous: HistorySample) -> dict:
        """What happened from `previous` to this sample, per minute where a rate."""
        minutes = (self.at - previous.at) / 60
        queried = self.queried - previous.queried
        first_tokens = self.ttft_count - previous.ttft_count
        return {"time": self.wall,
                "hit_rate": (self.hit - previous.hit) / queried if queried else None,
                "ttft": (self.ttft_seconds - previous.ttft_seconds) / first_tokens
                if first_tokens else None,
                "evictions_per_minute": (self.evictions - previous.evictions) / minutes}


class Gateway:
    """What the handlers share: the vocabulary (for prompts), the engine workers, and the
    metrics. Workers start on a background thread so that /health can answer 503 meanwhile."""

    def __init__(self, config: ServerConfig, engines: Engines | None = None) -> None:
        """`engines`: who runs the requests; this machine's engine workers by default."""
        self.config = config
        self.model: Model | None = None  # vocabulary only: the weights live in the workers
        self.prompts: PromptBuilder | None = None
        self.workers: Engines = engines or Workers(config.workers)
        self.load_error: str | None = None
        self.responses = ResponseStore(config.response_store_mb << 20,
                                       config.response_store_hours * 3600,
                                       config.workers.tenant_cache_share)
        self.shared_responses: SharedResponses | None = None  # with --redis-url and a key
        self.metrics = Metrics(self.workers, self.responses)
        self.rate_limiter = RateLimiter(config.rate_limits) if config.rate_limits.enabled \
            else None
        self.history: deque[HistorySample] = deque()
        self._loaded = threading.Event()

    @property
    def ready(self) -> bool:
        return self._loaded.is_set() and self.load_error is None

    def load(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            model_path = self.config.workers.model_path
            self.model = Model(model_path, vocab_only=True)
            self.prompts = PromptBuilder(self.model, self.config.chat_template)
            self.workers.start(loop)
            self._attach_responses(model_path)
            log.info("serving %s as %r", model_path, self.config.model_name)
        except Exception as exc:
            log.exception("starting the engine workers failed")
            self.load_error = str(exc)
        finally:
            self._loaded.set()

    def _attach_responses(self, model_path: str) -> None:
        """The stored responses of earlier runs (--cache-dir) and of other replicas (Redis)."""
        workers = self.config.workers
        if workers.cache_dir is None and workers.redis is None:
            return
        fingerprint = gguf_fingerprint(model_path)
        if workers.cache_dir is not None:
            n = self.responses.load(workers.cache_dir, fingerprint)
            log.info("%d stored responses read from %s", n, workers.cache_dir)
        if workers.redis is not None and not workers.redis.key:
            log.warning("--redis-url without --redis-key: stored responses stay on this replica "
                        "(whole conversations are never put in Redis unencrypted); with "
                        "--redis-key they are shared, encrypted")
        elif workers.redis is not None:
            self.shared_responses = SharedResponses(workers.redis, fingerprint,
                                                    self.config.response_store_hours * 3600)

    def cache_totals(self) -> tuple[int, int]:
        """(prompt tokens looked up, prompt tokens served by the cache) so far."""
        hits = self.workers.tier_hits()
        return hits.queried, hits.served

    def sample_history(self) -> None:
        """Called every HISTORY_STEP seconds: what the figures over the last minutes read."""
        now = time.monotonic()
        pool = self.workers.pool
        index = pool.index.snapshot() if pool else None
        self.history.append(HistorySample(
            now, time.time(), *self.cache_totals(), index.evictions if index else 0,
            self.metrics.ttft_seconds, self.metrics.ttft_count))
        while self.history and self.history[0].at < now - HISTORY_SECONDS:
            self.history.popleft()

    def cache_stats(self) -> dict:
        pool = self.workers.pool
        index, slot_bytes = pool.index.snapshot(), pool.arena.header.slot_bytes
        snaps = [v.snapshot for v in self.workers.views()]
        now, (queried, hit) = time.monotonic(), self.cache_totals()

        def hit_rate(seconds: float) -> float | None:
            past = next((h for h in self.history if h.at >= now - seconds), None)
            if past is None or queried == past.queried:
                return None
            return (hit - past.hit) / (queried - past.queried)

        return {
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
                        in itertools.pairwise(self.history)],
            "speculation": draft_counts(snaps),
        }

    def close(self) -> None:
        self.workers.stop()
        if self.shared_responses is not None:
            self.shared_responses.close()
        cache_dir = self.config.workers.cache_dir
        if cache_dir is not None and self.ready:
            try:
                n = self.responses.save(cache_dir,
                                        gguf_fingerprint(self.config.workers.model_path))
                log.info("%d stored responses written to %s", n, cache_dir)
            except OSError:
                log.exception("writing the stored responses to %s failed", cache_dir)
        if self.model:
            self.model.close()

    def require_pool(self) -> SharedPool:
        """This process's block pool, for the cache's operator APIs (explain, admin)."""
        if self.workers.pool is None:
            raise APIError(404, "This server holds no prefix cache of its own: it runs with "
                           "--no-prefix-cache, or is a front whose cache is on its Dynamo "
                           "nodes (ask a node)", code="cache_disabled")
        return self.workers.pool

    def require_model(self, name: str) -> None:
        if not self.ready:
            raise APIError(503, "The model is still loading; retry shortly", code="model_loading")
        if name != self.config.model_name and not any(
                fnmatch.fnmatchcase(name, alias) for alias in self.config.model_aliases):
            raise APIError(404, f"The model `{name}` does not exist", "model", "model_not_found")

