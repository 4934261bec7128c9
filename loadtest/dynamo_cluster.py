"""prefixgate nodes as Dynamo workers, for the tests and the benchmark (loadtest.dynamo_bench):
nodes as separate processes (each its own pool, one thread), over Dynamo's file discovery (or
etcd) and ZMQ events, with Dynamo's own frontend or prefixgate fronts in front of them, and
what each node computed. Each node counts as started once its /health says it has registered
with Dynamo."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

from gateway.workers.model_store import default_model_path
from loadtest.gateway_process import ROOT, GatewayProcess, ServerProcess

NODE_ARGS = ("--dynamo", "--threads", "1", "--parallel", "2", "--ctx-size", "4096",
             "--block-size", "16", "--admin-key", "admin")
ENDPOINT = "dynamo.prefixgate.generate"
BLOCK = 16


def registered(node: GatewayProcess, timeout: float = 180) -> GatewayProcess:
    """Waits until the node's /health says it has joined Dynamo."""
    deadline = time.monotonic() + timeout
    while not node.health()[1]["dynamo"]["registered"]:
        assert node.proc.poll() is None, f"the node exited: {node.proc.returncode}"
        assert time.monotonic() < deadline, "the node never registered with Dynamo"
        time.sleep(0.2)
    return node


def instance(node: GatewayProcess) -> int:
    """The node's Dynamo instance id (the worker id Dynamo's router names)."""
    return int(node.health()[1]["dynamo"]["instance"], 16)


class Cluster:
    """`discovery`: Dynamo's discovery settings (default: its file backend under `tmp`);
    `node_args`: added to every node's command line (its model, `model`, is every process's)."""

    def __init__(self, tmp: Path, discovery: dict[str, str] | None = None, *,
                 model: Path | None = None, nodes: int = 2,
                 node_args: tuple[str, ...] = ()) -> None:
        self.env = {**(discovery or {"DYN_DISCOVERY_BACKEND": "file",
                                     "DYN_FILE_KV": str(tmp / "discovery")}),
                    "DYN_REQUEST_PLANE": "tcp", "HOME": str(tmp)}  # the frontend's cache
        self.model = model or default_model_path()
        self.model_dir = tmp / "models"
        self.node_args = node_args
        self.nodes: list[GatewayProcess] = []
        self.frontends: dict[str, ServerProcess] = {}
        self.fronts: list[GatewayProcess] = []
        try:
            for _ in range(nodes):  # one after the other: a node may read how many came before
                self.nodes.append(self.node())
        except BaseException:
            self.stop()
            raise

    def node(self, *args: str, env: dict[str, str] | None = None) -> GatewayProcess:
        return registered(GatewayProcess(self.model, *NODE_ARGS, *self.node_args, *args,
                                         "--dynamo-model-dir", str(self.model_dir),
                                         env={**self.env, **(env or {})}))

    def frontend_url(self, mode: str) -> str:
        """Dynamo's own frontend (`--router-mode mode`), once it has found the nodes' model."""
        if mode not in self.frontends:
            self.frontends[mode] = ServerProcess(
                [sys.executable, "-m", "dynamo.frontend", "--router-mode", mode,
                 "--http-host", "127.0.0.1", "--http-port", "{port}"], "/v1/models",
                ROOT / ".pytest_cache" / f"frontend-{mode}-{os.getpid()}.log", env=self.env)
        url = self.frontends[mode].base_url
        for _ in range(300):  # until the frontend has found a node's model in discovery
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                if json.loads(r.read())["data"]:
                    return url
            time.sleep(0.1)
        raise AssertionError("Dynamo's frontend never found the nodes' model")

    def front(self, *args: str) -> GatewayProcess:
        """prefixgate's own front (--dynamo-front) over the nodes, stopped with them."""
        self.fronts.append(GatewayProcess(self.model, "--dynamo-front", *args, env=self.env))
        return self.fronts[-1]

    def stop(self) -> None:
        for server in [*self.fronts, *self.frontends.values(), *self.nodes]:
            server.stop()


def computed(node: GatewayProcess) -> float:
    """Prompt tokens the node prefilled (neither shared from a live sequence nor loaded)."""
    return node.metrics().get("prefixgate_prompt_tokens_computed_total",
                              node.metrics().get("prefixgate_prompt_tokens_computed", 0.0))


def answered(node: GatewayProcess) -> float:
    return sum(node.labelled("prefixgate_requests_total", "finish_reason").values())
