"""A ~1,000-token prefix loaded from Redis against computing it, and what Redis holds per token.

    python -m loadtest.redis_tier

Starts a redis-server on a loopback port and two gateways that share nothing but it. The first
computes a ~1,000-token system prompt (cold); once its blocks are in Redis, the second, whose
pool is empty, gets the same prompt with another question: its time to first token is Redis's
round trip, adopting the blocks into its pool and loading them. A second question on the second
gateway shows a local pool hit for comparison. Printed: TTFT of each, and the bytes Redis holds
per cached token (its values' lengths over their tokens).
"""

from __future__ import annotations

import asyncio

import redis
from aiohttp import ClientSession

from gateway.workers.model_store import default_model_path
from loadtest.gateway_process import GatewayProcess, redis_server
from loadtest.prefix_figures import ask, system_prompt


def main() -> None:
    with redis_server() as (url, _):
        rows, keys, value_bytes, tokens = measure(url)
    print("\nA ~1,000-token system prompt and a question, on two gateways sharing only Redis\n")
    print("| prompt | TTFT (s) | cached tokens |")
    print("|---|---:|---:|")
    for label, ttft, cached in rows:
        print(f"| {label} | {ttft:.3f} | {cached} |")
    print(f"\nRedis holds {keys} blocks, {value_bytes / 2**20:.1f} MiB for {tokens} tokens: "
          f"{value_bytes / tokens / 1024:.1f} KiB per cached token")


def measure(url: str) -> tuple[list[tuple[str, float, int]], int, int, int]:
    """The three TTFTs, then the blocks Redis holds, their bytes and their tokens."""
    client = redis.Redis.from_url(url)
    model = default_model_path()
    gateways = [GatewayProcess(model, "--redis-url", url) for _ in range(2)]
    system = system_prompt(11)
    try:
        async def run() -> list[tuple[str, float, int]]:
            async with ClientSession() as session:
                cold = await ask(session, gateways[0], system, "First question?")
                while not client.dbsize() or _pending(gateways[0]):
                    await asyncio.sleep(0.1)
                remote = await ask(session, gateways[1], system, "Second question?")
                local = await ask(session, gateways[1], system, "Third question?")
            return [("computed (first gateway, cold)", cold.ttft, cold.cached_tokens),
                    ("loaded from Redis (second gateway)", remote.ttft, remote.cached_tokens),
                    ("loaded from its own pool (second gateway again)", local.ttft,
                     local.cached_tokens)]

        rows = asyncio.run(run())
        keys = client.keys("prefixgate:*")
        value_bytes = sum(client.strlen(k) for k in keys)
        tokens = sum(int.from_bytes(client.getrange(k, 8, 11), "little") for k in keys)
    finally:
        for gateway in gateways:
            gateway.stop()
    return rows, len(keys), value_bytes, tokens


def _pending(gateway: GatewayProcess) -> bool:
    """True until the first gateway's queued writes have all reached Redis."""
    stored = {s.labels.get("tier"): s.value for s in gateway._samples()
              if s.name == "prefixgate_prefix_cache_tier_stores_total"}
    blocks = gateway.metrics()["prefixgate_kv_pool_blocks_used"]
    return stored.get("redis", 0) < blocks


if __name__ == "__main__":
    main()
