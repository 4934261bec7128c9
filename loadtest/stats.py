"""Serving statistics with the definitions of vLLM's `bench serve` and SGLang's `bench_serving`.

TTFT: time to the first streamed token. TPOT: (latency - TTFT) / (output tokens - 1). ITL: every
gap between streamed chunks. E2E: request latency. Throughputs are over the run's wall time."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    start: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    end: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return list(np.diff(self.chunk_times))


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{q}": None for q in PERCENTILES}
    return {f"p{q}": float(np.percentile(values, q)) for q in PERCENTILES}


def summarize(records: list[RequestRecord], wall_seconds: float) -> dict:
    ok = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "wall_seconds": wall_seconds,
        "request_throughput": len(ok) / wall_seconds if wall_seconds else 0.0,
        "output_throughput": output_tokens / wall_seconds if wall_seconds else 0.0,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "cached_share": sum(r.cached_tokens for r in ok) / prompt_tokens if prompt_tokens else 0,
        "ttft": percentiles([r.ttft for r in ok]),
        "tpot": percentiles([t for r in ok if (t := r.tpot) is not None]),
        "itl": percentiles([gap for r in ok for gap in r.itls]),
        "e2e": percentiles([r.e2e for r in ok]),
    }
