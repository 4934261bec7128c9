"""Mixed traffic for a long while: resident memory, pool occupancy and open files stay flat.

    python -m loadtest.soak [--minutes 10] [--clients 6]

Starts a gateway and runs clients in a loop until the time is up: shared-prefix chats, multi-turn
chats that resend their history, unique prompts, streams cut off midway, and malformed bodies.
Every 30 s it samples the gateway and its workers (resident memory summed over the processes,
open file descriptors) and the pool (blocks used, held), and prints the samples as a table, with
the growth from the first sample after warm-up to the last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import time
from pathlib import Path

from aiohttp import ClientSession, ClientTimeout

from gateway.workers.model_store import default_model_path
from loadtest.gateway_process import GatewayProcess

SYSTEMS = [f"You are the assistant of shop number {i}. Be brief and friendly. " * 12
           for i in range(3)]


def processes(server: GatewayProcess) -> list[int]:
    return [server.proc.pid] + [w["pid"] for w in server.health()[1]["workers"]]


def sample(server: GatewayProcess, elapsed: float, requests: int) -> dict:
    rss = fds = 0
    for pid in processes(server):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1]) * 1024
            fds += len(os.listdir(f"/proc/{pid}/fd"))
    m = server.metrics()
    return {"t": elapsed, "requests": requests, "rss": rss, "fds": fds,
            "blocks": m["prefixgate_kv_pool_blocks_used"],
            "held": m["prefixgate_kv_pool_blocks_held"]}


async def client(server: GatewayProcess, seed: int, until: float, counter: list[int]) -> None:
    rng = random.Random(seed)
    url = server.base_url + "/v1/chat/completions"
    async with ClientSession(timeout=ClientTimeout(total=300)) as session:
        history: list[dict] = []
        while time.monotonic() < until:
            kind = rng.choice(["shared", "turn", "unique", "cut", "bad"])
            body = {"model": server.model_name, "max_tokens": rng.randint(4, 24),
                    "temperature": rng.choice([0, 0.8])}
            if kind == "shared":
                body["messages"] = [{"role": "system", "content": rng.choice(SYSTEMS)},
                                    {"role": "user", "content": f"Question {rng.random()}"}]
            elif kind == "turn":
                history = history[-8:] + [{"role": "user", "content": f"And {rng.random()}?"}]
                body["messages"] = history
            elif kind in ("unique", "cut"):
                body["messages"] = [{"role": "user", "content": f"Unique {rng.random()} " * 20}]
                body["stream"] = kind == "cut"
            if kind == "bad":
                async with session.post(url, data=b'{"model": [1, {"x": ') as r:
                    await r.read()
            elif kind == "cut":
                async with session.post(url, json=body) as r:
                    await r.content.readline()  # and go away
            else:
                async with session.post(url, json=body) as r:
                    answer = await r.json()
                if kind == "turn" and r.status == 200:
                    history.append({"role": "assistant",
                                    "content": answer["choices"][0]["message"]["content"]})
            counter[0] += 1


async def soak(server: GatewayProcess, minutes: float, clients: int) -> list[dict]:
    start = time.monotonic()
    until = start + minutes * 60
    counter = [0]
    tasks = [asyncio.create_task(client(server, seed, until, counter))
             for seed in range(clients)]
    samples = []
    while time.monotonic() < until:
        await asyncio.sleep(30)
        samples.append(await asyncio.to_thread(sample, server, time.monotonic() - start,
                                               counter[0]))
        print(samples[-1], flush=True)
    await asyncio.gather(*tasks)
    return samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--clients", type=int, default=6)
    args = p.parse_args()
    server = GatewayProcess(default_model_path(), "--parallel", "4", "--ctx-size", "8192",
                            "--cache-mb", "64")
    try:
        samples = asyncio.run(soak(server, args.minutes, args.clients))
        server.settled(timeout=60)
        consistent = server.consistency()["ok"]
    finally:
        server.stop()
    print("\n| minute | requests | resident memory (MiB) | open files | pool blocks used | "
          "held |")
    print("|---:|---:|---:|---:|---:|---:|")
    for s in samples:
        print(f"| {s['t'] / 60:.1f} | {s['requests']} | {s['rss'] / 2**20:.0f} | {s['fds']} "
              f"| {s['blocks']:.0f} | {s['held']:.0f} |")
    warm, last = samples[min(1, len(samples) - 1)], samples[-1]
    print(f"\nfrom minute {warm['t'] / 60:.1f} to {last['t'] / 60:.1f}: resident memory "
          f"{(last['rss'] - warm['rss']) / 2**20:+.1f} MiB, open files "
          f"{last['fds'] - warm['fds']:+d}; consistency check after: "
          f"{'ok' if consistent else 'FAILED'}")


if __name__ == "__main__":
    main()
