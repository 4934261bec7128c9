"""Prometheus metrics, named after vLLM's where they mean the same thing."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.engine import Output

if TYPE_CHECKING:
    from gateway.server import Gateway

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)


class Metrics:
    def __init__(self, gateway: Gateway) -> None:
        self.started = time.monotonic()
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("prefixgate_time_to_first_token_seconds",
                              "Time from request to first generated text", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("prefixgate_inter_token_latency_seconds",
                             "Gap between successive streamed outputs", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram("prefixgate_e2e_request_latency_seconds",
                             "Time from request to its last output", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.prompt_tokens = Counter("prefixgate_prompt_tokens", "Prompt tokens processed",
                                     registry=r)
        self.generation_tokens = Counter("prefixgate_generation_tokens",
                                         "Completion tokens generated", registry=r)
        self.requests = Counter("prefixgate_requests", "Finished requests by finish reason",
                                ["finish_reason"], registry=r)
        r.register(_EngineCollector(gateway))

    def request_timer(self) -> RequestTimer:
        return RequestTimer(self)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTimer:
    """Observes one request's latencies from the outputs it receives."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._start = self._last = time.monotonic()
        self._first_seen = False

    def on_output(self, output: Output) -> None:
        now = time.monotonic()
        m = self._metrics
        if output.text:
            (m.itl if self._first_seen else m.ttft).observe(
                now - (self._last if self._first_seen else self._start))
            self._first_seen = True
            self._last = now
        if output.usage:
            m.e2e.observe(now - self._start)
            m.prompt_tokens.inc(output.usage.prompt_tokens)
            m.generation_tokens.inc(output.usage.completion_tokens)
            m.requests.labels(output.finish_reason or "error").inc()


class _EngineCollector(Collector):
    """Reads the snapshot the engine thread publishes after every step: the live state belongs
    to that thread."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway

    def collect(self):
        engine = self._gateway.engine
        if engine is None:
            return
        snap = engine.snapshot
        yield GaugeMetricFamily("prefixgate_num_requests_running", "Requests holding a sequence",
                                value=snap.running)
        yield GaugeMetricFamily("prefixgate_num_requests_waiting",
                                "Requests queued for a sequence, preempted ones included",
                                value=snap.waiting)
        yield GaugeMetricFamily("prefixgate_kv_cells_used",
                                "KV cells of the context in use (cells shared by several "
                                "sequences count once)", value=snap.cells_used)
        yield GaugeMetricFamily("prefixgate_kv_cells_total", "KV cells of the context",
                                value=snap.cells_total)
        yield CounterMetricFamily("prefixgate_num_preemptions",
                                  "Requests paused because the KV cells ran out",
                                  value=snap.preemptions)
        yield CounterMetricFamily("prefixgate_prefix_shared_tokens",
                                  "Prompt tokens taken from live sequences' cells (seq_cp)",
                                  value=snap.shared_tokens)
        stats = snap.cache
        if stats is None:
            return
        yield CounterMetricFamily("prefixgate_prefix_cache_queries",
                                  "Prompt tokens looked up in the prefix cache",
                                  value=stats.queried_tokens)
        yield CounterMetricFamily("prefixgate_prefix_cache_hits",
                                  "Prompt tokens loaded from the prefix cache",
                                  value=stats.hit_tokens)
        yield CounterMetricFamily("prefixgate_prefix_cache_loads",
                                  "Requests that loaded cached blocks", value=stats.loads)
        yield CounterMetricFamily("prefixgate_prefix_cache_load_seconds",
                                  "Time spent loading cached blocks into sequences",
                                  value=stats.load_seconds)
        yield CounterMetricFamily("prefixgate_prefix_cache_stores",
                                  "Stores of sequences' new blocks", value=stats.stores)
        yield CounterMetricFamily("prefixgate_prefix_cache_store_seconds",
                                  "Time spent cutting sequences into cached blocks",
                                  value=stats.store_seconds)
        yield CounterMetricFamily("prefixgate_prefix_cache_store_failures",
                                  "Stores that failed: the request ran on uncached",
                                  value=stats.store_failures)
        yield CounterMetricFamily("prefixgate_prefix_cache_evictions",
                                  "KV blocks evicted to make room", value=snap.evictions)
        yield CounterMetricFamily("prefixgate_prefix_cache_uncached_requests",
                                  "Requests whose blocks did not fit: every block was in use",
                                  value=stats.uncached_requests)
        block_size = engine.cache.pool.block_size
        slot_bytes = engine.cache.pool.slot_bytes
        n_slots = snap.pool_blocks_used + snap.pool_blocks_free
        yield GaugeMetricFamily("prefixgate_kv_pool_block_tokens", "Tokens per KV block",
                                value=block_size)
        yield GaugeMetricFamily("prefixgate_kv_pool_blocks_used", "Pool blocks in use",
                                value=snap.pool_blocks_used)
        yield GaugeMetricFamily("prefixgate_kv_pool_blocks_free", "Pool blocks free",
                                value=snap.pool_blocks_free)
        yield GaugeMetricFamily("prefixgate_kv_pool_bytes_used", "Bytes of KV blocks in use",
                                value=snap.pool_blocks_used * slot_bytes)
        yield GaugeMetricFamily("prefixgate_kv_pool_bytes_capacity", "Byte budget of the pool",
                                value=n_slots * slot_bytes)
        yield GaugeMetricFamily("prefixgate_kv_pool_blocks_held",
                                "Pool blocks referenced by requests, not only the tree",
                                value=snap.pool_blocks_held)
        yield GaugeMetricFamily("prefixgate_kv_cache_usage_perc",
                                "Fraction of pool blocks in use",
                                value=snap.pool_blocks_used / n_slots)
