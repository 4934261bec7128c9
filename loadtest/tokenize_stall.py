"""How long rendering and tokenizing a huge prompt stalls the streams running beside it.

    python -m loadtest.tokenize_stall [--source DIR]

4 streams generate 200 tokens each; meanwhile 3 bursts of 8 chat requests arrive, each a single
message of ~68,000 tokens (~280 KB of text), so the gateway renders the chat template and
tokenizes it before it answers 400 `context_length_exceeded` (no prefill runs: whatever stalls
the streams is that work). Printed: the inter-token latency of the streams
while those requests are being answered (p50, p99, max) and the time each took to be refused.
`--source` runs the gateway from another checkout (a `git worktree` of d1102ab, whose handlers
tokenized on the event loop) for the figure before.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time
from pathlib import Path

import numpy as np
from aiohttp import ClientSession

from gateway.workers.model_store import default_model_path
from loadtest.client import stream_chat
from loadtest.gateway_process import ROOT, GatewayProcess

STREAMS = 4
BURSTS, BURST = 3, 8
# ~68,000 tokens of this model's vocabulary: past any context it serves.
HUGE_TEXT = "The ledger of the harbour records every ship, its cargo and its crew. " * 4800


async def measure(server: GatewayProcess, model: str) -> dict:
    async with ClientSession() as session:
        streams = [asyncio.create_task(stream_chat(
            session, server.base_url, model,
            [{"role": "user", "content": f"Tell a long story about ship {i}."}], 200,
            {"ignore_eos": True})) for i in range(STREAMS)]
        await asyncio.sleep(2.0)  # the streams are generating
        start = time.perf_counter()  # the clock of the records' chunk times
        async def refused() -> float:
            sent = time.perf_counter()
            async with session.post(server.base_url + "/v1/chat/completions", json={
                    "model": model, "max_tokens": 1,
                    "messages": [{"role": "user", "content": HUGE_TEXT}]}) as r:
                assert r.status == 400, await r.text()
            return time.perf_counter() - sent

        refusals = []
        for _ in range(BURSTS):
            refusals += await asyncio.gather(*(refused() for _ in range(BURST)))
        window = (start, time.perf_counter())
        records = [record for record, _ in await asyncio.gather(*streams)]
    gaps = [b - a for r in records for a, b in itertools.pairwise(r.chunk_times)
            if window[0] <= a and b <= window[1]]
    return {"p50": float(np.percentile(gaps, 50)), "p99": float(np.percentile(gaps, 99)),
            "max": max(gaps), "n": len(gaps), "refusal": statistics.median(refusals)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", type=Path, default=ROOT, help="checkout to run the gateway from")
    p.add_argument("--label", default=None)
    args = p.parse_args()
    server = GatewayProcess(default_model_path(), "--ctx-size", "16384", source=args.source)
    try:
        figures = asyncio.run(measure(server, server.model_name))
    finally:
        server.stop()
    label = args.label or args.source.name
    print("| gateway | ITL p50 (s) | ITL p99 (s) | ITL max (s) | gaps | refused in (s, median) |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| {label} | {figures['p50']:.3f} | {figures['p99']:.3f} | {figures['max']:.3f} | "
          f"{figures['n']} | {figures['refusal']:.3f} |")


if __name__ == "__main__":
    main()
