"""Prometheus metrics, named after vLLM's where they mean the same thing."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cache.index import IndexSnapshot
from cache.redis_tier import TierStats
from engine.messages import CacheStats, EngineSnapshot, Output
from engine.speculation import SOURCES
from gateway.edge.prefill_speed import PrefillSpeed

if TYPE_CHECKING:
    from gateway.core.engines import Engines
    from gateway.core.models import ServedModel
    from gateway.responses.store import ResponseStore
    from gateway.workers.shared_pool import TierHits
    from gateway.workers.supervisor import WorkerView

REFUSAL_REASONS = ("capacity", "rate_limit")
NO_MODEL = ""  # the `model` of a request that named no served model (absent in Prometheus)
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)


class Metrics:
    """Request metrics carry the served model's id (`model`): a name no model answers to, or a
    request refused before its model was read, counts under NO_MODEL, so clients cannot add
    label values."""

    def __init__(self, models: list[ServedModel], responses: ResponseStore) -> None:
        self.started = time.monotonic()
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("prefixgate_time_to_first_token_seconds",
                              "Time from request to first generated text", ["model"],
                              registry=r, buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("prefixgate_inter_token_latency_seconds",
                             "Gap between successive streamed outputs", ["model"], registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram("prefixgate_e2e_request_latency_seconds",
                             "Time from request to its last output", ["model"], registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.prompt_tokens = Counter("prefixgate_prompt_tokens", "Prompt tokens processed",
                                     ["model"], registry=r)
        self.generation_tokens = Counter("prefixgate_generation_tokens",
                                         "Completion tokens generated", ["model"], registry=r)
        self.requests = Counter("prefixgate_requests", "Finished requests by finish reason",
                                ["model", "finish_reason"], registry=r)
        self.responses = Counter("prefixgate_http_responses",
                                 "Responses by HTTP status (/health and /metrics left out)",
                                 ["model", "code"], registry=r)
        self.refused = Counter("prefixgate_requests_refused",
                               "Requests refused with a 429: the queue was full (capacity) or "
                               "the key's rate limit was reached (rate_limit)",
                               ["model", "reason"], registry=r)
        self.hosted_tools_left_out = Counter(
            "prefixgate_responses_hosted_tools_left_out",
            "Hosted tools (web_search, ...) a /v1/responses request offered, which cannot run "
            "here and were left out of the prompt", ["model", "type"], registry=r)
        # A series for each model from the start, so rate() sees the first request.
        for model in models:
            for family in (self.ttft, self.itl, self.e2e, self.prompt_tokens,
                           self.generation_tokens):
                family.labels(model.name)
            for reason in REFUSAL_REASONS:
                self.refused.labels(model.name, reason)
        r.register(_EngineCollector(models))
        r.register(_ModelsCollector(models))
        entries = Gauge("prefixgate_response_store_entries",
                        "Responses stored for GET and previous_response_id", registry=r)
        entries.set_function(lambda: responses.stats[0])
        stored = Gauge("prefixgate_response_store_bytes", "Bytes the stored responses hold",
                       registry=r)
        stored.set_function(lambda: responses.stats[1])
        # Each model's TTFT histogram's sum and count, kept where they are easy to read.
        self.ttft_seconds = {model.name: 0.0 for model in models}
        self.ttft_count = {model.name: 0 for model in models}
        self.prefill = {model.name: PrefillSpeed() for model in models}  # each model's own

    def request_timer(self, model: str, prompt_tokens: int) -> RequestTimer:
        """`model`: the served model's id."""
        return RequestTimer(self, model, prompt_tokens)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTimer:
    """Observes one request's latencies from the outputs it receives."""

    def __init__(self, metrics: Metrics, model: str, prompt_tokens: int) -> None:
        self._metrics = metrics
        self._model = model
        self._prompt_tokens = prompt_tokens
        self._start = self._last = time.monotonic()
        self._first_seen = False
        self._prefill_seen = False

    def on_output(self, output: Output) -> None:
        now = time.monotonic()
        m, model = self._metrics, self._model
        cached = output.usage.cached_tokens if output.usage else output.cached_tokens
        if cached is not None and not self._prefill_seen:  # the prompt is computed by now
            m.prefill[model].observe(self._prompt_tokens - cached, now - self._start)
            self._prefill_seen = True
        if output.text:
            gap = now - (self._last if self._first_seen else self._start)
            (m.itl if self._first_seen else m.ttft).labels(model).observe(gap)
            if not self._first_seen:  # what the cache page's TTFT line reads
                m.ttft_seconds[model] += gap
                m.ttft_count[model] += 1
            self._first_seen = True
            self._last = now
        if output.usage:
            m.e2e.labels(model).observe(now - self._start)
            m.prompt_tokens.labels(model).inc(output.usage.prompt_tokens)
            m.generation_tokens.labels(model).inc(output.usage.completion_tokens)
            m.requests.labels(model, output.finish_reason or "error").inc()


class _EngineCollector(Collector):
    """Reads the snapshots each model's workers publish after every step (their engines' state
    belongs to their threads) and its cache index's counts. Every sample carries its `model`;
    families without another label are totals over the model's workers; the
    `prefixgate_worker_*` families carry a `worker` label."""

    def __init__(self, models: list[ServedModel]) -> None:
        self._models = models

    def collect(self):
        merged: dict[str, Metric] = {}  # one family of each name, every model's samples in it
        for model in self._models:
            for family in self._collect(model.engines):
                into = merged.setdefault(family.name, Metric(
                    family.name, family.documentation, family.type, family.unit))
                into.samples += [s._replace(labels={"model": model.name, **s.labels})
                                 for s in family.samples]
        yield from merged.values()

    def _collect(self, workers: Engines):
        views = workers.views()
        if not views:
            return
        snaps = [v.snapshot for v in views]
        yield from _engine_totals(snaps)
        yield from _per_worker(views)
        yield CounterMetricFamily("prefixgate_prompt_cache_key_requests",
                                  "Requests that carried a prompt_cache_key",
                                  value=workers.affinity.requests)
        pool = workers.pool
        if pool is None:
            return
        yield from _cache_counters([s.cache for s in snaps if s.cache is not None])
        yield from _tiers(workers.tier_hits(), pool.tier_stats(), pool.tier_skipping())
        yield from _pool(pool.index.snapshot(), pool.index.block_size,
                         pool.arena.header.slot_bytes)


class _ModelsCollector(Collector):
    """Each model's state, loads and unloads (gateway/core/models.py)."""

    STATES = ("loaded", "loading", "unloaded", "unloading", "failed")

    def __init__(self, models: list[ServedModel]) -> None:
        self._models = models

    def collect(self):
        state = GaugeMetricFamily("prefixgate_model_state", "1 for the state each model is in",
                                  labels=["model", "state"])
        loads = CounterMetricFamily("prefixgate_model_loads", "Times a model was loaded",
                                    labels=["model"])
        unloads = CounterMetricFamily("prefixgate_model_unloads",
                                      "Times a model was unloaded (idle, for room, or asked)",
                                      labels=["model"])
        seconds = CounterMetricFamily("prefixgate_model_load_seconds",
                                      "Time spent loading a model, all its loads together",
                                      labels=["model"])
        memory = GaugeMetricFamily("prefixgate_model_memory_estimate_bytes",
                                   "What a model takes loaded, as estimated for "
                                   "--models-memory-mb: weights, KV cells, its pool",
                                   labels=["model"])
        waiting = GaugeMetricFamily("prefixgate_model_requests_waiting",
                                    "Requests waiting for a model to load", labels=["model"])
        for model in self._models:
            for name in self.STATES:
                state.add_metric([model.name, name], 1 if model.state == name else 0)
            loads.add_metric([model.name], model.loads)
            unloads.add_metric([model.name], model.unloads)
            seconds.add_metric([model.name], model.load_seconds)
            memory.add_metric([model.name], model.memory_bytes)
            waiting.add_metric([model.name], model.waiting)
        yield from (state, loads, unloads, seconds, memory, waiting)


def _engine_totals(snaps: list[EngineSnapshot]):
    """The workers' engine state, added up."""

    def total(name: str) -> int:
        return sum(getattr(s, name) for s in snaps)

    yield GaugeMetricFamily("prefixgate_num_requests_running", "Requests holding a sequence",
                            value=total("running"))
    yield GaugeMetricFamily("prefixgate_num_requests_waiting",
                            "Requests queued for a sequence, preempted ones included",
                            value=total("waiting"))
    yield GaugeMetricFamily("prefixgate_kv_cells_used",
                            "KV cells of the contexts in use (cells shared by several "
                            "sequences count once)", value=total("cells_used"))
    yield GaugeMetricFamily("prefixgate_kv_cells_total", "KV cells of the contexts",
                            value=total("cells_total"))
    yield CounterMetricFamily("prefixgate_num_preemptions",
                              "Requests paused because the KV cells ran out",
                              value=total("preemptions"))
    yield CounterMetricFamily("prefixgate_prompt_tokens_computed",
                              "Prompt tokens prefilled: neither shared from a live sequence "
                              "nor loaded from a cache tier",
                              value=total("computed_tokens"))
    yield CounterMetricFamily("prefixgate_prefix_shared_tokens",
                              "Prompt tokens taken from live sequences' cells (seq_cp)",
                              value=total("shared_tokens"))
    drafted = CounterMetricFamily("prefixgate_speculative_drafted_tokens",
                                  "Draft tokens verified (--speculation), by where they came "
                                  "from: the request's own text (prompt), the client's "
                                  "prediction, an earlier answer to the same prompt (history), "
                                  "what followed in the tenant's answers given lately (suffix)",
                                  labels=["source"])
    accepted = CounterMetricFamily("prefixgate_speculative_accepted_tokens",
                                   "Draft tokens accepted: output tokens that took no step of "
                                   "their own", labels=["source"])
    for source, counts in draft_counts(snaps).items():
        drafted.add_metric([source], counts["drafted"])
        accepted.add_metric([source], counts["accepted"])
    yield drafted
    yield accepted


def draft_counts(snaps: list[EngineSnapshot]) -> dict[str, dict[str, int]]:
    """Draft tokens the workers verified, by source: drafted and accepted."""
    counts = {source: {"drafted": 0, "accepted": 0} for source in SOURCES}
    for snap in snaps:
        for source, drafted, accepted in snap.drafts:
            counts[source]["drafted"] += drafted
            counts[source]["accepted"] += accepted
    return counts


def _cache_counters(stats: list[CacheStats]):
    """What the workers' prefix caches counted, added up."""

    def cache_total(name: str) -> float:
        return sum(getattr(c, name) for c in stats)

    for name, field, help_text in _CACHE_COUNTERS:
        yield CounterMetricFamily(name, help_text, value=cache_total(field))


def _tiers(hits: TierHits, tier: TierStats, skipping: bool):
    """Per cache tier: what it served, stored, failed at and dropped."""
    served = CounterMetricFamily("prefixgate_prefix_cache_tier_hits",
                                 "Prompt tokens served from each cache tier instead of computed",
                                 labels=["tier"])
    for name, n_tokens in hits.by_tier.items():
        served.add_metric([name], n_tokens)
    yield served
    stores = CounterMetricFamily("prefixgate_prefix_cache_tier_stores",
                                 "KV blocks written to each cache tier", labels=["tier"])
    stores.add_metric(["redis"], tier.stored_blocks)
    yield stores
    errors = CounterMetricFamily("prefixgate_prefix_cache_tier_errors",
                                 "Failed calls to a cache tier (timeouts, errors, values that "
                                 "did not verify): each only skipped the tier",
                                 labels=["tier"])
    errors.add_metric(["redis"], tier.errors)
    yield errors
    dropped = CounterMetricFamily("prefixgate_prefix_cache_tier_dropped_blocks",
                                  "Blocks never written to a tier: its write queue was full",
                                  labels=["tier"])
    dropped.add_metric(["redis"], tier.dropped_blocks)
    yield dropped
    breaker = GaugeMetricFamily("prefixgate_prefix_cache_tier_breaker_open",
                                "1 while a tier is skipped after repeated failures (its circuit "
                                "breaker is open)", labels=["tier"])
    breaker.add_metric(["redis"], int(skipping))
    yield breaker


def _pool(snap: IndexSnapshot, block_size: int, slot_bytes: int):
    """The shared pool's occupancy and the index's pins and evictions."""
    yield GaugeMetricFamily("prefixgate_prefix_cache_pinned_blocks",
                            "Pool blocks pinned by prompt_cache_retention 24h",
                            value=snap.blocks_pinned)
    yield GaugeMetricFamily("prefixgate_prefix_cache_pin_budget_blocks",
                            "Most pool blocks that may be pinned (--pin-budget-mb)",
                            value=snap.pin_budget)
    yield CounterMetricFamily("prefixgate_prefix_cache_pinned_fallbacks",
                              "Pinned blocks that fell back to LRU: the pin budget was full",
                              value=snap.pin_fallbacks)
    yield CounterMetricFamily("prefixgate_prefix_cache_pinned_hits",
                              "Prompt tokens matched in pinned blocks",
                              value=snap.pinned_hit_tokens)
    yield CounterMetricFamily("prefixgate_prefix_cache_evictions",
                              "KV blocks evicted to make room", value=snap.evictions)
    yield CounterMetricFamily("prefixgate_prefix_cache_uncached_requests",
                              "Requests whose blocks did not fit: every block was in use",
                              value=snap.uncached_requests)
    n_slots = snap.blocks_used + snap.blocks_free
    yield GaugeMetricFamily("prefixgate_kv_pool_block_tokens", "Tokens per KV block",
                            value=block_size)
    yield GaugeMetricFamily("prefixgate_kv_pool_blocks_used", "Pool blocks in use",
                            value=snap.blocks_used)
    yield GaugeMetricFamily("prefixgate_kv_pool_blocks_free", "Pool blocks free",
                            value=snap.blocks_free)
    yield GaugeMetricFamily("prefixgate_kv_pool_bytes_used", "Bytes of KV blocks in use",
                            value=snap.blocks_used * slot_bytes)
    yield GaugeMetricFamily("prefixgate_kv_pool_bytes_capacity", "Byte budget of the pool",
                            value=n_slots * slot_bytes)
    yield GaugeMetricFamily("prefixgate_kv_pool_blocks_held",
                            "Pool blocks referenced by requests, not only the tree",
                            value=snap.blocks_held)
    yield GaugeMetricFamily("prefixgate_kv_cache_usage_perc",
                            "Fraction of pool blocks in use",
                            value=snap.blocks_used / n_slots)


_CACHE_COUNTERS = (
    ("prefixgate_prefix_cache_queries", "queried_tokens",
     "Prompt tokens looked up in the prefix cache"),
    ("prefixgate_prefix_cache_hits", "hit_tokens", "Prompt tokens loaded from the prefix cache"),
    ("prefixgate_prefix_cache_loads", "loads", "Requests that loaded cached blocks"),
    ("prefixgate_prefix_cache_load_seconds", "load_seconds",
     "Time spent loading cached blocks into sequences"),
    ("prefixgate_prefix_cache_stores", "stores", "Stores of sequences' new blocks"),
    ("prefixgate_prefix_cache_store_seconds", "store_seconds",
     "Time spent cutting sequences into cached blocks"),
    ("prefixgate_prefix_cache_store_failures", "store_failures",
     "Stores that failed: the request ran on uncached"),
    ("prefixgate_prefix_cache_load_failures", "load_failures",
     "Loads of cached blocks that failed: the prompt was computed instead"),
)


def _per_worker(views: list[WorkerView]):
    gauges = {
        "running": GaugeMetricFamily("prefixgate_worker_requests_running",
                                     "Requests holding a sequence, per worker", labels=["worker"]),
        "waiting": GaugeMetricFamily("prefixgate_worker_requests_waiting",
                                     "Requests queued for a sequence, per worker",
                                     labels=["worker"]),
        "cells_used": GaugeMetricFamily("prefixgate_worker_kv_cells_used",
                                        "KV cells in use, per worker", labels=["worker"]),
    }
    up = GaugeMetricFamily("prefixgate_worker_up", "1 when the worker serves, 0 while it is "
                           "starting or being replaced", labels=["worker"])
    hits = CounterMetricFamily("prefixgate_worker_prefix_cache_hits",
                               "Prompt tokens a worker loaded from the shared pool",
                               labels=["worker"])
    shared = CounterMetricFamily("prefixgate_worker_prefix_shared_tokens",
                                 "Prompt tokens a worker took from its live sequences' cells",
                                 labels=["worker"])
    restarts = CounterMetricFamily("prefixgate_worker_restarts",
                                   "Times a worker was replaced: it died or was stuck",
                                   labels=["worker"])
    routed = CounterMetricFamily("prefixgate_routing_decisions",
                                 "Requests routed to a worker, by the router's reason",
                                 labels=["worker", "reason"])
    memory = GaugeMetricFamily("prefixgate_worker_memory_bytes",
                               "Memory llama.cpp allocated for a worker, by buffer (a device, "
                               "or host memory) and kind (model, KV, RS: a recurrent state, "
                               "compute, output)",
                               labels=["worker", "buffer", "kind"])
    for view in views:
        worker, snap = str(view.worker_id), view.snapshot
        for name, family in gauges.items():
            family.add_metric([worker], getattr(snap, name))
        up.add_metric([worker], 1 if view.state == "ready" else 0)
        hits.add_metric([worker], snap.cache.hit_tokens if snap.cache else 0)
        shared.add_metric([worker], snap.shared_tokens)
        restarts.add_metric([worker], view.restarts)
        for reason, n in view.routed.items():
            routed.add_metric([worker, reason], n)
        for buffer in view.memory:
            memory.add_metric([worker, buffer.buffer, buffer.kind], buffer.nbytes)
    yield from gauges.values()
    yield from (up, hits, shared, restarts, routed, memory)
