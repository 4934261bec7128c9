"""prefixgate nodes on Dynamo with each node in a network namespace of its own (made by the test
with `ip netns` and a veth pair each, as root), so that nothing between the nodes, the frontend
and etcd goes through loopback or shared memory: each node has its own pool (its own
`--shared-memory` file), listens on its own address and advertises it to Dynamo
(DYN_TCP_RPC_HOST for requests, DYN_EVENT_PLANE_HOST for its KV events); etcd and Dynamo's
frontend run in the root namespace and reach the nodes over the veths. The KV router still sends
each repeated prefix to the node that holds it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gateway.workers.model_store import default_model_path
from loadtest.dynamo_cluster import NODE_ARGS, registered
from loadtest.gateway_process import GatewayProcess
from tests.dynamo_cluster import Cluster, replay
from tests.etcd_server import Etcd

MODEL = default_model_path().stem
N_NODES = 2
SYSTEM_PORT = 9090  # each node's Dynamo system server, where the frontend reads its model files


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass(frozen=True)
class Namespace:
    """A network namespace joined to the root one by a veth pair: `outer` is the root side's
    address, `inner` the namespace's (its default route goes out through `outer`)."""

    name: str
    outer: str
    inner: str

    @classmethod
    def make(cls, place: int) -> Namespace:
        tag = f"{os.getpid() % 100000}{place}"  # apart from another run's; names <= 15 chars
        subnet = f"10.{200 + os.getpid() % 50}.{place}"  # likewise
        ns = cls(f"pgdyn{tag}", f"{subnet}.1", f"{subnet}.2")
        outer_link, inner_link = f"pgv{tag}o", f"pgv{tag}i"
        ip("netns", "add", ns.name)
        try:
            ip("link", "add", outer_link, "type", "veth", "peer", "name", inner_link)
            ip("link", "set", inner_link, "netns", ns.name)
            ip("addr", "add", f"{ns.outer}/24", "dev", outer_link)
            ip("link", "set", outer_link, "up")
            ip("-n", ns.name, "addr", "add", f"{ns.inner}/24", "dev", inner_link)
            ip("-n", ns.name, "link", "set", inner_link, "up")
            ip("-n", ns.name, "link", "set", "lo", "up")  # the node's engine workers' pipes
            ip("-n", ns.name, "route", "add", "default", "via", ns.outer)
        except subprocess.CalledProcessError:
            ns.remove()
            raise
        return ns

    def remove(self) -> None:
        """Deleting the namespace deletes its end of the veth, and with it the root's end.
        Whatever of ours still runs in it (a node that failed to start, its engine workers)
        is killed first."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", self.name], check=False, capture_output=True)

    def pids(self) -> list[str]:
        found = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True,
                               text=True, check=False)
        return found.stdout.split()


class NetnsCluster(Cluster):
    """Two nodes, each in its namespace; the frontend in the root namespace."""

    def __init__(self, tmp: Path, etcd: Etcd, namespaces: list[Namespace]) -> None:
        self.namespaces, self.etcd_port, self.tmp = namespaces, etcd.port, tmp
        super().__init__(tmp, {"DYN_DISCOVERY_BACKEND": "etcd",
                               "ETCD_ENDPOINTS": etcd.base_url})

    def node(self, *args: str, env: dict[str, str] | None = None) -> GatewayProcess:
        place = len(self.nodes)  # the next namespace
        ns = self.namespaces[place]
        pool = self.tmp / f"pool-{place}"  # its own shared-memory file, in no other's reach
        # Its model directory on a tmpfs of its own: `ip netns exec` gives the node a mount
        # namespace of its own, so the frontend sees an empty directory there and must fetch
        # the tokenizer files from the node (DYN_SYSTEM_PORT).
        models = self.tmp / f"models-{place}"
        models.mkdir()
        return registered(GatewayProcess(
            default_model_path(), *NODE_ARGS, *args, "--shared-memory", str(pool),
            "--dynamo-model-dir", str(models), host=ns.inner,
            launcher=("ip", "netns", "exec", ns.name, "sh", "-c",
                      'mount -t tmpfs tmpfs "$0" && exec "$@"', str(models)),
            env={**self.env, **(env or {}),
                 "ETCD_ENDPOINTS": f"http://{ns.outer}:{self.etcd_port}",
                 "DYN_TCP_RPC_HOST": ns.inner, "DYN_EVENT_PLANE_HOST": ns.inner,
                 # The namespace's own port space: Dynamo takes a port below 32768 only.
                 "DYN_SYSTEM_HOST": ns.inner, "DYN_SYSTEM_PORT": str(SYSTEM_PORT)}))


@pytest.fixture(scope="module")
def namespaces() -> Iterator[list[Namespace]]:
    made: list[Namespace] = []
    try:
        for place in range(N_NODES):
            made.append(Namespace.make(place))
        yield made
    finally:  # even when a test or the set-up failed: no namespace or veth is left behind
        for ns in made:
            ns.remove()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, namespaces) -> Iterator[NetnsCluster]:
    tmp = tmp_path_factory.mktemp("dynamo-netns")
    etcd = Etcd(tmp / "etcd", ("127.0.0.1", *(ns.outer for ns in namespaces)))
    cluster = None
    try:
        cluster = NetnsCluster(tmp, etcd, namespaces)
        yield cluster
    finally:
        if cluster is not None:
            cluster.stop()
        etcd.stop()
        # The nodes stop their engine workers before they exit.
        deadline = time.monotonic() + 60
        while any(ns.pids() for ns in namespaces) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(ns.pids() for ns in namespaces), "a process outlived its node"


def test_each_node_serves_from_its_own_namespace_and_address(cluster, namespaces):
    for place, (node, ns) in enumerate(zip(cluster.nodes, namespaces, strict=True)):
        assert node.base_url.startswith(f"http://{ns.inner}:")
        assert node.health()[1]["dynamo"]["registered"]
        assert str(node.proc.pid) in ns.pids()
        assert not any((cluster.tmp / f"models-{place}").iterdir())  # not from out here


def test_the_kv_router_sends_repeats_to_the_holder_across_namespaces(cluster):
    first, second, prompt_tokens = replay(cluster, cluster.frontend("kv"), MODEL,
                                          ["mountains", "rivers", "deserts"])
    assert sum(first) > 3 * 300  # each computed once, somewhere
    assert sum(second) < 0.15 * prompt_tokens, (first, second)
