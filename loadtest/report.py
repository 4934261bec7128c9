"""Markdown table and PNG plots from a benchmark run's results."""

from __future__ import annotations

from pathlib import Path

WORKLOADS = {"shared_prefix": "shared prefix", "multi_turn": "multi-turn",
             "unique": "unique prompts"}


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _run(results: dict, system: str, workload: str, level: int) -> dict | None:
    for run in results["runs"]:
        if (run["system"], run["workload"], run["concurrency"]) == (system, workload, level):
            return run
    return None


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def write_report(results: dict, out: Path, plots: bool = True) -> str:
    m = results["machine"]
    lines = ["# Benchmarks", "",
             f"Machine: {m['platform']}, {m['cpus']} CPUs, Python {m['python']}. Model "
             f"{m['model']}; every system: {m['threads']} threads, {m['parallel']} parallel "
             f"sequences, {m['output_tokens']} output tokens per request (end-of-generation "
             "ignored), greedy.", "",
             "Reproduce: `make bench` (it installs llama-cpp-python's server, builds llama-server "
             "once with `loadtest/build_llama_server.sh`, then runs `python -m loadtest.bench "
             "--docs docs/benchmarks.md`). Each concurrency level uses fresh seeded prompts, so "
             "every level starts with cold caches. Workloads: "
             + results.get("workloads", "see loadtest/bench.py") + ".", ""]
    for name, info in results["systems"].items():
        if info.get("missing"):
            lines.append(f"- **{name}**: not measured: {info['missing']}")
        else:
            lines.append(f"- **{name}**: peak resident memory "
                         f"{info.get('peak_rss_bytes', 0) / 2**20:.0f} MiB")
    lines += ["", *_ratios(results), ""]
    header = ("| workload | conc. | system | TTFT p50 / p90 / p99 (s) | TPOT p50 (s) | ITL p50 (s) "
              "| E2E p50 (s) | req/s | out tok/s | cached | failed |")
    lines += ["## All runs", "", header, "|" + "---|" * 11]
    for run in sorted(results["runs"], key=lambda r: (r["workload"], r["concurrency"])):
        t = run["ttft"]
        lines.append(
            f"| {WORKLOADS[run['workload']]} | {run['concurrency']} | {run['system']} | "
            f"{_fmt(t['p50'])} / {_fmt(t['p90'])} / {_fmt(t['p99'])} | "
            f"{_fmt(run['tpot']['p50'])} | {_fmt(run['itl']['p50'])} | "
            f"{_fmt(run['e2e']['p50'])} | {run['request_throughput']:.2f} | "
            f"{run['output_throughput']:.1f} | {run['cached_share']:.0%} | {run['failed']} |")
    lines += ["", *_per_turn(results)]
    if plots:
        lines += ["", *_plots(results, out)]
    table = "\n".join(lines) + "\n"
    (out / "benchmarks.md").write_text(table)
    return table


def _ratios(results: dict) -> list[str]:
    lines = ["## What the table answers", ""]
    ours = _run(results, "prefixgate", "shared_prefix", 8)
    for other in results["systems"]:
        theirs = _run(results, other, "shared_prefix", 8)
        if other == "prefixgate" or not ours or not theirs:
            continue
        lines.append(f"- Shared prefix, concurrency 8, vs {other}: TTFT p50 "
                     f"{_fmt(ours['ttft']['p50'])} s vs {_fmt(theirs['ttft']['p50'])} s "
                     f"({_ratio(ours['ttft']['p50'], theirs['ttft']['p50'])}); output throughput "
                     f"{ours['output_throughput']:.1f} vs {theirs['output_throughput']:.1f} tok/s "
                     f"({_ratio(ours['output_throughput'], theirs['output_throughput'])}).")
    for other in ("prefixgate-no-cache", "llama-server"):
        for level in (1, 8):
            a = _run(results, "prefixgate", "unique", level)
            b = _run(results, other, "unique", level)
            if a and b:
                ratio = _ratio(a["output_throughput"], b["output_throughput"])
                lines.append(f"- Unique prompts, concurrency {level}: prefixgate's output "
                             f"throughput is {ratio} of {other}'s ({a['output_throughput']:.1f} "
                             f"vs {b['output_throughput']:.1f} tok/s).")
    return lines


def _per_turn(results: dict) -> list[str]:
    lines = ["## Multi-turn, per turn", "",
             "| system | conc. | turn | cached share of prompt | TTFT p50 (s) |",
             "|---|---|---|---|---|"]
    for run in results["runs"]:
        for turn in run.get("per_turn") or []:
            lines.append(f"| {run['system']} | {run['concurrency']} | {turn['turn'] + 1} | "
                         f"{turn['cached_share']:.0%} | {_fmt(turn['ttft']['p50'])} |")
    return lines


def _plots(results: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = [s for s, info in results["systems"].items() if not info.get("missing")]
    levels = sorted({r["concurrency"] for r in results["runs"]})
    fig, axes = plt.subplots(1, len(WORKLOADS), figsize=(5 * len(WORKLOADS), 4))
    for ax, (workload, title) in zip(axes, WORKLOADS.items(), strict=True):
        for system in systems:
            points = [(lv, r["output_throughput"]) for lv in levels
                      if (r := _run(results, system, workload, lv))]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=system)
        ax.set(title=title, xlabel="concurrent requests", ylabel="output tokens/s",
               xticks=levels)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=100)
    plt.close(fig)

    level = 8 if 8 in levels else levels[-1]
    fig, ax = plt.subplots(figsize=(7, 4))
    data = [(s, r["ttft_samples"]) for s in systems
            if (r := _run(results, s, "shared_prefix", level)) and r["ttft_samples"]]
    if data:
        ax.boxplot([d for _, d in data], tick_labels=[s for s, _ in data])
        ax.set(title=f"TTFT, shared prefix, concurrency {level}", ylabel="seconds")
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(out / "ttft_shared_prefix.png", dpi=100)
    plt.close(fig)
    return ["![Output throughput against concurrency](throughput.png)", "",
            "![TTFT distribution, shared prefix](ttft_shared_prefix.png)"]


def main() -> None:
    import argparse
    import json

    p = argparse.ArgumentParser(description="Rewrite the report of a saved benchmark run.")
    p.add_argument("results", type=Path)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(write_report(json.loads(args.results.read_text()), args.out))


if __name__ == "__main__":
    main()
