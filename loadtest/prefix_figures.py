"""Figures of the prefix cache, measured side by side in one run on a real gateway.

    python -m loadtest.prefix_figures [--block-sizes 16 32 64 128]

1. A ~1,000-token shared system prompt + short questions: time to first token cold (a new system
   prompt) vs warm (the system prompt cached), and the time spent loading the cached blocks.
2. 10 concurrent sessions sharing that system prompt: the KV bytes their cached state takes in the
   pool, against what 10 unshared copies would take.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import time
import urllib.request
from pathlib import Path

import orjson
from aiohttp import ClientSession

from gateway.model_store import default_model_path
from loadtest.gateway_process import GatewayProcess

PARAGRAPH = ("The archive holds letters, maps and ledgers from the harbour town, sorted by year "
             "and by the family that kept them. Visitors ask about shipping routes, weather "
             "records, trade prices and the people who signed each page. ")


def system_prompt(seed: int) -> str:
    """About 1,000 tokens; `seed` makes it differ from the first token on."""
    return f"Archive {seed} assistant. " + PARAGRAPH * 22


async def ttft(session: ClientSession, base_url: str, model: str, system: str,
               question: str, max_tokens: int = 8) -> tuple[float, dict]:
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "stream_options": {"include_usage": True}, "ignore_eos": True,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}]}
    start, first, usage = time.perf_counter(), None, {}
    async with session.post(base_url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            event = orjson.loads(line[6:])
            if first is None and event["choices"] and event["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - start
            usage = event.get("usage") or usage
    return first, usage


def metrics(base_url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(base_url + "/metrics").read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if not s.labels}


async def ttft_figures(base_url: str, model: str, rounds: int) -> dict:
    cold, warm, prompt_tokens = [], [], 0
    async with ClientSession() as session:
        for r in range(rounds):
            system = system_prompt(r)
            t, usage = await ttft(session, base_url, model, system, "Where are the maps kept?")
            cold.append(t)
            prompt_tokens = usage["prompt_tokens"]
            before = metrics(base_url)
            t, usage = await ttft(session, base_url, model, system, "Who signed the ledgers?")
            after = metrics(base_url)
            warm.append(t)
            assert usage["prompt_tokens_details"]["cached_tokens"] > 900
    load = (after["prefixgate_prefix_cache_load_seconds_total"]
            - before["prefixgate_prefix_cache_load_seconds_total"])
    return {"prompt_tokens": prompt_tokens, "cold": statistics.median(cold),
            "warm": statistics.median(warm), "load": load}


async def sharing_figures(base_url: str, model: str, sessions: int) -> dict:
    system = system_prompt(999)
    async with ClientSession() as session:
        before = metrics(base_url)
        results = await asyncio.gather(*(
            ttft(session, base_url, model, system, f"Question {i}: what about year {1800 + i}?",
                 max_tokens=32) for i in range(sessions)))
    after = metrics(base_url)
    used_blocks = (after["prefixgate_kv_pool_blocks_used"]
                   - before["prefixgate_kv_pool_blocks_used"])
    block_bytes = after["prefixgate_kv_pool_bytes_capacity"] / (
        after["prefixgate_kv_pool_blocks_used"] + after["prefixgate_kv_pool_blocks_free"])
    block_tokens = after["prefixgate_kv_pool_block_tokens"]
    # Unshared: each session's own copy of its KV (prompt and answer), in whole blocks.
    unshared_blocks = sum(math.ceil((u["prompt_tokens"] + u["completion_tokens"] - 1)
                                    / block_tokens) for _, u in results)
    return {"sessions": sessions, "shared_bytes": used_blocks * block_bytes,
            "unshared_bytes": unshared_blocks * block_bytes,
            "cached_prompt_tokens": sum(u["prompt_tokens_details"]["cached_tokens"]
                                        for _, u in results)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[64])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sessions", type=int, default=10)
    args = p.parse_args()
    model_path = args.model or default_model_path()
    print("| block size | prompt tokens | TTFT cold (s) | TTFT warm (s) | warm/cold | "
          "block load (ms) |")
    print("|---:|---:|---:|---:|---:|---:|")
    sharing = None
    for block_size in args.block_sizes:
        server = GatewayProcess(model_path, "--block-size", str(block_size))
        try:
            f = asyncio.run(ttft_figures(server.base_url, server.model_name, args.rounds))
            print(f"| {block_size} | {f['prompt_tokens']} | {f['cold']:.3f} | {f['warm']:.3f} | "
                  f"{f['warm'] / f['cold']:.3f} | {f['load'] * 1000:.1f} |", flush=True)
            if sharing is None:
                sharing = asyncio.run(sharing_figures(server.base_url, server.model_name,
                                                      args.sessions))
        finally:
            server.stop()
    s = sharing
    print(f"\n{s['sessions']} concurrent sessions sharing one system prompt "
          f"(block size {args.block_sizes[0]}), KV held in the pool:")
    print("| shared (MiB) | unshared (MiB) | shared/unshared |")
    print("|---:|---:|---:|")
    print(f"| {s['shared_bytes'] / 2**20:.1f} | {s['unshared_bytes'] / 2**20:.1f} | "
          f"{s['shared_bytes'] / s['unshared_bytes']:.1%} |")


if __name__ == "__main__":
    main()
