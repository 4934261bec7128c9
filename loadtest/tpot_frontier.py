"""The trade `--target-tpot-ms` moves along: prefixgate at several targets and llama-server, one
after another in one run, on loadtest.bench's unique-prompts workload at concurrency 8 (16
prompts of ~256 tokens with their own system message, 32 output tokens, a client sending its
next request when its last one ends).

    python -m loadtest.tpot_frontier [--targets 100 150 250 400 800] [--plot docs/tpot_frontier.png]

Prints output throughput, TTFT p50 and TPOT p50 of each, and their ratios to llama-server's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path

from engine.llama import Model
from gateway.workers.model_store import default_model_path
from loadtest.bench import (
    FULL,
    RunningServer,
    System,
    gateway_system,
    llama_server_system,
    run_workload,
)
from loadtest.gateway_process import ROOT
from loadtest.stats import summarize
from loadtest.workloads import TextMaker, unique_prompts

PARALLEL, CELLS_PER_SEQUENCE, CONCURRENCY, OUTPUT_TOKENS = 8, 4096, 8, 32


def measure(system: System, model: Model, log_dir: Path) -> dict:
    conversations = unique_prompts(TextMaker(model, seed=1008), FULL.unique_prompts,
                                   FULL.unique_tokens)
    server = RunningServer(system, log_dir)
    try:
        rows, wall = asyncio.run(run_workload(server, system, conversations, CONCURRENCY,
                                              OUTPUT_TOKENS))
    finally:
        server.stop()
    return summarize([r["record"] for r in rows], wall)


def table(results: dict[str, dict]) -> str:
    reference = results.get("llama-server")
    lines = ["| system | output tok/s | TTFT p50 | TPOT p50 | vs llama-server: throughput, "
             "TTFT, TPOT | failed |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        ratios = "" if reference is None else (
            f"{r['output_throughput'] / reference['output_throughput']:.2f}x, "
            f"{r['ttft']['p50'] / reference['ttft']['p50']:.2f}x, "
            f"{r['tpot']['p50'] / reference['tpot']['p50']:.2f}x")
        lines.append(f"| {name} | {r['output_throughput']:.1f} | {r['ttft']['p50']:.2f} s | "
                     f"{r['tpot']['p50'] * 1000:.0f} ms | {ratios} | {r['failed']} |")
    return "\n".join(lines)


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, r in results.items():
        ax.scatter(r["ttft"]["p50"], r["tpot"]["p50"] * 1000,
                   marker="*" if name == "llama-server" else "o", s=120)
        ax.annotate(f"{name}\n{r['output_throughput']:.1f} tok/s",
                    (r["ttft"]["p50"], r["tpot"]["p50"] * 1000), fontsize=7,
                    textcoords="offset points", xytext=(6, 4))
    ax.set_xlabel("TTFT p50 (s)")
    ax.set_ylabel("TPOT p50 (ms)")
    ax.set_title("16 unique prompts, 8 at a time: the --target-tpot-ms frontier")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", type=float, nargs="+", default=[100, 150, 250, 400, 800])
    p.add_argument("--llama-server", type=Path, default=ROOT / ".bench" / "llama-server")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args()
    path = default_model_path()
    model = Model(str(path), vocab_only=True)
    cells = CELLS_PER_SEQUENCE * PARALLEL
    systems = [gateway_system(f"prefixgate {target:g} ms", path, args.threads, PARALLEL, cells,
                              "--target-tpot-ms", str(target)) for target in args.targets]
    systems.append(llama_server_system(args.llama_server, path, args.threads, PARALLEL, cells))
    results = {}
    with tempfile.TemporaryDirectory() as logs:
        for system in systems:
            if system.missing:
                print(f"{system.name}: not run: {system.missing}", flush=True)
                continue
            results[system.name] = measure(system, model, Path(logs))
            print(f"{system.name}: done", flush=True)
    print(table(results))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
