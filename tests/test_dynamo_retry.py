"""prefixgate's front sends a request to another node when the one it went to cannot take it
before any of its output reached the client (gateway/dynamo/front.py `_serve`): the node is at
capacity (a 429 there), or is killed with SIGKILL while the request waits there. Real Dynamo
1.6.1, two prefixgate nodes as separate processes that run one request each and queue QUEUE
more, and a front over them; file discovery, KV events over ZMQ. Each request is first sent
where the KV router sends it: to the node holding its system prompt."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import openai
import pytest

from loadtest.dynamo_cluster import answered, computed
from loadtest.gateway_process import GatewayProcess
from tests.dynamo_cluster import Cluster, system_prompt

QUEUE = 2  # requests a node queues beyond the one it runs; then it refuses (a 429)


@dataclass
class Pair:
    cluster: Cluster
    front: GatewayProcess

    @property
    def model(self) -> str:
        return self.front.model_name

    def client(self, server: GatewayProcess | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=(server or self.front).base_url + "/v1",
                             api_key="unused", max_retries=0, timeout=600)

    def holder(self, system: str) -> tuple[GatewayProcess, GatewayProcess]:
        """Sends `system` through the front once: the node that computed it (where the KV
        router sends its prefix from now on), and the other."""
        nodes = self.cluster.nodes
        before = [computed(n) for n in nodes]
        ask(self.client(), self.model, system, "Hello?")
        grown = [computed(n) - b for n, b in zip(nodes, before, strict=True)]
        held = grown.index(max(grown))
        return nodes[held], nodes[1 - held]

    def retries(self, reason: str) -> float:
        return self.front.labelled("prefixgate_dynamo_retries_total", "reason").get(reason, 0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Iterator[Pair]:
    cluster = Cluster(tmp_path_factory.mktemp("dynamo-retry"),
                      node_args=("--parallel", "1", "--max-queue", str(QUEUE),
                                 "--step-timeout", "0"))  # a node may be paused
    try:
        yield Pair(cluster, cluster.front())
    finally:
        cluster.stop()


def ask(client: openai.OpenAI, model: str, system: str, question: str, **more):
    return client.chat.completions.create(**{
        "model": model, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "system", "content": system},
                     {"role": "user", "content": question}], **more})


def waiting(node: GatewayProcess) -> float:
    return node.metrics()["prefixgate_num_requests_waiting"]


def wait_for(condition, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.1)


class Calls:
    """Requests on threads of their own: what each returned or raised, by name."""

    def __init__(self) -> None:
        self.ended: dict[str, object] = {}
        self.threads: list[threading.Thread] = []

    def start(self, name: str, call) -> None:
        def run() -> None:
            try:
                self.ended[name] = call()
            except Exception as exc:  # noqa: BLE001 - what the client heard is the assertion
                self.ended[name] = exc

        self.threads.append(threading.Thread(target=run, daemon=True))
        self.threads[-1].start()

    def join(self) -> None:
        for thread in self.threads:
            thread.join(600)
        assert not any(t.is_alive() for t in self.threads), "a request hangs"


def long_stream(client: openai.OpenAI, model: str, system: str, started: threading.Event
                ) -> str:
    """A long generation, streamed: its text, once it ends."""
    stream = client.chat.completions.create(
        model=model, max_tokens=2000, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": system},
                  {"role": "user", "content": "Tell a long story."}])
    text = ""
    for chunk in stream:
        started.set()
        text += "".join(c.delta.content or "" for c in chunk.choices)
    return text


@contextmanager
def full(pair: Pair, node: GatewayProcess, system: str, queued: int = QUEUE) -> Iterator[Calls]:
    """`node` runs a long generation and queues `queued` requests besides, all sent to its own
    API (so the front's router knows nothing of them); at the end the long one is dropped and
    the queued ones (`queued i` of the Calls) answered."""
    direct = pair.client(node)
    stream = direct.chat.completions.create(
        model=pair.model, max_tokens=2000, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": system},
                  {"role": "user", "content": "Count to a thousand."}])
    next(stream)
    calls = Calls()
    try:
        for i in range(queued):
            calls.start(f"queued {i}", lambda i=i: ask(direct, pair.model, system, f"Queued {i}?"))
        wait_for(lambda: waiting(node) == queued, "the node queues the requests")
        yield calls
    finally:
        stream.close()
        calls.join()
    assert all(isinstance(a, openai.types.chat.ChatCompletion) for a in calls.ended.values()), \
        calls.ended


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_a_node_refuses_at_capacity_is_served_by_the_other(pair, stream):
    system = system_prompt(f"capacity {stream}")
    busy, other = pair.holder(system)
    with full(pair, busy, system):
        refused, served = pair.retries("refused"), answered(other)
        answer = ask(pair.client(), pair.model, system, "What is this about?", stream=stream)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
        else:
            text = answer.choices[0].message.content
        # The front's router sent it to the node holding its prompt, which refused it; the
        # front sent it on to the other node, which answered it.
        assert pair.retries("refused") == refused + 1
        assert answered(other) == served + 1
    direct = ask(pair.client(other), pair.model, system, "What is this about?")
    assert text == direct.choices[0].message.content


def queried(node: GatewayProcess) -> float:
    """Prompt tokens of the sequences the node has started (looked up in its cache)."""
    return node.metrics()["prefixgate_prefix_cache_queries_total"]


def test_a_group_refused_in_part_moves_whole_to_the_other_node(pair):
    """The node has room for one of the request's two choices: both go to the other node
    together, where they run beside each other and compute their prompt once; the one the
    node had queued is stopped there, never run."""
    system = system_prompt("choices on the move")
    busy, other = pair.holder(system)
    with full(pair, busy, system, queued=QUEUE - 1) as queue:
        engine = busy.health()[1]["workers"][0]["pid"]
        started = queried(busy)
        os.kill(engine, signal.SIGSTOP)  # the node stays full: its long generation cannot end
        try:
            refused, before = pair.retries("refused"), computed(other)
            answer = ask(pair.client(), pair.model, system, "Hello?", n=2, temperature=1,
                         seed=3)
        finally:
            os.kill(engine, signal.SIGCONT)
        assert [c.finish_reason for c in answer.choices] == ["length", "length"]
        assert pair.retries("refused") == refused + 1
        assert computed(other) - before < 1.5 * answer.usage.prompt_tokens
    busy.wait_idle(300)
    # Since then the node started the request it had queued itself, and nothing else.
    assert queried(busy) - started == queue.ended["queued 0"].usage.prompt_tokens


def waiting_behind_a_stream(pair: Pair, system: str
                            ) -> tuple[GatewayProcess, GatewayProcess, Calls]:
    """Through the front, a long stream on the node holding `system`, then QUEUE questions
    waiting there behind it: that node, the other, and the calls (`long`, `question i`)."""
    node, other = pair.holder(system)
    calls, started = Calls(), threading.Event()
    calls.start("long", lambda: long_stream(pair.client(), pair.model, system, started))
    assert started.wait(600)
    assert node.metrics()["prefixgate_num_requests_running"] == 1  # the router sent it there
    for i in range(QUEUE):
        calls.start(f"question {i}",
                    lambda i=i: ask(pair.client(), pair.model, system, f"Question {i}?"))
    wait_for(lambda: waiting(node) == QUEUE, "the questions wait on the node")
    return node, other, calls


def answered_elsewhere(pair: Pair, calls: Calls, system: str, other: GatewayProcess,
                       unreachable: float) -> None:
    """None hangs; the stream, which had sent text, ended with an error and was not retried;
    each question was sent on once, and the other node answered it whole, as it answers it
    itself."""
    calls.join()
    assert isinstance(calls.ended["long"], openai.APIError), calls.ended["long"]
    for i in range(QUEUE):
        answer = calls.ended[f"question {i}"]
        assert isinstance(answer, openai.types.chat.ChatCompletion), answer
        direct = ask(pair.client(other), pair.model, system, f"Question {i}?")
        assert answer.choices[0].message.content == direct.choices[0].message.content
        assert answer.choices[0].finish_reason == direct.choices[0].finish_reason
        assert answer.usage.completion_tokens == direct.usage.completion_tokens
    assert pair.retries("unreachable") == unreachable + QUEUE


def test_requests_waiting_when_a_nodes_engine_dies_are_answered_by_the_other(pair):
    """The node's engine worker is killed: the node fails its requests as a single gateway
    does (its engine unavailable, a 503), and those that had sent nothing go to the other
    node. The node then serves again with a new engine worker."""
    system = system_prompt("a dying engine")
    node, other, calls = waiting_behind_a_stream(pair, system)
    unreachable = pair.retries("unreachable")
    os.kill(node.health()[1]["workers"][0]["pid"], signal.SIGKILL)
    answered_elsewhere(pair, calls, system, other, unreachable)
    wait_for(lambda: node.health()[1]["workers"][0]["state"] == "ready", "a new engine worker")


def test_requests_waiting_on_a_killed_node_are_answered_by_the_other(pair):
    """A long stream runs on a node and QUEUE requests wait there; the node is killed with
    SIGKILL. The waiting ones had sent nothing to their clients: the other node answers them,
    whole. The stream had: it ends with an error, not retried."""
    system = system_prompt("sudden death")
    victim, survivor, calls = waiting_behind_a_stream(pair, system)
    unreachable = pair.retries("unreachable")
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait()
    answered_elsewhere(pair, calls, system, survivor, unreachable)
