"""Why did this miss? POST /v1/cache/explain on the real gateway: where a prompt leaves the cached
path (the message, the character, the text on both sides), as the endpoints render it; who may
ask about which namespace; and the x-prefix-cache header of every completion against its usage."""

from __future__ import annotations

import anthropic
import pytest

from loadtest.gateway_process import GatewayProcess
from tests.conftest import DEFAULT_ARGS, openai_client
from tests.test_anthropic_api import raw
from tests.test_cache_controls import ADMIN

STAMP_A, STAMP_B = "2026-12-03 09:14:07", "2026-12-03 09:19:07"
SYSTEM = ("You are the harbour office's assistant. Current time: {stamp} UTC. Answer in one "
          "line about ferries, tides and berths, and name the pier a ferry leaves from.")
QUESTION = "When does the first ferry leave?"


def chat(stamp: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM.format(stamp=stamp)},
            {"role": "user", "content": QUESTION}]


def post(server: GatewayProcess, path: str, body: dict, key: str | None = None,
         query: str = "") -> tuple[int, dict]:
    return raw(server, body, {"Authorization": f"Bearer {key}"} if key else {}, path + query)


def explain(server: GatewayProcess, body: dict, key: str | None = None,
            query: str = "") -> dict:
    status, answer = post(server, "/v1/cache/explain", body, key, query)
    assert status == 200, answer
    return answer


def header(raw) -> dict[str, str]:
    """x-prefix-cache's fields."""
    return dict(part.split("=", 1) for part in raw.headers["x-prefix-cache"].split("; "))


def test_a_timestamp_in_the_system_prompt_is_named_as_the_miss(gateway, client, model_name):
    """The second prompt differs from the cached one only in its timestamp: explain names the
    system message and the character where it leaves the cached path, shows both texts from
    there, and predicts what the request then gets from the cache."""
    first = client.chat.completions.create(model=model_name, messages=chat(STAMP_A),
                                           max_tokens=4, temperature=0)
    system_a, system_b = (SYSTEM.format(stamp=s) for s in (STAMP_A, STAMP_B))
    changed = next(i for i, (a, b) in enumerate(zip(system_a, system_b, strict=True)) if a != b)

    body = {"model": model_name, "messages": chat(STAMP_B), "max_tokens": 4}
    answer = explain(gateway, body)
    where = answer["divergence"]
    assert (where["message"], where["role"], where["in_content"]) == (0, "system", True)
    # The first token no cache holds starts at or just before the changed character, inside the
    # timestamp; the texts from there are the two system prompts'.
    assert system_a.index(STAMP_A) <= where["offset"] <= changed
    offset = where["offset"]
    assert where["prompt"] == system_b[offset: offset + len(where["prompt"])]
    assert where["cached"] is None  # text the caller did not send: for the admin key alone
    assert where["before"].endswith(system_a[:offset][-10:])
    assert where["source"] == "pool" and answer["held"]["pool"] == where["token"]
    assert answer["held"]["pool"] < first.usage.prompt_tokens

    # The tokens are the endpoint's own: the chat template's rendering, tokenized.
    status, rendered = post(gateway, "/apply-template", body)
    status, tokenized = post(gateway, "/tokenize", {"content": rendered["prompt"],
                                                    "add_special": False})
    assert answer["tokens"] == {"count": len(tokenized["tokens"]), "ids": tokenized["tokens"]}
    assert answer["ttft"]["tokens_to_compute"] == answer["tokens"]["count"] - \
        answer["cached_tokens"]
    assert answer["ttft"]["predicted_seconds"] > 0  # the first request measured a prefill

    # A Responses request with the same instructions renders the same prompt.
    responses = explain(gateway, {"model": model_name, "instructions": system_b,
                                  "input": QUESTION})
    assert responses["divergence"] == where and responses["tokens"] == answer["tokens"]
    # And sent, the request gets from the cache what explain predicted.
    second = client.chat.completions.create(model=model_name, messages=chat(STAMP_B),
                                            max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens == answer["cached_tokens"]
    again = explain(gateway, body)
    assert again["held"]["pool"] > answer["held"]["pool"]  # now cached, past the timestamp


def test_a_completion_body_is_explained_without_messages(gateway, model_name):
    answer = explain(gateway, {"model": model_name, "prompt": "Tide tables for the outer "
                                                              "islands, week 49:"})
    assert answer["divergence"]["message"] is None
    assert answer["tokens"]["count"] == len(answer["tokens"]["ids"]) > 5
    assert post(gateway, "/v1/cache/explain", {"model": model_name})[0] == 400


@pytest.fixture(scope="module")
def keyed(model_path, tmp_path_factory):
    """Tenants a and b apart; c and d in one shared-prefix group."""
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text("key-a tenant-a\nkey-b tenant-b\nkey-c tenant-c\nkey-d tenant-d\n")
    server = GatewayProcess(model_path, *DEFAULT_ARGS, "--api-keys-file", str(keys),
                            "--admin-key", ADMIN, "--shared-prefix-tenants",
                            "tenant-c,tenant-d")
    yield server
    server.stop()


def test_a_tenant_explains_its_own_namespace_and_the_admin_any(keyed, model_name):
    body = {"model": model_name, "messages": chat(STAMP_A)}
    tenant_a = openai_client(keyed)
    tenant_a.api_key = "key-a"
    tenant_a.chat.completions.create(model=model_name, messages=chat(STAMP_A), max_tokens=2)
    mine = explain(keyed, body, "key-a")
    assert mine["held"]["pool"] > 0
    assert explain(keyed, body, "key-b")["held"]["pool"] == 0  # another tenant sees nothing
    assert post(keyed, "/v1/cache/explain", body)[0] == 401
    assert post(keyed, "/v1/cache/explain", body, "wrong")[0] == 401
    assert post(keyed, "/v1/cache/explain", body, ADMIN)[0] == 400  # which namespace?
    assert explain(keyed, body, ADMIN, f"?namespace={mine['namespace']}")["held"] == \
        mine["held"]
    status, error = post(keyed, "/v1/cache/explain", body, ADMIN, "?namespace=0123456789abcdef")
    assert status == 404 and error["error"]["param"] == "namespace"


def test_a_shared_group_member_never_reads_anothers_text_and_the_admin_does(keyed,
                                                                          model_name):
    """Tenant c's conversation is cached; tenant d, in the same group, sends a prompt that
    leaves it just before c's secret. d's explanation places the divergence in d's own prompt
    and holds nothing of c's text past it; the admin's shows what the cache holds there."""
    secret = "The vault code is 4471-ZETA-9902, tell nobody."
    system = SYSTEM.format(stamp=STAMP_A)
    tenant_c = openai_client(keyed)
    tenant_c.api_key = "key-c"
    tenant_c.chat.completions.create(model=model_name, max_tokens=2, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": secret}])
    probe = {"model": model_name, "messages": [{"role": "system", "content": system},
                                               {"role": "user", "content": "The vault"}]}
    answer = explain(keyed, probe, "key-d")
    assert answer["held"]["pool"] > 0  # the group shares the cache: d reuses c's prefix
    where = answer["divergence"]
    assert where["cached"] is None and where["source"] == "pool"
    for fragment in ("4471", "ZETA", "9902", "tell nobody"):
        assert fragment not in str(answer)
    admin = explain(keyed, probe, ADMIN, f"?namespace={answer['namespace']}")
    assert "4471" in admin["divergence"]["cached"]


def test_the_header_says_what_usage_says(gateway, client, model_name):
    """On every API, whole and streamed: cached= is usage's cached tokens, prompt= its prompt
    tokens; a repeated prompt comes from the pool."""
    messages = [{"role": "user", "content": "Which berth does the evening ferry use?"}]
    for _ in range(2):  # new, then repeated
        raw = client.chat.completions.with_raw_response.create(
            model=model_name, messages=messages, max_tokens=2)
        usage = raw.parse().usage
        assert header(raw)["cached"] == str(usage.prompt_tokens_details.cached_tokens)
        assert header(raw)["prompt"] == str(usage.prompt_tokens)
    assert header(raw)["source"] == "pool" and int(header(raw)["cached"]) > 0

    raw = client.chat.completions.with_raw_response.create(
        model=model_name, messages=messages, max_tokens=2, stream=True,
        stream_options={"include_usage": True})
    usage = [c.usage for c in raw.parse() if c.usage][0]
    assert header(raw)["cached"] == str(usage.prompt_tokens_details.cached_tokens) != "0"

    raw = client.completions.with_raw_response.create(model=model_name, max_tokens=2,
                                                      prompt="The evening ferry's berth is")
    usage = raw.parse().usage
    assert header(raw)["cached"] == str(usage.prompt_tokens_details.cached_tokens)
    assert header(raw)["prompt"] == str(usage.prompt_tokens)

    raw = client.responses.with_raw_response.create(model=model_name, input=messages,
                                                    max_output_tokens=16)
    usage = raw.parse().usage
    assert header(raw)["cached"] == str(usage.input_tokens_details.cached_tokens) != "0"

    claude = anthropic.Anthropic(base_url=gateway.base_url, api_key="unused", max_retries=0)
    raw = claude.messages.with_raw_response.create(model=model_name, max_tokens=2,
                                                   messages=messages)
    usage = raw.parse().usage
    assert header(raw)["cached"] == str(usage.cache_read_input_tokens) != "0"
    assert header(raw)["source"] == "pool"


def test_a_server_without_a_cache_of_its_own_says_so_and_where_it_is(uncached_gateway):
    status, answer = post(uncached_gateway, "/v1/cache/explain",
                          {"model": uncached_gateway.model_name, "messages": chat("09:00")})
    assert status == 404 and answer["error"]["code"] == "cache_disabled"
    assert "--no-prefix-cache, or is a front" in answer["error"]["message"]
