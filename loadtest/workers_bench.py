"""The engine in the gateway's own process against engine worker processes, at many streams.

    git worktree add /tmp/prefixgate-before d1102ab    # the last commit before the workers
    python -m loadtest.workers_bench --before /tmp/prefixgate-before [--streams 64]

Three gateways, one after another, each serving N streams that arrive at once on one system
prompt (the benchmarks' many-streams workload): the engine in the gateway process (`--before`:
HTTP, sampling and llama.cpp share one interpreter), one worker process with every thread, and
two worker processes with one thread each (each with half the sequences and cells). Then the
routing policies on two workers, with the benchmarks' shared-prefix workload (two groups of 8
prompts on 1,024-token prefixes, 8 at a time): cache-aware with the default imbalance guard, with
a tight one, and round-robin. Printed: a table each of wall time, output throughput, TTFT
p50/p99, inter-token latency p50/p99 and the share of prompt tokens cached.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.llama import Model
from gateway.workers.model_store import default_model_path
from loadtest.bench import FULL, System, measure, serving, stream_layout
from loadtest.gateway_process import ROOT
from loadtest.workloads import TextMaker, many_streams, shared_prefix

ROUTINGS = {"cache-aware (default guard: 8 and 1.5x)": [],
            "cache-aware, tight guard (2 and 1.2x)": ["--balance-abs-threshold", "2",
                                                      "--balance-rel-threshold", "1.2"],
            "round-robin": ["--routing", "round-robin"]}


def gateway(name: str, model: Path, cwd: Path, n_streams: int, output_tokens: int,
            workers: int, threads: int, *flags: str) -> System:
    per_worker = n_streams // workers
    cells = stream_layout(FULL, output_tokens, per_worker).shared_cells
    if cwd == ROOT:
        flags = ("--workers", str(workers), *flags)
    return System(name, [sys.executable, "-m", "gateway", "--model", str(model), "--port",
                         "{port}", "--threads", str(threads), "--parallel", str(per_worker),
                         "--ctx-size", str(cells), *flags], "/health", {"ignore_eos": True},
                  kv_cells=cells * workers, cwd=cwd)


def run_all(systems: list[System], workload, concurrency: int, output_tokens: int,
            out: Path) -> list[tuple[str, dict | None]]:
    rows = []
    for system in systems:
        record: dict = {}
        with serving(system, out, record) as server:
            run = None
            if server is not None:
                run, _ = measure(server, system, "workers", workload(), concurrency,
                                 output_tokens)
            rows.append((system.name, run))
    return rows


def print_table(title: str, rows: list[tuple[str, dict | None]]) -> None:
    print(f"\n{title}\n")
    print("| gateway | wall (s) | output tok/s | TTFT p50 (s) | TTFT p99 (s) | ITL p50 (s) "
          "| ITL p99 (s) | cached | failed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, run in rows:
        if run is None:
            print(f"| {name} | not run | | | | | | | |")
            continue
        print(f"| {name} | {run['wall_seconds']:.1f} | {run['output_throughput']:.1f} "
              f"| {run['ttft']['p50']:.2f} | {run['ttft']['p99']:.2f} | {run['itl']['p50']:.3f} "
              f"| {run['itl']['p99']:.3f} | {run['cached_share']:.0%} | {run['failed']} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, required=True,
                   help="a checkout whose gateway runs the engine in its own process")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "workers")
    args = p.parse_args()
    model_path = default_model_path()
    model = Model(str(model_path))
    n, out = args.streams, args.output_tokens
    systems = [gateway("in-process (before)", model_path, args.before, n, out, 1, 2),
               gateway("1 worker process", model_path, ROOT, n, out, 1, 2),
               gateway("2 worker processes", model_path, ROOT, n, out, 2, 1)]
    streams = run_all(systems, lambda: many_streams(
        TextMaker(model, seed=3000 + n), n, FULL.stream_prompt_tokens,
        FULL.stream_question_tokens), n, out, args.out)
    # Room for both prefixes and every question in each worker: no preemption.
    routed = run_all([gateway(name, model_path, ROOT, 16, out, 2, 1, *flags,
                              "--ctx-size", "8192") for name, flags in ROUTINGS.items()],
                     lambda: shared_prefix(TextMaker(model, seed=4000), FULL.groups,
                                           FULL.prompts_per_group, FULL.prefix_tokens,
                                           FULL.question_tokens), 8, out, args.out)
    model.close()
    print_table(f"{n} streams at once on one {FULL.stream_prompt_tokens}-token system prompt, "
                f"{out} output tokens each", streams)
    print_table("Routing on 2 workers of 1 thread: shared prefix, 2 groups x 8 prompts on "
                f"{FULL.prefix_tokens}-token prefixes, 8 at a time, {out} output tokens each",
                routed)

if __name__ == "__main__":
    main()
