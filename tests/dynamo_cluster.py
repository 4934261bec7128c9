"""prefixgate nodes as Dynamo workers, for the tests: two nodes as separate processes (each
its own pool, one thread), over Dynamo's file discovery and ZMQ events, with Dynamo's own
frontend or prefixgate fronts in front of them, and what each node computed. Each node counts as
started once its /health says it has registered with Dynamo."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import openai
import pytest

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
    """`discovery`: Dynamo's discovery settings (default: its file backend under `tmp`)."""

    def __init__(self, tmp: Path, discovery: dict[str, str] | None = None) -> None:
        self.env = {**(discovery or {"DYN_DISCOVERY_BACKEND": "file",
                                     "DYN_FILE_KV": str(tmp / "discovery")}),
                    "DYN_REQUEST_PLANE": "tcp", "HOME": str(tmp)}  # the frontend's cache
        self.model_dir = tmp / "models"
        self.nodes: list[GatewayProcess] = []
        for _ in range(2):  # one after the other: a node may read how many came before
            self.nodes.append(self.node())
        self.frontends: dict[str, ServerProcess] = {}
        self.fronts: list[GatewayProcess] = []

    def node(self, *args: str, env: dict[str, str] | None = None) -> GatewayProcess:
        return registered(GatewayProcess(default_model_path(), *NODE_ARGS, *args,
                                         "--dynamo-model-dir", str(self.model_dir),
                                         env={**self.env, **(env or {})}))

    def frontend(self, mode: str) -> openai.OpenAI:
        if mode not in self.frontends:
            self.frontends[mode] = ServerProcess(
                [sys.executable, "-m", "dynamo.frontend", "--router-mode", mode,
                 "--http-host", "127.0.0.1", "--http-port", "{port}"], "/v1/models",
                ROOT / ".pytest_cache" / f"frontend-{mode}-{os.getpid()}.log", env=self.env)
        server = self.frontends[mode]
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused",
                               max_retries=0)
        for _ in range(300):  # until the frontend has found a node's model in discovery
            if client.models.list().data:
                return client
            time.sleep(0.1)
        pytest.fail("Dynamo's frontend never found the nodes' model")

    def front(self, *args: str) -> GatewayProcess:
        """prefixgate's own front (--dynamo-front) over the nodes, stopped with them."""
        self.fronts.append(GatewayProcess(default_model_path(), "--dynamo-front", *args,
                                          env=self.env))
        return self.fronts[-1]

    def stop(self) -> None:
        for server in [*self.fronts, *self.frontends.values(), *self.nodes]:
            server.stop()


def computed(node: GatewayProcess) -> float:
    return node.metrics().get("prefixgate_prompt_tokens_computed_total",
                              node.metrics().get("prefixgate_prompt_tokens_computed", 0.0))


def answered(node: GatewayProcess) -> float:
    return sum(node.labelled("prefixgate_requests_total", "finish_reason").values())


def system_prompt(topic: str) -> str:
    rules = " ".join(f"Rule {i}: answer questions about {topic} with care number {i}."
                     for i in range(30))
    return f"You are an assistant for {topic}. {rules}"


def ask(client: openai.OpenAI, model: str, system: str, question: str = "Hello?"):
    return client.chat.completions.create(
        model=model, max_tokens=1, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])


def replay(cluster: Cluster, client: openai.OpenAI, model: str, topics: list[str]
           ) -> tuple[list[float], list[float], int]:
    """Every prompt, then every prompt again: the prompt tokens each node computed in each
    round, and the second round's prompt tokens."""
    rounds, prompt_tokens = [], 0
    for _ in range(2):
        before = [computed(n) for n in cluster.nodes]
        prompt_tokens = sum(ask(client, model, system_prompt(t)).usage.prompt_tokens
                            for t in topics)
        rounds.append([computed(n) - b for n, b in zip(cluster.nodes, before, strict=True)])
    return rounds[0], rounds[1], prompt_tokens
