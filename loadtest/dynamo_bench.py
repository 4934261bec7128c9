"""Scale-out over three machines' worth of prefixgate, side by side (issue 52's benchmark).

    python -m loadtest.dynamo_bench [--models A.gguf B.gguf] [--sessions 12] [--turns 4]

For each model, one seeded workload (several system prompts, each used by both of two tenants;
multi-turn sessions on them, interleaved at random) runs, request after request, through:

  one node        one prefixgate with all the memory (three nodes' pools): the baseline
  (a) front + kv  prefixgate's front (--dynamo-front) with Dynamo's KV router, three nodes
  (b) dynamo kv   Dynamo's own frontend (--router-mode kv), three nodes
  (c) dynamo rr   Dynamo's own frontend in round-robin, three nodes
  (d) replicas    three plain prefixgate gateways sharing the Redis tier, round-robin

Every node or replica is a process of its own with its own pool, `--threads 1`. (a)'s nodes and
(d)'s replicas share one Redis tier (flushed before each), so their bytes through Redis compare;
(b) and (c) run Dynamo as its users do, without it. Tenants are API keys on prefixgate's servers
and the body's `cache_salt` through Dynamo's frontend, which hands it to the nodes as the
request's cache salt (their tenant namespace). Each session's answers are scripted, not the
model's, so the prompts are the same in every configuration whatever the model answers.

Printed per model: prompt tokens (the clients' usage), prompt tokens computed (the sum of the
engines' `prefixgate_prompt_tokens_computed`), the share read from a cache, the bytes Redis
received and sent (its INFO `total_net_input_bytes` / `total_net_output_bytes`: the nodes'
writes of every block they store, and their reads on a local miss), TTFT p50/p99 at the client,
and the issue's targets. Requests go one at a time, so the token counts do not depend on timing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import redis
from aiohttp import ClientSession, ClientTimeout

from engine.llama import Model, model_shape
from gateway.workers.model_store import DEFAULT_MODEL, GEMMA3_270M, model_path
from loadtest.client import stream_chat
from loadtest.dynamo_cluster import NODE_ARGS, Cluster, computed
from loadtest.gateway_process import GatewayProcess, redis_server
from loadtest.stats import RequestRecord, percentiles
from loadtest.workloads import TextMaker

TENANTS = {"tenant-a": "key-a", "tenant-b": "key-b"}
REDIS_KEY = "bench-secret"
# A node's engine as a plain gateway's, so that only what is in front of them differs.
ENGINE_ARGS = tuple(a for a in NODE_ARGS if a != "--dynamo")
NODES = 3


@dataclass(frozen=True)
class Sizes:
    systems: int = 3  # system prompts, each used by both tenants: six prefixes
    sessions: int = 12
    turns: int = 4
    system_tokens: int = 800
    turn_tokens: int = 30  # each user message, and each scripted answer
    max_tokens: int = 4  # generated per request (the answer kept is the script's)
    # Each node's pool: about half the workload's distinct tokens (~8,000), and less than the
    # six system prompts, so that a node which sees every session (round-robin) evicts while
    # one that sees a third of them (KV routing) need not. The one node has three times it.
    pool_tokens: int = 4096
    seed: int = 52


@dataclass(frozen=True)
class Turn:
    session: int
    tenant: str
    messages: tuple[dict, ...]  # the whole history, this turn's user message last


def workload(model: Model, sizes: Sizes) -> list[Turn]:
    """Every session's turns, the sessions interleaved in a seeded random order: a round-robin
    sends a session's next turn to any node, not the one that served its last."""
    maker = TextMaker(model, sizes.seed)
    systems = [maker.text(sizes.system_tokens) for _ in range(sizes.systems)]
    histories: list[list[dict]] = []
    for s in range(sizes.sessions):
        # Tenants alternate and each takes every system prompt: the same text in two namespaces.
        history = [{"role": "system", "content": systems[s // 2 % sizes.systems]}]
        for _ in range(sizes.turns):
            history += [{"role": "user", "content": maker.text(sizes.turn_tokens)},
                        {"role": "assistant", "content": maker.text(sizes.turn_tokens)}]
        histories.append(history)
    order = maker.rng.permutation(np.repeat(np.arange(sizes.sessions), sizes.turns))
    done = [0] * sizes.sessions
    turns = []
    for s in order.tolist():
        done[s] += 1
        turns.append(Turn(s, list(TENANTS)[s % 2], tuple(histories[s][: 2 * done[s]])))
    return turns


# ----- the configurations ---------------------------------------------------------------------


@dataclass
class Target:
    """Where a configuration's requests go and which engines count them."""

    urls: list[str]  # request i goes to urls[i % len(urls)]: (d)'s round-robin
    engines: list[GatewayProcess]
    salted: bool = False  # tenants as the body's cache_salt (Dynamo's frontend), not API keys
    redis: redis.Redis | None = None  # the tier its engines share


@dataclass
class Setup:
    """What one model's configurations are started with."""

    model: Path
    pool_mb: int
    tmp: Path
    redis_url: str

    def __post_init__(self) -> None:
        path = self.tmp / "keys"
        path.write_text("".join(f"{key} {tenant}\n" for tenant, key in TENANTS.items()))
        self.keys = ("--api-keys-file", str(path))  # the tenants of prefixgate's servers

    def pool(self, nodes: int = 1) -> tuple[str, ...]:
        return ("--cache-mb", str(nodes * self.pool_mb))

    def tier(self) -> tuple[tuple[str, ...], redis.Redis]:
        """The shared Redis tier, emptied."""
        client = redis.Redis.from_url(self.redis_url)
        client.flushall()
        return ("--redis-url", self.redis_url, "--redis-key", REDIS_KEY), client

    def cluster(self, name: str, *node_args: str) -> Cluster:
        return Cluster(Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.tmp)), model=self.model,
                       nodes=NODES, node_args=(*self.pool(), *node_args))


@contextlib.contextmanager
def one_node(setup: Setup) -> Iterator[Target]:
    server = GatewayProcess(setup.model, *ENGINE_ARGS, *setup.pool(NODES), *setup.keys)
    try:
        yield Target([server.base_url], [server])
    finally:
        server.stop()


@contextlib.contextmanager
def prefixgate_front(setup: Setup) -> Iterator[Target]:
    tier, client = setup.tier()
    cluster = setup.cluster("front", *tier)
    try:
        front = cluster.front(*setup.keys)
        yield Target([front.base_url], cluster.nodes, redis=client)
    finally:
        cluster.stop()


@contextlib.contextmanager
def dynamo_frontend(setup: Setup, mode: str) -> Iterator[Target]:
    cluster = setup.cluster(mode)
    try:
        yield Target([cluster.frontend_url(mode)], cluster.nodes, salted=True)
    finally:
        cluster.stop()


@contextlib.contextmanager
def replicas(setup: Setup) -> Iterator[Target]:
    tier, client = setup.tier()
    servers: list[GatewayProcess] = []
    try:
        for _ in range(NODES):
            servers.append(GatewayProcess(setup.model, *ENGINE_ARGS, *setup.pool(), *setup.keys,
                                          *tier))
        yield Target([s.base_url for s in servers], servers, redis=client)
    finally:
        for server in servers:
            server.stop()


CONFIGURATIONS = {
    "one node (all the memory)": one_node,
    "(a) prefixgate front, KV router": prefixgate_front,
    "(b) Dynamo frontend, KV router": lambda setup: dynamo_frontend(setup, "kv"),
    "(c) Dynamo frontend, round-robin": lambda setup: dynamo_frontend(setup, "round-robin"),
    "(d) 3 replicas + Redis, round-robin": replicas,
}


# ----- one run --------------------------------------------------------------------------------


@dataclass
class Measured:
    name: str
    records: list[RequestRecord] = field(default_factory=list)
    per_engine: list[float] = field(default_factory=list)  # prompt tokens each computed
    redis_in: int | None = None  # bytes Redis received (the blocks written) and sent (read)
    redis_out: int | None = None
    seconds: float = 0.0

    @property
    def computed(self) -> float:
        return sum(self.per_engine)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.records)

    @property
    def redis_bytes(self) -> int | None:
        return None if self.redis_in is None else self.redis_in + (self.redis_out or 0)

    def ttft(self, q: int) -> float:
        return percentiles([r.ttft for r in self.records if r.ok])[f"p{q}"] or math.nan

    @property
    def failed(self) -> int:
        return sum(not r.ok for r in self.records)


def measure(name: str, target: Target, turns: list[Turn], model_name: str,
            sizes: Sizes) -> Measured:
    result = Measured(name)
    before = [computed(e) for e in target.engines]
    traffic = redis_traffic(target.redis)
    start = time.perf_counter()
    result.records = asyncio.run(drive(target, turns, model_name, sizes.max_tokens))
    result.seconds = time.perf_counter() - start
    for engine in target.engines:
        engine.wait_idle()
    result.per_engine = [computed(e) - b for e, b in zip(target.engines, before, strict=True)]
    if target.redis is not None:
        after = settled_traffic(target.redis)
        result.redis_in, result.redis_out = after[0] - traffic[0], after[1] - traffic[1]
    return result


async def drive(target: Target, turns: list[Turn], model_name: str,
                max_tokens: int) -> list[RequestRecord]:
    """The turns one after another, streamed, each tenant on a client session of its own."""
    async with contextlib.AsyncExitStack() as stack:
        sessions = {tenant: await stack.enter_async_context(ClientSession(
            timeout=ClientTimeout(total=600),
            headers={} if target.salted else {"Authorization": f"Bearer {key}"}))
            for tenant, key in TENANTS.items()}
        records = []
        for i, turn in enumerate(turns):
            extra: dict = {"ignore_eos": True}
            if target.salted:  # (not prefixgate's own `tenant:` namespaces: a node refuses those)
                extra["cache_salt"] = turn.tenant
            record, _ = await stream_chat(sessions[turn.tenant], target.urls[i % len(target.urls)],
                                          model_name, list(turn.messages), max_tokens, extra)
            records.append(record)
    return records


def redis_traffic(client: redis.Redis | None) -> tuple[int, int]:
    if client is None:
        return 0, 0
    stats = client.info("stats")
    return stats["total_net_input_bytes"], stats["total_net_output_bytes"]


def settled_traffic(client: redis.Redis, quiet: float = 1.0,
                    timeout: float = 60) -> tuple[int, int]:
    """Redis's traffic once the engines' writes have landed: a block is written from a queue
    after its request ends, so wait until a second passes with nothing more received."""
    deadline = time.monotonic() + timeout
    last = redis_traffic(client)
    while time.monotonic() < deadline:
        time.sleep(quiet)
        now = redis_traffic(client)
        if now[0] - last[0] < 1024:  # INFO's own request and answer aside
            return now
        last = now
    return last


def pool_mb(model: Path, tokens: int) -> int:
    """The --cache-mb that holds `tokens` tokens of the model's KV (F16)."""
    shape = model_shape(str(model), 1, "f16")
    return math.ceil(tokens * shape.kv_bytes_per_layer * shape.n_layer / 2**20)


def run_model(model_path: Path, sizes: Sizes, names: list[str], tmp: Path,
              redis_url: str) -> list[Measured]:
    model = Model(str(model_path), vocab_only=True)
    try:
        turns = workload(model, sizes)
    finally:
        model.close()
    setup = Setup(model_path, pool_mb(model_path, sizes.pool_tokens), tmp, redis_url)
    results = []
    for name in names:
        print(f"{model_path.stem}: {name} ...", flush=True)
        with CONFIGURATIONS[name](setup) as target:
            results.append(measure(name, target, turns, model_path.stem, sizes))
        r = results[-1]
        print(f"  {r.computed:.0f} of {r.prompt_tokens} prompt tokens computed "
              f"({' + '.join(f'{n:.0f}' for n in r.per_engine)}), TTFT p50 "
              f"{r.ttft(50):.3f} s, {r.failed} failed, {r.seconds:.0f} s", flush=True)
    return results


# ----- the report -----------------------------------------------------------------------------


def table(model: Path, sizes: Sizes, results: list[Measured]) -> str:
    base = results[0].computed if results and results[0].name.startswith("one node") else None

    def mib(n: int | None) -> str:
        return "-" if n is None else f"{n / 2**20:,.1f}"

    lines = [f"### {model.stem}\n",
             f"{len(results[0].records)} requests: {sizes.sessions} sessions of {sizes.turns} "
             f"turns on {sizes.systems} system prompts x 2 tenants; pools of "
             f"{sizes.pool_tokens:,} tokens a node ({NODES * sizes.pool_tokens:,} the one node).\n",
             "| configuration | prompt tokens | computed | x one node | read from cache | "
             "Redis in (MiB) | Redis out (MiB) | TTFT p50 (s) | TTFT p99 (s) | failed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        ratio = f"{r.computed / base:.2f}x" if base else "-"
        cached = 1 - r.computed / r.prompt_tokens if r.prompt_tokens else math.nan
        lines.append(f"| {r.name} | {r.prompt_tokens:,} | {r.computed:,.0f} | {ratio} | "
                     f"{cached:.1%} | {mib(r.redis_in)} | {mib(r.redis_out)} | "
                     f"{r.ttft(50):.3f} | {r.ttft(99):.3f} | {r.failed} |")
    return "\n".join(lines + ["", *verdicts(results, base)])


def verdicts(results: list[Measured], base: float | None) -> list[str]:
    """The issue's targets, each met or missed and by what ratio."""
    by = {r.name[:3]: r for r in results}

    def line(what: str, ratio: float, limit: float) -> str:
        verdict = "met" if ratio <= limit else "MISSED"
        return f"- {what}: {ratio:.2f}x (target <= {limit}x): {verdict}"

    out = []
    for key in ("(a)", "(b)"):
        if key in by and base:
            out.append(line(f"{key} prompt tokens computed / one node's",
                            by[key].computed / base, 1.15))
        if key in by and "(c)" in by:
            out.append(line(f"{key} TTFT p50 / (c)'s", by[key].ttft(50) / by["(c)"].ttft(50),
                            0.5))
    if "(a)" in by and "(d)" in by and by["(d)"].redis_bytes:
        a, d = by["(a)"], by["(d)"]
        out.append(line("(a) bytes through Redis / (d)'s", a.redis_bytes / d.redis_bytes, 0.1))
        if d.redis_out:
            out.append(f"- of which read (Redis out): (a) / (d) = {a.redis_out / d.redis_out:.2f}x")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", type=Path, default=None,
                   help="GGUF files (default: SmolLM2 135M and Gemma 3 270M, fetched if missing)")
    p.add_argument("--configurations", nargs="+", default=list(CONFIGURATIONS),
                   choices=list(CONFIGURATIONS), metavar="NAME")
    defaults = Sizes()
    for name in ("systems", "sessions", "turns", "system_tokens", "turn_tokens",
                 "pool_tokens", "seed"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    args = p.parse_args()
    sizes = Sizes(**{k: getattr(args, k) for k in ("systems", "sessions", "turns",
                                                    "system_tokens", "turn_tokens",
                                                    "pool_tokens", "seed")})
    tables = []
    with tempfile.TemporaryDirectory(prefix="dynamo-bench-") as tmp, redis_server() as (url, _):
        for model in args.models or [model_path(DEFAULT_MODEL), model_path(GEMMA3_270M)]:
            results = run_model(model, sizes, args.configurations, Path(tmp), url)
            tables.append(table(model, sizes, results))
            print("\n" + tables[-1] + "\n", flush=True)
    print("\n\n".join(tables))


if __name__ == "__main__":
    main()
