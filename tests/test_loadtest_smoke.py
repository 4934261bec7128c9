"""Short runs of the benchmark runner and the locust users against the real gateway."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys

from engine.devices import Device
from loadtest.gateway_process import ROOT
from loadtest.gpu_bench import SYSTEM_NAMES, Measured, parse_args, report
from tests.tiny_models import tiny_model


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
    # Each user starts its first request at once: a short run, whose requests still in flight
    # at its end are finished (--stop-timeout), records one of each however busy the machine.
    subprocess.run([sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py",
                    "--headless", "-u", "3", "-r", "3", "-t", "6s", "--stop-timeout", "150",
                    "--host", gateway.base_url,
                    "--csv", str(tmp_path / "run"), "--only-summary"],
                   cwd=ROOT, check=True, timeout=240, capture_output=True)
    with open(tmp_path / "run_stats.csv") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    assert int(rows[("POST", "shared prefix")]["Request Count"]) > 0
    assert int(rows[("TTFT", "shared prefix")]["Request Count"]) > 0
    assert int(rows[("tokens/s", "unique")]["Request Count"]) > 0
    assert int(rows[("", "Aggregated")]["Failure Count"]) == 0


def test_gpu_benchmark_runs_end_to_end_and_prints_its_table(tmp_path):
    """On the CPU build (--backend cpu): the same script a GPU machine runs, llama-server
    reported as not built rather than left out."""
    out = subprocess.run([sys.executable, "-m", "loadtest.gpu_bench", "--backend", "cpu",
                          "--smoke", "--model", str(tiny_model("llama")),
                          "--llama-server", str(tmp_path / "llama-server")],
                         cwd=ROOT, check=True, timeout=300, capture_output=True, text=True).stdout
    figures = dict(re.findall(r"^\| ([^|]+) \| ([\d.]+) \| - \| - \|$", out, re.MULTILINE))

    def figure(label: str) -> float:
        return float(next(value for row, value in figures.items() if row.startswith(label)))

    for level in (1, 2):
        assert figure(f"shared prefix, concurrency {level}: TTFT p50 (s)") > 0
        assert figure(f"multi-turn, concurrency {level}: output throughput (tok/s)") > 0
    assert figure("64-token prefix computed on the device: TTFT p50 (s)") > 0
    # The cached request's prefix came back from the pool.
    assert figure("pool load into the device, per cached request") > 0
    assert figure("KV on the host per sequence") > 0
    assert figure("KV on the host held per live session") > 0
    assert f"llama-server: not run: {tmp_path / 'llama-server'} not built (BACKEND=cpu" in out
    assert "meaningless" not in out


def test_gpu_benchmark_on_a_software_device_says_its_speed_figures_are_meaningless():
    lavapipe = Device("Vulkan0", "llvmpipe (LLVM 15.0.6, 256 bits)", "gpu", 2 << 30, 2 << 30)
    settings = parse_args(["--backend", "vulkan", "--smoke", "--model", "tiny.gguf"])
    table = report(settings, [lavapipe], {name: Measured() for name in SYSTEM_NAMES}, {})
    assert "**Vulkan0 is a software device (llvmpipe (LLVM 15.0.6, 256 bits)" in table
    assert "Every speed figure below is meaningless" in table
    real = Device("CUDA0", "NVIDIA GeForce RTX 4090", "gpu", 24 << 30, 24 << 30)
    assert "meaningless" not in report(settings, [real], {name: Measured()
                                                         for name in SYSTEM_NAMES}, {})
