"""prefixgate's own front over a Dynamo deployment (`prefixgate --dynamo-front`,
gateway/dynamo/front.py), with real Dynamo 1.6.1 from PyPI: two prefixgate nodes as separate
processes, two fronts sharing a real redis-server for their stored responses (with API keys of
two tenants), a third front with a rate limit and a fourth, greedy, for Claude Code and Codex;
the openai and anthropic SDKs and the agents themselves against the fronts. Discovery through
Dynamo's file backend, KV events over ZMQ."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import openai
import pytest

from gateway.workers.model_store import default_model_path
from loadtest.dynamo_cluster import BLOCK, answered, computed
from loadtest.gateway_process import ROOT, GatewayProcess, free_port, redis_server
from tests.dynamo_cluster import Cluster, ask, replay, system_prompt
from tests.test_claude_code import claude
from tests.test_codex import answer, codex, codex_home, usage
from tests.test_dynamo import Router, random_prompt, with_router
from tests.test_errors import CASES, call

KEYS = {"tenant-a": "key-a", "tenant-b": "key-b"}


@dataclass
class Deployment:
    cluster: Cluster
    fronts: list[GatewayProcess]  # two, sharing Redis
    limited: GatewayProcess  # one request a minute per key
    model: str

    def openai(self, front: int = 0, tenant: str = "tenant-a") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.fronts[front].base_url + "/v1",
                             api_key=KEYS[tenant], max_retries=0)

    def node_client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.cluster.nodes[0].base_url + "/v1", api_key="unused",
                             max_retries=0)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> Iterator[Deployment]:
    tmp: Path = tmp_path_factory.mktemp("dynamo-front")
    keys = tmp / "keys"
    keys.write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items()))
    cluster = Cluster(tmp)
    try:
        with redis_server() as (url, _):
            shared = ("--api-keys-file", str(keys), "--redis-url", url,
                      "--redis-key", "front-secret")
            fronts = [cluster.front(*shared) for _ in range(2)]
            limited = cluster.front("--api-keys-file", str(keys), "--rate-limit-rpm", "1")
            yield Deployment(cluster, fronts, limited, fronts[0].model_name)
    finally:
        cluster.stop()


def test_health_lists_the_nodes_and_metrics_count_the_requests(deployment):
    front = deployment.fronts[0]
    status, health = front.health()
    assert status == 200 and health["status"] == "ok"
    assert len(health["workers"]) == 2  # both nodes, as Dynamo's discovery has them
    assert front.metrics()["prefixgate_dynamo_nodes"] == 2
    before = answered(front)
    deployment.openai().completions.create(model=deployment.model, prompt="Hi", max_tokens=1)
    assert answered(front) == before + 1


def test_chat_through_the_front_equals_the_nodes_own_answer(deployment):
    messages = [{"role": "user", "content": "Name three colours."}]
    through = deployment.openai().chat.completions.create(
        model=deployment.model, messages=messages, max_tokens=8, temperature=0)
    direct = deployment.node_client().chat.completions.create(
        model=deployment.model, messages=messages, max_tokens=8, temperature=0)
    assert through.choices[0].message.content == direct.choices[0].message.content
    assert through.usage.prompt_tokens == direct.usage.prompt_tokens
    assert through.choices[0].finish_reason == "length"
    stream = deployment.openai(1).chat.completions.create(
        model=deployment.model, messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        direct.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8


def test_completions_whole_and_streamed_with_stops_and_logprobs(deployment):
    client = deployment.openai()
    asked = dict(model=deployment.model, prompt="One, two, three, four,", max_tokens=12,
                 temperature=0, logprobs=2)
    direct = deployment.node_client().completions.create(**asked)
    whole = client.completions.create(**asked)
    assert whole.choices[0].text == direct.choices[0].text
    assert whole.choices[0].logprobs.tokens == direct.choices[0].logprobs.tokens
    streamed = "".join(c.choices[0].text for c in client.completions.create(**asked, stream=True)
                       if c.choices)
    assert streamed == whole.choices[0].text
    # A stop string the node's engine cut the text at: the front answers the cut text.
    stop = whole.choices[0].text.strip()[:2]
    cut = client.completions.create(**{**asked, "logprobs": None}, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert stop not in cut.choices[0].text


def test_a_grammar_and_n_choices_cross_to_the_node(deployment):
    """response_format's grammar is built by the front and runs on the node; each of n choices
    is a request of its own there."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    asked = dict(model=deployment.model, max_tokens=24, temperature=0, n=2,
                 messages=[{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
                 response_format={"type": "json_schema",
                                  "json_schema": {"name": "answer", "schema": schema}})
    through = deployment.openai().chat.completions.create(**asked)
    direct = deployment.node_client().chat.completions.create(**asked)
    assert [c.message.content for c in through.choices] == \
        [c.message.content for c in direct.choices]
    assert [c.finish_reason for c in through.choices] == ["stop", "stop"]
    assert json.loads(through.choices[1].message.content)["ok"] in (True, False)


def test_n_choices_go_to_one_node_and_share_their_prompt(deployment):
    """As on a single gateway, a request's choices run on one node, beside each other: its
    prompt is computed once."""
    before = [computed(n) for n in deployment.cluster.nodes]
    answer = deployment.openai().chat.completions.create(
        model=deployment.model, n=3, max_tokens=4, temperature=1, seed=5,
        messages=[{"role": "system", "content": system_prompt("choices")},
                  {"role": "user", "content": "Hello?"}])
    spent = [computed(n) - b for n, b in zip(deployment.cluster.nodes, before, strict=True)]
    assert len(answer.choices) == 3
    assert sorted(spent)[0] == 0, spent  # one node ran them all
    assert sum(spent) < 1.5 * answer.usage.prompt_tokens, spent


def test_dynamos_own_frontend_serves_the_same_nodes_beside_the_fronts(deployment):
    messages = [{"role": "user", "content": "Name a fruit."}]
    frontend = deployment.cluster.frontend("kv").chat.completions.create(
        model=deployment.model, messages=messages, max_tokens=6, temperature=0)
    front = deployment.openai().chat.completions.create(
        model=deployment.model, messages=messages, max_tokens=6, temperature=0)
    assert frontend.choices[0].message.content == front.choices[0].message.content


def running(cluster: Cluster) -> float:
    return sum(n.metrics().get("prefixgate_num_requests_running", 0) for n in cluster.nodes)


def test_an_abandoned_stream_is_dropped_on_the_node(deployment):
    cluster, front = deployment.cluster, deployment.fronts[0]
    finished = [answered(n) for n in cluster.nodes]
    stream = deployment.openai().chat.completions.create(
        model=deployment.model, max_tokens=2000, temperature=0, stream=True,
        messages=[{"role": "user", "content": "Count to a million, one number a line."}])
    next(stream), next(stream)
    stream.close()
    for _ in range(300):  # until the front and the nodes have let it go
        if not front.metrics()["prefixgate_dynamo_requests_in_flight"] and not running(cluster):
            break
        time.sleep(0.1)
    assert front.metrics()["prefixgate_dynamo_requests_in_flight"] == 0
    assert running(cluster) == 0
    assert [answered(n) for n in cluster.nodes] == finished  # cut, never run to its end


def pinned(cluster: Cluster) -> float:
    return sum(n.metrics().get("prefixgate_prefix_cache_pinned_blocks", 0)
               for n in cluster.nodes)


@pytest.mark.parametrize("stream", [False, True])
def test_messages_cache_control_pins_the_prefix_on_the_node(deployment, stream):
    client = anthropic.Anthropic(base_url=deployment.fronts[0].base_url, api_key=KEYS["tenant-a"],
                                 max_retries=0)
    system = [{"type": "text", "text": system_prompt(f"pinned topic {stream}"),
               "cache_control": {"type": "ephemeral"}}]
    asked = dict(model=deployment.model, max_tokens=4, system=system,
                 messages=[{"role": "user", "content": "Hello?"}])
    before = pinned(deployment.cluster)
    if stream:
        with client.messages.stream(**asked) as events:
            first = events.get_final_message()
    else:
        first = client.messages.create(**asked)
    assert first.usage.cache_creation_input_tokens > 300
    # The breakpoint crossed to the node that ran it, which pinned the system prompt's blocks.
    assert pinned(deployment.cluster) >= before + 300 // 16
    again = client.messages.create(**asked)
    assert again.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens - 16


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_stored_through_one_front_continues_through_the_other(deployment, stream):
    first = deployment.openai(0).responses.create(
        model=deployment.model, max_output_tokens=6, temperature=0,
        input=f"My name is Ada and I keep bees ({stream}). " * 8)
    other = deployment.openai(1)
    for _ in range(100):  # until the first front's writer has put it in Redis
        try:
            other.responses.retrieve(first.id)
            break
        except openai.NotFoundError:
            time.sleep(0.1)
    asked = dict(model=deployment.model, max_output_tokens=6, temperature=0,
                 previous_response_id=first.id, input="What is my name?")
    if stream:
        events = list(other.responses.create(**asked, stream=True))
        second = events[-1].response
    else:
        second = other.responses.create(**asked)
    assert second.previous_response_id == first.id
    assert second.status in ("completed", "incomplete")
    # The whole first turn came along, and the router sent it to the node that held it.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16


def test_the_same_prefix_twice_lands_on_the_node_holding_it(deployment):
    first, second, prompt_tokens = replay(deployment.cluster, deployment.openai(),
                                          deployment.model, ["geology", "knitting", "opera"])
    assert sum(first) > 3 * 300  # each prompt computed once, somewhere
    assert sum(second) < 0.15 * prompt_tokens, (first, second)


def test_prompts_no_node_holds_are_spread_over_the_nodes(deployment):
    """One after another, so the router sees no load: left to itself it sends every prompt no
    node holds to the same node (the first of its table), whose pool alone then fills. The
    front sends each to the node it has sent the fewest. Short prompts (~200 tokens): which
    node computed one is all that is asked."""
    front = deployment.cluster.front()  # a front of its own: it has sent nothing yet
    client = openai.OpenAI(base_url=front.base_url + "/v1", api_key="unused", max_retries=0)
    nodes = deployment.cluster.nodes
    holders = []
    for topic in ["botany", "rowing", "origami", "falconry", "pottery", "glassblowing"]:
        before = [computed(n) for n in nodes]
        ask(client, deployment.model, system_prompt(topic, rules=10))
        grown = [computed(n) - b for n, b in zip(nodes, before, strict=True)]
        holders.append(max(range(len(nodes)), key=grown.__getitem__))
    assert sorted(holders.count(i) for i in range(len(nodes))) == [3, 3], holders


def test_one_tenants_prefix_is_no_hit_for_another(deployment):
    system = system_prompt("tenancy")
    owner = ask(deployment.openai(tenant="tenant-a"), deployment.model, system)
    again = ask(deployment.openai(tenant="tenant-a"), deployment.model, system)
    assert again.usage.prompt_tokens_details.cached_tokens > 300
    before = sum(computed(n) for n in deployment.cluster.nodes)
    stranger = ask(deployment.openai(tenant="tenant-b"), deployment.model, system)
    assert stranger.usage.prompt_tokens_details.cached_tokens == 0
    assert sum(computed(n) for n in deployment.cluster.nodes) - before == \
        stranger.usage.prompt_tokens == owner.usage.prompt_tokens


def test_the_kv_router_scores_a_tenants_blocks_for_that_tenant_only(deployment):
    """The front's requests carry the tenant's namespace as Dynamo's cache salt: the router
    finds tenant A's prompt under A's namespace alone."""
    tokens = random_prompt(52)
    deployment.openai(tenant="tenant-a").completions.create(
        model=deployment.model, prompt=tokens, max_tokens=1)

    async def scenario(router: Router) -> None:
        assert await router.overlap(tokens, "tenant:tenant-a", until=True) >= \
            len(tokens) // BLOCK - 1
        assert await router.overlap(tokens, "tenant:tenant-b") == 0
        assert await router.overlap(tokens) == 0

    with_router(deployment.cluster, deployment.model, scenario)


def test_the_rate_limit_holds_at_the_front(deployment):
    client = openai.OpenAI(base_url=deployment.limited.base_url + "/v1", api_key=KEYS["tenant-b"],
                           max_retries=0)
    client.completions.create(model=deployment.model, prompt="Hi", max_tokens=1)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=deployment.model, prompt="Hi", max_tokens=1)


@pytest.fixture
def tight_front(deployment) -> Iterator[GatewayProcess]:
    """A node that runs one request and queues none, in a Dynamo namespace of its own, and an
    open front over it."""
    endpoint = ("--dynamo-endpoint", "tight.prefixgate.generate")
    node = deployment.cluster.node("--parallel", "1", "--max-queue", "0", *endpoint)
    try:
        front = GatewayProcess(default_model_path(), "--dynamo-front", *endpoint,
                               env=deployment.cluster.env)
        yield front
        front.stop()
    finally:
        node.stop()


def test_a_node_at_capacity_is_the_429_of_a_single_gateway(tight_front):
    client = openai.OpenAI(base_url=tight_front.base_url + "/v1", api_key="unused",
                           max_retries=0)
    hello = dict(model=tight_front.model_name, max_tokens=2,
                 messages=[{"role": "user", "content": "Hi"}])
    busy = client.chat.completions.create(
        model=tight_front.model_name, max_tokens=300, stream=True,
        messages=[{"role": "user", "content": "Count to a thousand, one number a line."}])
    next(busy)  # it holds the node's one sequence
    for stream in (False, True):
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(**hello, stream=stream)
        assert refused.value.response.headers["Retry-After"] == "1"
        assert refused.value.code == "rate_limit_exceeded"
        # The node's own words, as a single gateway says them (not wrapped in them again).
        assert str(refused.value).count("at capacity") == 1, refused.value
    busy.close()
    # Not lost: the SDK's own retry (after Retry-After) is answered once the node is free.
    answer = client.with_options(max_retries=10).chat.completions.create(**hello)
    assert answer.usage.completion_tokens == 2


def test_a_request_without_a_key_is_refused(deployment):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=deployment.fronts[0].base_url + "/v1", api_key="nobody",
                      max_retries=0).models.list()


@pytest.mark.parametrize("path,body,status,param,code", CASES)
def test_bad_input_gets_the_4xx_of_a_single_gateway(deployment, path, body, status, param, code):
    if isinstance(body, dict):
        body = json.loads(json.dumps(body).replace("{model}", deployment.model))
    single = call(deployment.cluster.nodes[0], path, body)
    front = call(deployment.fronts[0], path, body,
                 headers={"Authorization": f"Bearer {KEYS['tenant-a']}"})
    assert front == single
    assert front[0] == status


@pytest.fixture(scope="module")
def agents_front(deployment) -> GatewayProcess:
    """Open (the agents' own tests run without keys), greedy, Claude Code's model names."""
    return deployment.cluster.front("--temperature", "0", "--model-alias", "claude-*")


@pytest.mark.timeout(900)  # two runs of Claude Code; a busy machine makes each slow
def test_claude_code_through_the_front(agents_front, tmp_path):
    first = claude(agents_front, tmp_path / "one", "What is the capital of France?")
    assert "paris" in first["result"].lower()
    assert first["usage"]["cache_creation_input_tokens"] > 800  # its breakpoints, on the node
    other = claude(agents_front, tmp_path / "two", "What is 2+2?")
    assert "4" in other["result"]
    # Another conversation: routed to the node holding the system prompt, read from its pool.
    assert other["usage"]["cache_read_input_tokens"] >= 768


@pytest.mark.timeout(900)  # two runs of Codex
def test_codex_through_the_front(agents_front, tmp_path):
    one = codex(codex_home(agents_front, tmp_path / "one"), tmp_path / "work",
                "What is the capital of France?")
    assert "paris" in answer(one).lower()
    two = codex(codex_home(agents_front, tmp_path / "two"), tmp_path / "work", "What is 2+2?")
    assert "4" in answer(two)
    assert usage(two)["cached_input_tokens"] >= 768  # the instructions, from the node's pool


def test_a_front_without_nodes_is_loading_and_stops_on_sigterm(tmp_path):
    """Before any node registers, /health says loading (503); SIGTERM then ends the wait."""
    port = free_port()
    env = {**os.environ, "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(tmp_path),
           "DYN_REQUEST_PLANE": "tcp", "HOME": str(tmp_path)}
    with open(tmp_path / "front.log", "w") as log:
        front = subprocess.Popen([sys.executable, "-m", "gateway", "--dynamo-front", "--port",
                                  str(port)], cwd=ROOT, env=env, stdout=log, stderr=log)
    try:
        for _ in range(600):  # until it listens
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                pytest.fail("a front with no node answered /health with a 200")
            except urllib.error.HTTPError as exc:
                assert (exc.code, json.loads(exc.read())) == (503, {"status": "loading"})
                break
            except urllib.error.URLError:
                time.sleep(0.1)
        else:
            pytest.fail("the front never listened")
        front.terminate()
        assert front.wait(timeout=60) == 0
    finally:
        front.kill()
