"""How long storing finished requests' KV stalls the gateway's event loop, and the streams
running beside it.

    python -m loadtest.store_stall [--source DIR] [--no-redis] [--gateway-args ...]

With a Redis tier and a key (a redis-server started on a loopback port), as the worst case:
every stored block is copied and signed for Redis. The gateway has room for 2 requests
(`--parallel 2 --max-queue 0`; 1 with `--streams 0`): a stream generates while a request with a
new ~4,000-token
prompt (STORES of them, one after another) computes it, answers 2 tokens and finishes: its ~64
blocks (1.4 MiB each) are stored meanwhile. All along, requests arrive one after another (10 ms
apart) and are refused (429) once routed: each one consults the cache index, none takes the
engine's time.
The gateway runs with a probe on its event loop (loadtest/probe/prefixgate_loop_probe.py): a
task that wakes every 2 ms and notes how late it woke. Printed: the worst lateness while the
prompts are stored (from the first one's arrival to 2 s after the last one's end), how many
wake-ups were 10 and 20 ms late or more, the requests routed meanwhile, the inter-token latency
of the stream in that window (p50, p99, max) and the engine's store time per request where it
reports one. `--source` runs the gateway from another checkout (e.g. a `git worktree` of an older
commit), for before/after figures; on a machine others share, figures move with its load: run
both back to back.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import tempfile
import time
from pathlib import Path

import numpy as np
from aiohttp import ClientSession, ClientTimeout

from gateway.workers.model_store import default_model_path
from loadtest.client import stream_chat
from loadtest.gateway_process import ROOT, GatewayProcess, redis_server
from loadtest.prefix_figures import system_prompt

STREAMS = 1
ARRIVAL_GAP = 0.01  # seconds between one refusal and the next request
STREAM_TOKENS = 4000  # more than the window lasts: they are cut at its end
STORES = 1
PROBE = ROOT / "loadtest" / "probe"
STALL = 0.020  # seconds: a wake-up this late counts as a stall
AFTER = 2.0  # seconds after the last store's answer still in the window (the tier's writes)


def long_prompt(seed: int) -> str:
    """About 4,000 tokens, new from its first token on."""
    return "".join(system_prompt(seed * 10 + part) for part in range(4))


async def measure(server: GatewayProcess, model: str, n_streams: int) -> dict:
    async with ClientSession(timeout=ClientTimeout(total=None)) as session:
        async def chat(messages: list[dict], max_tokens: int):
            return (await stream_chat(session, server.base_url, model, messages, max_tokens,
                                      {"ignore_eos": True}))[0]

        async def stream(i: int, times: list[float]) -> None:
            """A story, its chunks' times noted, until cancelled."""
            async with session.post(server.base_url + "/v1/chat/completions", json={
                    "model": model, "max_tokens": STREAM_TOKENS, "stream": True,
                    "ignore_eos": True, "temperature": 0,
                    "messages": [{"role": "user",
                                  "content": f"Tell a long story about ship {i}."}]}) as r:
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        times.append(time.perf_counter())

        storing = True

        async def arrivals() -> int:
            """Requests one after another, each routed (the cache index consulted), then
            refused: the server has room for the stream and the long prompt only."""
            n = 0
            while storing:
                async with session.post(server.base_url + "/v1/chat/completions", json={
                        "model": model, "max_tokens": 1, "messages": [
                            {"role": "user", "content": f"Ship {n}: which berth?"}]}) as r:
                    await r.read()
                    n += r.status == 429
                await asyncio.sleep(ARRIVAL_GAP)
            return n

        await chat([{"role": "user", "content": "Warm up."}], 4)
        chunk_times: list[list[float]] = [[] for _ in range(n_streams)]
        streams = [asyncio.create_task(stream(i, chunk_times[i])) for i in range(n_streams)]
        await asyncio.sleep(1.0)  # the streams are generating
        start = time.perf_counter()  # the clock of the chunk times and the probe's
        for i in range(STORES):
            storing_one = asyncio.create_task(chat([
                {"role": "system", "content": long_prompt(i)},
                {"role": "user", "content": "Who kept the ledgers?"}], 2))
            if i == 0:
                await asyncio.sleep(1.0)  # routed: the rest of the room is taken
                arriving = asyncio.create_task(arrivals())
            record = await storing_one
            assert record.ok, record.error
            assert record.prompt_tokens > 3500, record.prompt_tokens
        await asyncio.sleep(AFTER)
        window = (start, time.perf_counter())
        storing = False
        n_arrivals = await arriving
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    gaps = [b - a for times in chunk_times for a, b in itertools.pairwise(times)
            if window[0] <= a and b <= window[1]] or [float("nan")]
    return {"p50": float(np.percentile(gaps, 50)), "p99": float(np.percentile(gaps, 99)),
            "max": max(gaps), "n": len(gaps), "window": window, "arrivals": n_arrivals}


def stalls(path: Path, window: tuple[float, float]) -> list[float]:
    """The probe's late wake-ups inside the window, in seconds."""
    lines = path.read_text().split("\n") if path.exists() else []
    return [late for at, late in (map(float, line.split()) for line in lines if line)
            if window[0] <= at - late and at <= window[1]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", type=Path, default=ROOT, help="checkout to run the gateway from")
    p.add_argument("--label", default=None)
    p.add_argument("--no-redis", action="store_true", help="without the Redis tier")
    p.add_argument("--streams", type=int, default=STREAMS,
                   help="streams beside the long prompt (0: it computes alone, sooner)")
    p.add_argument("--gateway-args", nargs=argparse.REMAINDER, default=[])
    args = p.parse_args()
    model = default_model_path()
    with contextlib.ExitStack() as stack:
        tier = () if args.no_redis else (
            "--redis-url", stack.enter_context(redis_server())[0], "--redis-key", "stall-secret")
        probe = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "late"
        # No request timeout: on a busy machine the long prompt's prefill, beside the stream,
        # may take minutes.
        server = GatewayProcess(model, *tier, "--parallel", str(1 + args.streams),
                                "--max-queue", "0",
                                "--request-timeout", "0", *args.gateway_args,
                                source=args.source,
                                module="prefixgate_loop_probe",
                                env={"PYTHONPATH": str(PROBE),
                                     "PREFIXGATE_LOOP_PROBE": str(probe)})
        try:
            figures = asyncio.run(measure(server, server.model_name, args.streams))
            metrics = server.metrics()
        finally:
            server.stop()
        late = stalls(probe, figures["window"])
    stores = metrics.get("prefixgate_prefix_cache_stores_total")
    store_time = metrics.get("prefixgate_prefix_cache_store_seconds_total")
    per_store = f"{store_time / stores * 1000:.1f}" if stores else "-"
    label = args.label or " ".join([args.source.name, *args.gateway_args,
                                    "(no Redis)" if args.no_redis else "(Redis, key)"])
    worst = max(late, default=0.0)
    print("| gateway | worst event-loop stall (ms) | wake-ups >= 10 / 20 ms late | requests "
          "routed meanwhile | ITL p50 (s) | ITL p99 (s) | ITL max (s) | gaps | store (ms each) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {label.strip()} | {worst * 1000:.1f} | {sum(s >= STALL / 2 for s in late)} / "
          f"{sum(s >= STALL for s in late)} | "
          f"{figures['arrivals']} | {figures['p50']:.3f} | {figures['p99']:.3f} | "
          f"{figures['max']:.3f} | {figures['n']} | {per_store} |")


if __name__ == "__main__":
    main()
