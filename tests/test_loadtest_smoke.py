"""Short runs of the benchmark runner and the locust users against the real gateway."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys

from loadtest.gateway_process import ROOT


def test_benchmark_runner_smoke(tmp_path):
    subprocess.run([sys.executable, "-m", "loadtest.bench", "--smoke", "--out", str(tmp_path)],
                   cwd=ROOT, check=True, timeout=600, capture_output=True)
    results = json.loads(next(tmp_path.glob("bench-*.json")).read_text())
    runs = results["runs"]
    assert {r["workload"] for r in runs} == {"shared_prefix", "multi_turn", "unique", "structured"}
    for run in runs:
        assert run["failed"] == 0 and run["output_throughput"] > 0
        assert run["ttft"]["p50"] > 0 and run["e2e"]["p99"] >= run["e2e"]["p50"]
    shared = next(r for r in runs if r["workload"] == "shared_prefix")
    assert shared["cached_share"] > 0.3  # the group's system prompt is reused
    assert results["systems"]["prefixgate"]["peak_rss_bytes"] > 0
    table = (tmp_path / "benchmarks.md").read_text()
    assert "| shared prefix | 2 | prefixgate |" in table
    assert (tmp_path / "throughput.png").stat().st_size > 0


def test_step_cost_prints_both_tables():
    out = subprocess.run([sys.executable, "-m", "loadtest.step_cost", "--repeats", "1"],
                         cwd=ROOT, check=True, timeout=600, capture_output=True, text=True).stdout
    rows = [m.group(1) for m in re.finditer(r"^\| (\d+) tokens \| \d+ ms \| \d+ ms \|$", out,
                                            re.MULTILINE)]
    assert rows == ["16", "64", "128", "256"]
    assert "| in a context of its own, KV moved in after |" in out


def test_weight_kernels_prints_a_row_per_type():
    out = subprocess.run([sys.executable, "-m", "loadtest.weight_kernels", "--types", "q4_0",
                          "--repeats", "1", "--prompt-tokens", "64"],
                         cwd=ROOT, check=True, timeout=300, capture_output=True, text=True).stdout
    rows = re.findall(r"^\| ([\w ]+) \| \d+ \| [\d.]+x \| [\d.]+ \|$", out, re.MULTILINE)
    assert rows == ["as shipped", "q4_0"]


def test_locust_users_report_ttft_and_tokens_per_second(gateway, tmp_path):
    subprocess.run([sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py",
                    "--headless", "-u", "3", "-r", "3", "-t", "20s", "--host", gateway.base_url,
                    "--csv", str(tmp_path / "run"), "--only-summary"],
                   cwd=ROOT, check=True, timeout=120, capture_output=True)
    with open(tmp_path / "run_stats.csv") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    assert int(rows[("POST", "shared prefix")]["Request Count"]) > 0
    assert int(rows[("TTFT", "shared prefix")]["Request Count"]) > 0
    assert int(rows[("tokens/s", "unique")]["Request Count"]) > 0
    assert int(rows[("", "Aggregated")]["Failure Count"]) == 0
