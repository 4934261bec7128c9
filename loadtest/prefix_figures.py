"""Figures of the prefix cache, measured side by side in one run on a real gateway.

    python -m loadtest.prefix_figures [--block-sizes 16 32 64 128]

1. A ~1,000-token shared system prompt + short questions: time to first token cold (a new system
   prompt) vs warm (the system prompt cached), and the time spent loading the cached blocks.
2. 10 concurrent sessions sharing that system prompt, with distinct questions: the KV cells they
   hold in the context at the peak (live sequences share the prompt's cells), and the KV bytes
   their cached state takes in the pool, each against what 10 private copies would take.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
from pathlib import Path

from aiohttp import ClientSession

from gateway.workers.model_store import default_model_path
from loadtest.client import stream_chat
from loadtest.gateway_process import GatewayProcess
from loadtest.stats import RequestRecord

PARAGRAPH = ("The archive holds letters, maps and ledgers from the harbour town, sorted by year "
             "and by the family that kept them. Visitors ask about shipping routes, weather "
             "records, trade prices and the people who signed each page. ")


def system_prompt(seed: int) -> str:
    """About 1,000 tokens; `seed` makes it differ from the first token on."""
    return f"Archive {seed} assistant. " + PARAGRAPH * 22


async def ask(session: ClientSession, server: GatewayProcess, system: str, question: str,
              max_tokens: int = 8) -> RequestRecord:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    record, _ = await stream_chat(session, server.base_url, server.model_name, messages,
                                  max_tokens, {"ignore_eos": True})
    assert record.ok, record.error
    return record


async def ttft_figures(server: GatewayProcess, rounds: int) -> dict:
    cold, warm = [], []
    async with ClientSession() as session:
        for r in range(rounds):
            system = system_prompt(r)
            first = await ask(session, server, system, "Where are the maps kept?")
            cold.append(first.ttft)
            before = server.metrics()
            second = await ask(session, server, system, "Who signed the ledgers?")
            after = server.metrics()
            warm.append(second.ttft)
            assert second.cached_tokens > 900
    load = (after["prefixgate_prefix_cache_load_seconds_total"]
            - before["prefixgate_prefix_cache_load_seconds_total"])
    return {"prompt_tokens": first.prompt_tokens, "cold": statistics.median(cold),
            "warm": statistics.median(warm), "load": load}


async def peak_cells(server: GatewayProcess, done: asyncio.Event) -> int:
    """The most context cells in use, sampled from /metrics until `done`."""
    peak = 0
    while not done.is_set():
        metrics = await asyncio.to_thread(server.metrics)
        peak = max(peak, int(metrics["prefixgate_kv_cells_used"]))
        await asyncio.sleep(0.02)
    return peak


async def sharing_figures(server: GatewayProcess, sessions: int) -> dict:
    system = system_prompt(999)
    async with ClientSession() as session:
        before = server.metrics()
        done = asyncio.Event()
        sampler = asyncio.create_task(peak_cells(server, done))
        records = await asyncio.gather(*(
            ask(session, server, system, f"Question {i}: what about year {1800 + i}?",
                max_tokens=32) for i in range(sessions)))
        done.set()
        cells = await sampler
    after = server.metrics()
    used_blocks = (after["prefixgate_kv_pool_blocks_used"]
                   - before["prefixgate_kv_pool_blocks_used"])
    block_bytes = after["prefixgate_kv_pool_bytes_capacity"] / (
        after["prefixgate_kv_pool_blocks_used"] + after["prefixgate_kv_pool_blocks_free"])
    block_tokens = after["prefixgate_kv_pool_block_tokens"]
    # Unshared: each session's own copy of its KV (prompt and answer), in whole blocks.
    unshared_blocks = sum(math.ceil((r.prompt_tokens + r.output_tokens - 1) / block_tokens)
                          for r in records)
    return {"sessions": sessions, "shared_bytes": used_blocks * block_bytes,
            "unshared_bytes": unshared_blocks * block_bytes, "peak_cells": cells,
            "private_cells": sum(r.prompt_tokens + r.output_tokens - 1 for r in records),
            "shared_tokens": (after["prefixgate_prefix_shared_tokens_total"]
                              - before["prefixgate_prefix_shared_tokens_total"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[64])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sessions", type=int, default=10)
    p.add_argument("--gateway-args", nargs=argparse.REMAINDER, default=[],
                   help="extra prefixgate flags, e.g. --deterministic")
    args = p.parse_args()
    model_path = args.model or default_model_path()
    print("| block size | prompt tokens | TTFT cold (s) | TTFT warm (s) | warm/cold | "
          "block load (ms) |")
    print("|---:|---:|---:|---:|---:|---:|")
    sharing = None
    for block_size in args.block_sizes:
        # Enough sequences that all the sessions run at once.
        server = GatewayProcess(model_path, "--block-size", str(block_size),
                                "--parallel", str(max(8, args.sessions)), *args.gateway_args)
        try:
            f = asyncio.run(ttft_figures(server, args.rounds))
            print(f"| {block_size} | {f['prompt_tokens']} | {f['cold']:.3f} | {f['warm']:.3f} | "
                  f"{f['warm'] / f['cold']:.3f} | {f['load'] * 1000:.1f} |", flush=True)
            if sharing is None:
                sharing = asyncio.run(sharing_figures(server, args.sessions))
        finally:
            server.stop()
    s = sharing
    print(f"\n{s['sessions']} concurrent sessions sharing one system prompt "
          f"(block size {args.block_sizes[0]}), against {s['sessions']} private copies:")
    print("| KV held | shared | private copies | shared/private |")
    print("|---|---:|---:|---:|")
    print(f"| cells in the context, at the peak | {s['peak_cells']} | {s['private_cells']} | "
          f"{s['peak_cells'] / s['private_cells']:.1%} |")
    print(f"| bytes in the pool (MiB) | {s['shared_bytes'] / 2**20:.1f} | "
          f"{s['unshared_bytes'] / 2**20:.1f} | {s['shared_bytes'] / s['unshared_bytes']:.1%} |")
    print(f"\nprompt tokens taken from live sequences' cells: {s['shared_tokens']:.0f}")


if __name__ == "__main__":
    main()
