"""Time to first token and output tokens/s for N concurrent streamed chat requests.

    python -m loadtest.latency --base-url http://127.0.0.1:8000 --concurrency 1 8

Each request streams a fixed number of tokens (ignore_eos), so runs are comparable."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import orjson
from aiohttp import ClientSession

QUESTIONS = ["Tell me about the ocean.", "Describe a forest at night.", "Explain gravity.",
             "Write about a city in winter.", "What makes a good friend?",
             "Describe the taste of coffee.", "How do birds fly?", "Tell a story about a robot."]


async def one_request(session: ClientSession, url: str, model: str, question: str,
                      max_tokens: int) -> tuple[float, float, int]:
    """Returns (time to first token, total time, output tokens)."""
    body = {"model": model, "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, tokens = None, 0
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            if event["choices"] and event["choices"][0]["delta"].get("content") and ttft is None:
                ttft = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return ttft, time.perf_counter() - start, tokens


async def run(base_url: str, concurrency: int, max_tokens: int) -> dict:
    async with ClientSession() as session:
        async with session.get(base_url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        await one_request(session, base_url, model, "Warm up.", 4)
        start = time.perf_counter()
        results = await asyncio.gather(*(
            one_request(session, base_url, model, QUESTIONS[i % len(QUESTIONS)], max_tokens)
            for i in range(concurrency)))
        wall = time.perf_counter() - start
    ttfts = [r[0] for r in results]
    per_request = [(r[2] - 1) / (r[1] - r[0]) for r in results]
    total_tokens = sum(r[2] for r in results)
    assert all(r[2] == max_tokens for r in results), "a request returned the wrong length"
    return {"concurrency": concurrency, "ttft_p50_s": statistics.median(ttfts),
            "ttft_max_s": max(ttfts), "per_request_tok_s": statistics.median(per_request),
            "aggregate_tok_s": total_tokens / wall}


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
