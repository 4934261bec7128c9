"""prefixgate nodes found through a real etcd (Debian's etcd-server, on a free loopback port with
its own data directory) by Dynamo's own frontend with the KV router; a node stopped with SIGTERM
leaves etcd before it exits."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import openai
import pytest

from gateway.workers.model_store import default_model_path
from tests.dynamo_cluster import (
    Cluster,
    answered,
    ask,
    computed,
    instance,
    replay,
    system_prompt,
)
from tests.etcd_server import Etcd

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
            ask(client, MODEL, system_prompt(f"topic {i}"))
        assert sum(answered(n) for n in cluster.nodes) == before + 4
    finally:
        node.stop()
