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
