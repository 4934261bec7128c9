"""Markdown table and PNG plots from a benchmark run's results."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

WORKLOADS = {"shared_prefix": "shared prefix", "multi_turn": "multi-turn",
             "unique": "unique prompts", "prefill": "prefill", "many_streams": "many streams",
             "structured": "structured output"}
PER_LEVEL = ("shared_prefix", "multi_turn", "unique")  # run at every concurrency level: plotted
OURS = ("prefixgate", "prefixgate-deterministic")  # the engine modes with targets
BASELINE = "llama-server"


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _measured(results: dict) -> list[dict]:
    # Results saved before prefill and many streams were measured have neither list; a streams
    # entry of a system that could not start has no figures.
    return [run for run in [*results["runs"], *results.get("prefill", []),
                            *results.get("streams", [])] if "ttft" in run]


def _run(results: dict, system: str, workload: str, level: int) -> dict | None:
    for run in _measured(results):
        if (run["system"], run["workload"], run["concurrency"]) == (system, workload, level):
            return run
    return None


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def _cell(text: str, limit: int = 160) -> str:
    """Text fit for a table cell: a start-up failure carries the server's log."""
    flat = " ".join(text.split()).replace("|", "\\|")
    return flat if len(flat) <= limit else flat[:limit] + "..."


@dataclass(frozen=True)
class Measure:
    label: str
    workload: str
    level: int
    path: tuple[str, ...]  # keys down to the figure in a run
    unit: str

    def of(self, run: dict | None) -> float | None:
        value = run
        for key in self.path:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    def fmt(self, value: float | None) -> str:
        return _fmt(value, 1 if self.unit == "tok/s" else 3)


@dataclass(frozen=True)
class Target:
    measure: Measure
    bound: float  # on the ratio of ours to llama-server's figure
    at_least: bool  # True: the ratio must be >= bound, else <= bound

    def describe(self) -> str:
        return f"target {'>=' if self.at_least else '<='} {self.bound:g}x"

    def met(self, ratio: float) -> bool:
        return ratio >= self.bound if self.at_least else ratio <= self.bound


def targets(results: dict) -> list[Target]:
    """The figures prefixgate's engine modes must reach against llama-server's."""
    streams = sorted({run["concurrency"] for run in results.get("streams", [])})

    def at(label: str, workload: str, level: int, path: tuple[str, ...], unit: str,
           bound: float, at_least: bool) -> Target:
        return Target(Measure(label, workload, level, path, unit), bound, at_least)

    def three_at_once(name: str, workload: str, level: int) -> list[Target]:
        # Structured output is compared per request: llama-server's grammar for a JSON schema
        # lets the model spread the same record over more tokens (newlines, indentation).
        throughput = (("request_throughput",), "req/s") if workload == "structured" else \
            (("output_throughput",), "tok/s")
        return [at(f"{name}, concurrency {level}, throughput", workload, level, *throughput,
                   1.0, True),
                at(f"{name}, concurrency {level}, TTFT p50", workload, level, ("ttft", "p50"),
                   "s", 0.6, False),
                at(f"{name}, concurrency {level}, TPOT p50", workload, level, ("tpot", "p50"),
                   "s", 1.5, False)]

    return [
        at("single-request prefill", "prefill", 1, ("prefill_tokens_per_s",), "tok/s", 1.0, True),
        at("unique prompts, concurrency 1, output throughput", "unique", 1,
           ("output_throughput",), "tok/s", 1.0, True),
        at("unique prompts, concurrency 1, TPOT p50", "unique", 1, ("tpot", "p50"), "s", 1.05,
           False),
        at("structured output, concurrency 1, TPOT p50", "structured", 1, ("tpot", "p50"), "s",
           1.1, False),
        # The scheduler's three at once (issue 31): more work done, sooner first tokens, and
        # streams at most half again slower than llama-server's.
        *three_at_once("unique prompts", "unique", 8),
        *(target for workload in ("multi_turn", "structured") for level in (4, 8)
          for target in three_at_once(WORKLOADS[workload], workload, level)),
        at("shared prefix, concurrency 8, TTFT p50", "shared_prefix", 8, ("ttft", "p50"), "s",
           0.5, False),
        at("shared prefix, concurrency 8, output throughput", "shared_prefix", 8,
           ("output_throughput",), "tok/s", 3.0, True),
        *(at(f"{n} streams, wall time", "many_streams", n, ("wall_seconds",), "s", 0.1, False)
          for n in streams),
    ]


def memory_line(results: dict, ours: str) -> str | None:
    """Peak memory (proportional set size of the server and its children) against
    llama-server's: <= 1x."""
    systems = results["systems"]
    a, b = (systems.get(s, {}).get("peak_rss_bytes") for s in (ours, BASELINE))
    if not a or not b:
        return None
    ratio = a / b
    return (f"- {ours} vs {BASELINE}, peak memory: {a / 2**20:.0f} vs {b / 2**20:.0f} MiB = "
            f"{ratio:.2f}x (target <= 1x): {'met' if ratio <= 1 else 'not met'}.")


def comparison(results: dict, ours: str, theirs: str, measure: Measure,
               target: Target | None = None) -> str | None:
    """One line: ours against theirs on `measure`, with the target's verdict if given. Without
    a target, None when either was not measured."""
    a_run, b_run = (_run(results, s, measure.workload, measure.level) for s in (ours, theirs))
    a, b = measure.of(a_run), measure.of(b_run)
    head = f"- {ours} vs {theirs}, {measure.label}"
    if a is None or not b:
        return f"{head}: not measured ({target.describe()})." if target else None
    ratio = a / b
    line = f"{head}: {measure.fmt(a)} vs {measure.fmt(b)} {measure.unit} = {ratio:.2f}x"
    if target:
        # Failed requests make a run shorter, not better.
        met = target.met(ratio) and not a_run["failed"]
        line += f" ({target.describe()}): {'met' if met else 'not met'}"
    for system, run in ((ours, a_run), (theirs, b_run)):
        if run["failed"]:
            line += f"; {run['failed']} of {system}'s requests failed"
    return line + "."


def _ratios(results: dict) -> list[str]:
    lines = ["## What the table answers", "",
             f"Targets: prefixgate's two engine modes against {BASELINE}, as the ratio of their "
             "figure to its figure. A run with failed requests misses its target. Structured "
             "output's throughput is in requests per second: the grammar llama-server builds "
             "from a JSON schema allows newlines and indentation, so the model spreads the same "
             "record over more tokens there.", ""]
    for ours in OURS:
        if ours in results["systems"]:
            lines += [comparison(results, ours, BASELINE, t.measure, t) for t in targets(results)]
            lines += [line for line in [memory_line(results, ours)] if line]
    others = [s for s in results["systems"] if s not in ("prefixgate", BASELINE)]
    others_lines = [line for theirs in others for t in targets(results)
                    if (line := comparison(results, "prefixgate", theirs, t.measure))]
    if others_lines:
        lines += ["", "Against the other systems (no targets):", "", *others_lines]
    return lines


def _prefill(results: dict) -> list[str]:
    runs = results.get("prefill") or []
    if not runs:
        return []
    base = _run(results, BASELINE, "prefill", 1)
    lines = ["## Single-request prefill", "",
             f"Single-request prefill tok/s, target >= 1x {BASELINE}'s: prompt tokens (counted "
             "with the model's chat template, the same for every system) / TTFT, the median of "
             "requests one after another, each with a fresh prompt; measured once per system.", "",
             "| system | prompt tokens | TTFT p50 (s) | prefill tok/s | "
             f"vs {BASELINE} | failed |", "|---|---|---|---|---|---|"]
    for run in runs:
        rate = run.get("prefill_tokens_per_s")
        lines.append(f"| {run['system']} | {run.get('prefill_prompt_tokens', '-')} | "
                     f"{_fmt(run['ttft']['p50'])} | {_fmt(rate, 1)} | "
                     f"{_ratio(rate, base and base.get('prefill_tokens_per_s'))} | "
                     f"{run['failed']} |")
    return lines


def _streams(results: dict) -> list[str]:
    entries = results.get("streams") or []
    if not entries:
        return []
    lines = ["## Many streams", "",
             f"Wall time of N streams, target prefixgate / {BASELINE} <= 0.1x. "
             + results.get("streams_note", ""), "",
             f"| streams | system | KV cells | wall (s) | vs {BASELINE} | TTFT p50 (s) "
             "| out tok/s | peak memory (MiB) | failed |", "|" + "---|" * 9]
    for entry in sorted(entries, key=lambda e: e["concurrency"]):
        n = entry["concurrency"]
        head = f"| {n} | {entry['system']} | {entry.get('kv_cells', '-')} |"
        if "ttft" not in entry:
            lines.append(f"{head} not run: {_cell(entry.get('missing') or 'unknown')} |"
                         + " - |" * 5)
            continue
        base = _run(results, BASELINE, "many_streams", n)
        lines.append(f"{head} {_fmt(entry['wall_seconds'], 1)} | "
                     f"{_ratio(entry['wall_seconds'], base and base['wall_seconds'])} | "
                     f"{_fmt(entry['ttft']['p50'])} | {entry['output_throughput']:.1f} | "
                     f"{entry.get('peak_rss_bytes', 0) / 2**20:.0f} | {entry['failed']} |")
    return lines


def write_report(results: dict, out: Path, plots: bool = True) -> str:
    m = results["machine"]
    lines = ["# Benchmarks", "",
             f"Machine: {m['platform']}, {m['cpus']} CPUs, Python {m['python']}. Model "
             f"{m['model']}; every system: {m['threads']} threads, {m['parallel']} parallel "
             f"sequences with {m['ctx_size']} KV cells each (many streams: see there), "
             f"{m['output_tokens']} output tokens per request (end-of-generation ignored), "
             "greedy.", "",
             "Reproduce: `make bench` (it installs llama-cpp-python's server, builds llama-server "
             "once with `loadtest/build_llama_server.sh`, then runs `python -m loadtest.bench "
             "--docs docs/benchmarks.md`). Each concurrency level uses fresh seeded prompts, so "
             "every level starts with cold caches. Workloads: "
             + results.get("workloads", "see loadtest/bench.py") + ".", ""]
    for name, info in results["systems"].items():
        if info.get("missing"):
            lines.append(f"- **{name}**: not measured: {info['missing']}")
        else:
            cells = f", {info['kv_cells']} KV cells in all" if info.get("kv_cells") else ""
            lines.append(f"- **{name}**: peak memory (PSS) "
                         f"{info.get('peak_rss_bytes', 0) / 2**20:.0f} MiB{cells}")
    lines += ["", *_ratios(results), ""]
    for section in (_prefill(results), _streams(results)):
        if section:
            lines += [*section, ""]
    header = ("| workload | conc. | system | TTFT p50 / p90 / p99 (s) | TPOT p50 (s) | ITL p50 (s) "
              "| E2E p50 (s) | req/s | out tok/s | cached | failed |")
    lines += ["## All runs", "", header, "|" + "---|" * 11]
    order = list(WORKLOADS)
    for run in sorted(_measured(results),
                      key=lambda r: (order.index(r["workload"]), r["concurrency"])):
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
    levels = sorted({r["concurrency"] for r in results["runs"] if r["workload"] in PER_LEVEL})
    fig, axes = plt.subplots(1, len(PER_LEVEL), figsize=(5 * len(PER_LEVEL), 4))
    for ax, workload in zip(axes, PER_LEVEL, strict=True):
        for system in systems:
            points = [(lv, r["output_throughput"]) for lv in levels
                      if (r := _run(results, system, workload, lv))]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=system)
        ax.set(title=WORKLOADS[workload], xlabel="concurrent requests",
               ylabel="output tokens/s", xticks=levels)
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
