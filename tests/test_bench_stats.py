"""The benchmark statistics follow vLLM's and SGLang's definitions."""

from __future__ import annotations

import pytest

from loadtest.stats import RequestRecord, percentiles, summarize


def record(start, chunks, tokens, prompt=100, cached=0, error=None) -> RequestRecord:
    return RequestRecord(start=start, chunk_times=chunks, end=chunks[-1] if chunks else start,
                         output_tokens=tokens, prompt_tokens=prompt, cached_tokens=cached,
                         error=error)


def test_per_request_definitions():
    r = record(10.0, [10.5, 10.6, 10.8], tokens=3)
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(0.8)
    assert r.tpot == pytest.approx((0.8 - 0.5) / 2)  # (latency - TTFT) / (output tokens - 1)
    assert r.itls == pytest.approx([0.1, 0.2])  # every gap between chunks
    assert record(0, [0.3], tokens=1).tpot is None


def test_percentiles_interpolate_linearly():
    p = percentiles([float(v) for v in range(1, 101)])
    assert p == pytest.approx({"p50": 50.5, "p90": 90.1, "p99": 99.01})
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}


def test_summary_counts_failures_and_throughput_over_wall_time():
    records = [record(0, [1.0, 1.5], tokens=2, prompt=100, cached=60),
               record(0, [2.0, 2.5, 3.0], tokens=3, prompt=100, cached=0),
               record(0, [], tokens=0, error="HTTP 500")]
    s = summarize(records, wall_seconds=4.0)
    assert s["requests"] == 3 and s["failed"] == 1 and s["errors"] == ["HTTP 500"]
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["output_throughput"] == pytest.approx(5 / 4)
    assert s["cached_share"] == pytest.approx(0.3)
    assert s["ttft"]["p50"] == pytest.approx(1.5)
    assert s["itl"]["p50"] == pytest.approx(0.5)
    assert s["tpot"]["p50"] == pytest.approx((0.5 + 0.5) / 2)
