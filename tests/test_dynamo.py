"""prefixgate nodes as Dynamo workers (gateway/dynamo/), with real Dynamo 1.6.1 from PyPI: two
nodes as separate processes (each its own pool, one thread), Dynamo's own frontend in front of
them (`python -m dynamo.frontend`, with the KV router and with round-robin), the openai SDK
against the frontend, and Dynamo's own Python KvRouter reading the nodes' KV events. Discovery
through Dynamo's file backend, events over ZMQ (tests/test_dynamo_etcd.py: through a real etcd;
tests/test_dynamo_netns.py: each node in a network namespace of its own)."""

from __future__ import annotations

import asyncio
import os
import urllib.request
from collections.abc import Iterator

import numpy as np
import openai
import pytest

from gateway.workers.model_store import default_model_path
from loadtest.dynamo_cluster import BLOCK, ENDPOINT, answered
from loadtest.gateway_process import GatewayProcess
from tests.dynamo_cluster import Cluster, ask, replay


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("dynamo"))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def model() -> str:
    return default_model_path().stem


def wait_for_both_nodes(cluster: Cluster, client: openai.OpenAI, model: str) -> None:
    """Until round-robin has reached each node (the frontend sees both)."""
    before = [answered(n) for n in cluster.nodes]
    for i in range(20):
        ask(client, model, f"warm-up {i}")
        if all(answered(n) > b for n, b in zip(cluster.nodes, before, strict=True)):
            return
    pytest.fail("the round-robin frontend never reached both nodes")


def test_the_kv_router_sends_each_prefix_to_the_node_holding_it(cluster, model):
    client = cluster.frontend("kv")
    first, second, prompt_tokens = replay(cluster, client, model,
                                          ["astronomy", "gardening", "tax law"])
    assert sum(first) > 3 * 300  # each prompt computed once, somewhere
    # The repeats read their prompts from the node that holds them: at most the last partial
    # block and the question are computed again.
    assert sum(second) < 0.15 * prompt_tokens, (first, second)


def test_round_robin_computes_the_repeats_again(cluster, model):
    client = cluster.frontend("round-robin")
    wait_for_both_nodes(cluster, client, model)
    # Short prompts: round-robin computes each repeat whole, whatever its length.
    first, second, prompt_tokens = replay(cluster, client, model,
                                          ["chemistry", "cooking", "sailing"], rules=6)
    # Three prompts alternating over two nodes: each repeat lands on the other node.
    assert sum(second) > 0.8 * prompt_tokens, (first, second)


def test_a_chat_through_the_frontend_equals_the_nodes_own_answer(cluster, model):
    messages = [{"role": "user", "content": "Name three colours."}]
    through = cluster.frontend("kv").chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0)
    direct = openai.OpenAI(base_url=cluster.nodes[0].base_url + "/v1", api_key="unused"
                           ).chat.completions.create(model=model, messages=messages,
                                                     max_tokens=8, temperature=0)
    assert through.choices[0].message.content == direct.choices[0].message.content
    assert through.usage.prompt_tokens == direct.usage.prompt_tokens
    assert through.choices[0].finish_reason == "length"


# ----- the KV events, through Dynamo's own KvRouter ----------------------------------------


class Router:
    """Dynamo's KvRouter over the nodes, in this process: what it finds, and requests sent
    through it with a cache salt."""

    def __init__(self, cluster: Cluster, model: str) -> None:
        from dynamo.llm import KvRouter, KvRouterConfig
        from dynamo.runtime import DistributedRuntime

        for name in ("DYN_FILE_KV", "ETCD_ENDPOINTS"):  # where the runtime finds the nodes
            if name in cluster.env:
                os.environ[name] = cluster.env[name]
        self.model = model
        self.runtime = DistributedRuntime(asyncio.get_running_loop(),
                                          cluster.env["DYN_DISCOVERY_BACKEND"], "tcp")
        self.router = KvRouter(self.runtime.endpoint(ENDPOINT), BLOCK, KvRouterConfig())

    async def store(self, tokens: list[int], namespace: str | None = None,
                    max_tokens: int = 1) -> None:
        request = {"model": self.model, "token_ids": tokens,
                   "stop_conditions": {"max_tokens": max_tokens, "ignore_eos": True},
                   "sampling_options": {},
                   "output_options": {}, "eos_token_ids": [],
                   "routing": {"cache_salt": namespace} if namespace else {}}
        chunks = [c async for c in await self.router.generate_from_request(request)]
        last = chunks[-1].get("data", chunks[-1])
        assert last["finish_reason"] == "length", chunks
        assert last["completion_usage"]["prompt_tokens"] == len(tokens)

    async def overlap(self, tokens: list[int], namespace: str | None = None,
                      until: bool | None = None) -> int:
        """Blocks of `tokens` on the best node; `until`: waits (a bounded number of looks)
        for the events that make it nonzero (True) or zero (False) to arrive."""
        for _ in range(100):
            _, _, found = await self.router.best_worker(tokens, cache_namespace=namespace)
            if until is None or bool(found) == until:
                break
            await asyncio.sleep(0.1)
        return found

    def close(self) -> None:
        self.runtime.shutdown()


def with_router(cluster: Cluster, model: str, scenario) -> None:
    async def run() -> None:
        router = Router(cluster, model)
        try:
            await scenario(router)
        finally:
            router.close()

    asyncio.run(run())


def random_prompt(seed: int, n: int = 200) -> list[int]:
    return np.random.default_rng(seed).integers(1000, 40000, n).tolist()


def drop_cache(node: GatewayProcess) -> None:
    request = urllib.request.Request(node.base_url + "/v1/cache/prefixes", method="DELETE",
                                     headers={"Authorization": "Bearer admin"})
    urllib.request.urlopen(request, timeout=30).read()


def test_the_router_sees_a_stored_prefix_and_not_after_its_eviction(cluster, model):
    tokens = random_prompt(1)

    async def scenario(router: Router) -> None:
        assert await router.overlap(tokens) == 0
        await router.store(tokens)
        assert await router.overlap(tokens, until=True) >= len(tokens) // BLOCK - 1
        for node in cluster.nodes:
            await asyncio.to_thread(drop_cache, node)
        assert await router.overlap(tokens, until=False) == 0

    with_router(cluster, model, scenario)


def test_tenants_namespaces_are_apart(cluster, model):
    tokens = random_prompt(2)

    async def scenario(router: Router) -> None:
        await router.store(tokens, "team:a")
        assert await router.overlap(tokens, "team:a", until=True) >= len(tokens) // BLOCK - 1
        assert await router.overlap(tokens) == 0
        assert await router.overlap(tokens, "team:b") == 0

    with_router(cluster, model, scenario)


def test_the_router_sees_the_prompt_of_a_request_in_flight(cluster, model):
    """In the default engine mode a prompt joins the pool when its request ends; while it runs,
    a request of its namespace shares its cells: the node publishes them meanwhile."""
    tokens = random_prompt(4)

    async def scenario(router: Router) -> None:
        assert await router.overlap(tokens) == 0
        running = asyncio.create_task(router.store(tokens, max_tokens=1000))
        assert await router.overlap(tokens, until=True) >= len(tokens) // BLOCK - 1
        # Seen while the request still runs, so before any of its blocks was in a pool.
        assert not running.done()
        assert sum(n.metrics()["prefixgate_num_requests_running"] for n in cluster.nodes) == 1
        await running
        # Ended, its blocks are in the pool: the router still sees them.
        assert await router.overlap(tokens) >= len(tokens) // BLOCK - 1

    with_router(cluster, model, scenario)


def test_a_restarted_node_starts_with_its_blocks_cleared(cluster, model):
    tokens = random_prompt(3)

    async def scenario(router: Router) -> None:
        await router.store(tokens)
        assert await router.overlap(tokens, until=True) > 0
        for i, node in enumerate(cluster.nodes):  # one at a time, as a rolling restart
            await asyncio.to_thread(node.stop)
            cluster.nodes[i] = await asyncio.to_thread(cluster.node)
        assert await router.overlap(tokens, until=False) == 0

    with_router(cluster, model, scenario)
