"""prefixgate nodes found through a real etcd (Debian's etcd-server, on a free loopback port with
its own data directory) by Dynamo's own frontend with the KV router, and the faults of a node
(issue 52, step 4): stopped with SIGTERM it leaves etcd before it exits; killed with SIGKILL its
streams end with an error at once, its registration leaves with its short lease and the frontend
then routes everything to the others; restarted, the router holds none of the old instance's
blocks; busy with long streams, it holds up no other node's requests."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator

import openai
import pytest

from gateway.dynamo.node import LEASE_SECONDS
from gateway.workers.model_store import default_model_path
from loadtest.dynamo_cluster import answered, computed, instance
from tests.dynamo_cluster import Cluster, ask, replay, system_prompt
from tests.etcd_server import Etcd
from tests.test_dynamo import Router, random_prompt, with_router

MODEL = default_model_path().stem
INSTANCES = "v1/instances/dynamo/prefixgate/generate/"  # the etcd keys of the endpoint's nodes


@pytest.fixture(scope="module")
def etcd(tmp_path_factory) -> Iterator[Etcd]:
    server = Etcd(tmp_path_factory.mktemp("etcd") / "data")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, etcd) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("dynamo-etcd"),
                      {"DYN_DISCOVERY_BACKEND": "etcd", "ETCD_ENDPOINTS": etcd.base_url})
    yield cluster
    cluster.stop()


def listed(etcd: Etcd) -> set[int]:
    """The instances etcd lists for the endpoint."""
    return {int(key.rsplit("/", 1)[1], 16) for key in etcd.keys(INSTANCES)}


def wait_for(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.1)


def holder(cluster: Cluster, client: openai.OpenAI, system: str) -> int:
    """Sends `system` once: the index of the node that computed it."""
    before = [computed(n) for n in cluster.nodes]
    ask(client, MODEL, system)
    grown = [computed(n) - b for n, b in zip(cluster.nodes, before, strict=True)]
    return grown.index(max(grown))


def test_the_nodes_are_found_through_etcd_and_routed_to_by_prefix(cluster, etcd):
    assert listed(etcd) == {instance(n) for n in cluster.nodes}
    # Each node's registration lives on a lease as short as the node asks for.
    assert set(etcd.lease_ttls()) >= {LEASE_SECONDS}
    first, second, prompt_tokens = replay(cluster, cluster.frontend("kv"), MODEL,
                                          ["geology", "knitting"])
    assert sum(first) > 2 * 300
    assert sum(second) < 0.15 * prompt_tokens, (first, second)


def test_a_node_stopped_with_sigterm_leaves_etcd_before_it_exits(cluster, etcd):
    # A lease far longer than the node takes to stop: only its deregistering removes it.
    node = cluster.node(env={"ETCD_LEASE_TTL": "600"})
    try:
        leaving = instance(node)
        assert leaving in listed(etcd)
        client = cluster.frontend("kv")
        node.proc.send_signal(signal.SIGTERM)
        node.proc.wait(timeout=120)
        assert leaving not in listed(etcd)
        # The frontend routes nothing more to it: every request is answered by the others.
        before = sum(answered(n) for n in cluster.nodes)
        for i in range(4):
            ask(client, MODEL, f"You answer questions on topic {i}.")
        assert sum(answered(n) for n in cluster.nodes) == before + 4
    finally:
        node.stop()


def test_a_killed_node_ends_its_streams_and_leaves_the_routing(cluster, etcd):
    client = cluster.frontend("kv")
    system = system_prompt("volcanoes")
    victim = holder(cluster, client, system)
    dead, survivor = cluster.nodes[victim], cluster.nodes[1 - victim]
    ended: list[BaseException | None] = []
    streaming = threading.Event()

    def long_stream() -> None:  # on the victim: the KV router sends the prefix to its holder
        try:
            stream = client.chat.completions.create(
                model=MODEL, max_tokens=2000, temperature=0, stream=True, timeout=600,
                extra_body={"ignore_eos": True},
                messages=[{"role": "system", "content": system},
                          {"role": "user", "content": "Tell a long story."}])
            for _ in stream:
                streaming.set()
            ended.append(None)
        except Exception as exc:  # noqa: BLE001 - what the client heard is the assertion
            ended.append(exc)
        streaming.set()

    thread = threading.Thread(target=long_stream)
    thread.start()
    assert streaming.wait(300)
    assert dead.metrics()["prefixgate_num_requests_running"] == 1, "routed elsewhere"
    survivor_id = instance(survivor)
    dead.proc.send_signal(signal.SIGKILL)
    dead.proc.wait()
    thread.join(300)
    assert not thread.is_alive(), "a stream on the killed node hangs"
    assert isinstance(ended[0], openai.APIError), ended  # an error, not a clean finish
    # Its lease runs out: etcd stops listing it, and then the frontend sends everything,
    # the killed node's prefix included, to the survivor.
    wait_for(lambda: listed(etcd) == {survivor_id}, "etcd drops the killed node")
    before = answered(survivor)
    for i in range(4):
        ask(client, MODEL, system, f"Question {i}?")
    assert answered(survivor) == before + 4
    cluster.nodes[victim] = cluster.node()


def test_a_node_restarted_after_a_kill_has_no_blocks_in_the_router(cluster, etcd):
    tokens = random_prompt(11)

    async def scenario(router: Router) -> None:
        await router.store(tokens)
        worker, _, found = await router.router.best_worker(tokens)
        assert found > 0
        victim = next(i for i, n in enumerate(cluster.nodes) if instance(n) == worker)
        cluster.nodes[victim].proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(cluster.nodes[victim].proc.wait)
        cluster.nodes[victim] = await asyncio.to_thread(cluster.node)
        await asyncio.to_thread(wait_for, lambda: worker not in listed(etcd),
                                "etcd drops the killed node")
        # The old instance's blocks left the router with it; the new instance starts empty.
        assert await router.overlap(tokens, until=False) == 0
        chosen, _, _ = await router.router.best_worker(tokens)
        assert chosen != worker

    with_router(cluster, MODEL, scenario)


def test_a_node_paused_past_its_lease_joins_again(cluster, etcd):
    client = cluster.frontend("kv")
    system = system_prompt("glaciers")
    paused = cluster.nodes[holder(cluster, client, system)]
    other = next(n for n in cluster.nodes if n is not paused)
    lost, other_id = instance(paused), instance(other)
    paused.proc.send_signal(signal.SIGSTOP)
    try:  # its lease runs out while it cannot renew it, and Dynamo's runtime gives up on it
        wait_for(lambda: listed(etcd) == {other_id}, "etcd drops the paused node")
    finally:
        paused.proc.send_signal(signal.SIGCONT)
    wait_for(lambda: paused.health()[1]["dynamo"].get("instance", f"{lost:x}") != f"{lost:x}",
             "the node joins again as a new instance")
    assert listed(etcd) == {instance(paused), other_id}
    # Its blocks are published again: its prefix is sent back to it, not computed again.
    before, computed_before = answered(paused), computed(paused)
    prompt_tokens = ask(client, MODEL, system, "Again?").usage.prompt_tokens
    assert answered(paused) == before + 1
    assert computed(paused) - computed_before < 0.15 * prompt_tokens


def test_a_busy_node_does_not_hold_up_the_others(cluster):
    """A node with both its sequences on long generations, and its engine paused besides (as
    slow as a node can be): the requests on the other node's prefix are answered meanwhile."""
    client = cluster.frontend("kv")
    system = system_prompt("lighthouses")
    quick = cluster.nodes[holder(cluster, client, system)]
    busy = next(n for n in cluster.nodes if n is not quick)
    direct = openai.OpenAI(base_url=busy.base_url + "/v1", api_key="unused", max_retries=0)
    done: list[str] = []
    stop = threading.Event()

    def long_stream() -> None:  # holds one of the busy node's two sequences until told
        stream = direct.chat.completions.create(
            model=MODEL, max_tokens=400, temperature=0, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": "Tell a long story."}], timeout=600,
            stream=True)
        for _ in stream:
            if stop.is_set():
                break
        stream.close()
        done.append("long")

    threads = [threading.Thread(target=long_stream) for _ in range(2)]
    for thread in threads:
        thread.start()
    wait_for(lambda: busy.metrics()["prefixgate_num_requests_running"] == 2,
             "the busy node runs both long streams")
    engine = busy.health()[1]["workers"][0]["pid"]
    os.kill(engine, signal.SIGSTOP)
    try:
        before = answered(quick)
        for i in range(3):
            ask(client, MODEL, system, f"Question {i}?")
            done.append("quick")
    finally:
        os.kill(engine, signal.SIGCONT)
        stop.set()
    for thread in threads:
        thread.join(600)
    # The quick node answered all three while the busy node was still on its streams.
    assert done[:3] == ["quick"] * 3, done
    assert answered(quick) == before + 3
