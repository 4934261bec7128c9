"""Time to first token and output tokens/s for N concurrent streamed chat requests.

    python -m loadtest.latency --base-url http://127.0.0.1:8000 --concurrency 1 8

Each request streams a fixed number of tokens (ignore_eos), so runs are comparable."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from aiohttp import ClientSession

from loadtest.client import stream_chat
from loadtest.stats import RequestRecord

QUESTIONS = ["Tell me about the ocean.", "Describe a forest at night.", "Explain gravity.",
             "Write about a city in winter.", "What makes a good friend?",
             "Describe the taste of coffee.", "How do birds fly?", "Tell a story about a robot."]


async def run(base_url: str, concurrency: int, max_tokens: int) -> dict:
    async with ClientSession() as session:
        async with session.get(base_url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]

        async def ask(question: str, n: int) -> RequestRecord:
            messages = [{"role": "user", "content": question}]
            return (await stream_chat(session, base_url, model, messages, n,
                                      {"ignore_eos": True}))[0]

        await ask("Warm up.", 4)
        start = time.perf_counter()
        records = await asyncio.gather(*(ask(QUESTIONS[i % len(QUESTIONS)], max_tokens)
                                         for i in range(concurrency)))
        wall = time.perf_counter() - start
    failed = [r.error for r in records if not r.ok]
    assert not failed, f"failed requests: {failed}"
    return {"concurrency": concurrency,
            "ttft_p50_s": statistics.median(r.ttft for r in records),
            "ttft_max_s": max(r.ttft for r in records),
            "per_request_tok_s": statistics.median(1 / r.tpot for r in records),
            "aggregate_tok_s": sum(r.output_tokens for r in records) / wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    print("| concurrency | TTFT p50 (s) | TTFT max (s) | tok/s per request | tok/s aggregate |")
    print("|---:|---:|---:|---:|---:|")
    for n in args.concurrency:
        r = asyncio.run(run(args.base_url, n, args.max_tokens))
        print(f"| {n} | {r['ttft_p50_s']:.3f} | {r['ttft_max_s']:.3f} | "
              f"{r['per_request_tok_s']:.1f} | {r['aggregate_tok_s']:.1f} |")


if __name__ == "__main__":
    main()
