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
        engine = lambda: gateway.engine  # noqa: E731 - the engine exists only once loaded
        Gauge("prefixgate_num_requests_running", "Requests holding a sequence",
              registry=r).set_function(lambda: engine().n_running if engine() else 0)
        Gauge("prefixgate_num_requests_waiting", "Requests queued for a sequence",
              registry=r).set_function(lambda: engine().n_waiting if engine() else 0)
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
        r.register(_PrefixCacheCollector(gateway))

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


class _PrefixCacheCollector(Collector):
    """Reads the engine's cache counters at scrape time; they live on the engine thread."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway

    def collect(self):
        engine = self._gateway.engine
        cache = engine.cache if engine else None
        if cache is None:
            return
        stats, pool = cache.stats, cache.pool
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
        yield CounterMetricFamily("prefixgate_prefix_cache_evictions",
                                  "KV blocks evicted to make room", value=cache.tree.evictions)
        yield CounterMetricFamily("prefixgate_prefix_cache_uncached_requests",
                                  "Requests whose blocks did not fit: every block was in use",
                                  value=stats.uncached_requests)
        yield GaugeMetricFamily("prefixgate_kv_pool_block_tokens", "Tokens per KV block",
                                value=pool.block_size)
        yield GaugeMetricFamily("prefixgate_kv_pool_blocks_used", "Pool blocks in use",
                                value=pool.n_used)
        yield GaugeMetricFamily("prefixgate_kv_pool_blocks_free", "Pool blocks free",
                                value=pool.n_free)
        yield GaugeMetricFamily("prefixgate_kv_pool_bytes_used", "Bytes of KV blocks in use",
                                value=pool.n_used * pool.slot_bytes)
        yield GaugeMetricFamily("prefixgate_kv_pool_bytes_capacity", "Byte budget of the pool",
                                value=pool.capacity_bytes)
        yield GaugeMetricFamily("prefixgate_kv_pool_blocks_held",
                                "Pool blocks referenced by running requests, not only the tree",
                                value=int((pool.refcounts > 1).sum()))
        yield GaugeMetricFamily("prefixgate_kv_cache_usage_perc",
                                "Fraction of pool blocks in use", value=pool.n_used / pool.n_slots)
