"""How long storing finished requests' KV stalls the streams running beside them.

    python -m loadtest.store_stall [--source DIR] [--gateway-args ...]

A ~1,000-token prompt is cached first. Then 4 streams with short prompts generate 200 tokens each
while 8 requests, each the cached prompt plus its own question, run one after another: each loads
the prompt, computes its question, answers 8 tokens and finishes, and the engine stores its new
blocks meanwhile. Printed: the inter-token latency of the 4 streams during that window (p50, p99,
max) and the engine's store time per request where it reports one. `--source` runs the gateway
from another checkout (e.g. a `git worktree` of an older commit), for before/after figures.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from pathlib import Path

import numpy as np
from aiohttp import ClientSession

from gateway.model_store import default_model_path
from loadtest.client import stream_chat
from loadtest.gateway_process import ROOT, GatewayProcess
from loadtest.prefix_figures import system_prompt

STREAMS = 4
FINISHING = 8


async def measure(server: GatewayProcess, model: str) -> dict:
    system = system_prompt(7)
    async with ClientSession() as session:
        async def chat(messages: list[dict], max_tokens: int):
            return (await stream_chat(session, server.base_url, model, messages, max_tokens,
                                      {"ignore_eos": True}))[0]

        def cached(question: str) -> list[dict]:
            return [{"role": "system", "content": system}, {"role": "user", "content": question}]

        await chat(cached("Warm up."), 4)
        streams = [asyncio.create_task(chat(
            [{"role": "user", "content": f"Tell a long story about ship {i}."}], 200))
            for i in range(STREAMS)]
        await asyncio.sleep(1.0)  # the streams are generating
        start = time.perf_counter()  # the clock of the records' chunk times
        for i in range(FINISHING):
            record = await chat(cached(f"Question {i}: who kept the ledgers of year {1850 + i}?"),
                                8)
            assert record.ok, record.error
        window = (start, time.perf_counter())
        records = await asyncio.gather(*streams)
    gaps = [b - a for r in records for a, b in itertools.pairwise(r.chunk_times)
            if window[0] <= a and b <= window[1]]
    return {"p50": float(np.percentile(gaps, 50)), "p99": float(np.percentile(gaps, 99)),
            "max": max(gaps), "n": len(gaps)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", type=Path, default=ROOT, help="checkout to run the gateway from")
    p.add_argument("--label", default=None)
    p.add_argument("--gateway-args", nargs=argparse.REMAINDER, default=[])
    args = p.parse_args()
    model = default_model_path()
    server = GatewayProcess(model, *args.gateway_args, source=args.source)
    try:
        figures = asyncio.run(measure(server, server.model_name))
        metrics = server.metrics()
    finally:
        server.stop()
    stores = metrics.get("prefixgate_prefix_cache_stores_total")
    store_time = metrics.get("prefixgate_prefix_cache_store_seconds_total")
    per_store = f"{store_time / stores * 1000:.1f}" if stores else "-"
    label = args.label or f"{args.source.name} {' '.join(args.gateway_args)}".strip()
    print("| gateway | ITL p50 (s) | ITL p99 (s) | ITL max (s) | gaps | store (ms each) |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| {label} | {figures['p50']:.3f} | {figures['p99']:.3f} | {figures['max']:.3f} | "
          f"{figures['n']} | {per_store} |")


if __name__ == "__main__":
    main()
