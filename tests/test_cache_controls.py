"""OpenAI's prompt-cache parameters and the cache admin API, against the real server:
prompt_cache_retention "24h" pins a prompt against eviction until the pin expires, within the pin
budget; the admin API lists, drops and counts, and only with its key."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from loadtest.gateway_process import GatewayProcess
from tests.conftest import openai_client

ADMIN = "admin-secret"


def admin(server: GatewayProcess, method: str, path: str, key: str | None = ADMIN):
    request = urllib.request.Request(server.base_url + path, method=method, headers={
        "Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_the_three_parameters_are_accepted_by_both_endpoints(gateway, client, model_name):
    before = gateway.metrics()["prefixgate_prompt_cache_key_requests_total"]
    chat = client.chat.completions.create(
        model=model_name, max_tokens=2, messages=[{"role": "user", "content": "Hi"}],
        prompt_cache_key="app-7", prompt_cache_retention="in_memory",
        safety_identifier="user-hash-1", user="someone")
    assert chat.choices[0].finish_reason in ("stop", "length")
    text = client.completions.create(model=model_name, prompt="Hi", max_tokens=2, extra_body={
        "prompt_cache_key": "app-7", "prompt_cache_retention": "24h",
        "safety_identifier": "user-hash-2", "user": "someone"})
    assert text.choices[0].finish_reason in ("stop", "length")
    assert gateway.metrics()["prefixgate_prompt_cache_key_requests_total"] - before == 2


def story(topic: str) -> str:
    return f"{topic} was the subject of the harbour's evening talks for many years. " * 5


@pytest.fixture
def tiny_pool(model_path, pin_clock):
    """4 blocks in the pool, at most 2 of them pinned, pins that last 6 s of `pin_clock`."""
    server = pin_clock.gateway(model_path, "--parallel", "2", "--ctx-size", "2048",
                               "--cache-mb", "6", "--pin-budget-mb", "3",
                               "--pin-hours", str(6 / 3600), "--admin-key", ADMIN)
    yield server
    server.stop()


def test_a_pinned_prefix_survives_a_flood_until_its_pin_expires(tiny_pool, pin_clock,
                                                                 model_name):
    client = openai_client(tiny_pool)

    def ask(prompt: str, retention: str = "in_memory") -> int:
        r = client.completions.create(model=model_name, prompt=prompt, max_tokens=4,
                                      temperature=0,
                                      extra_body={"prompt_cache_retention": retention})
        return r.usage.prompt_tokens_details.cached_tokens

    pinned, plain = story("The lighthouse"), story("The ferry")
    ask(pinned, "24h")
    ask(plain)
    for topic in ("Salt", "Nets", "Ice", "Gulls", "Rope"):  # each evicts what it can
        ask(story(topic))
        m = tiny_pool.metrics()
        assert m["prefixgate_prefix_cache_pinned_blocks"] <= \
            m["prefixgate_prefix_cache_pin_budget_blocks"] == 2
    assert ask(plain) < 8  # evicted
    assert ask(pinned) > 60  # survived, and its hit counts as pinned
    assert tiny_pool.metrics()["prefixgate_prefix_cache_pinned_hits_total"] > 60
    pin_clock.advance(6.5)  # the pin expires: the prefix is evictable again
    for topic in ("Salt", "Nets", "Ice", "Gulls", "Rope"):
        ask(story(topic))
    assert ask(pinned) < 8
    tiny_pool.settled()


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_prompt_cache_breakpoint_pins_the_prompt_up_to_its_part(model_path, model_name, api):
    """openai 3.63's explicit breakpoint on a text part: the system part marked, the prompt up
    to it outlives a flood that takes the same prompt unmarked (plain LRU across tenants, pins
    of --pin-hours' default, far longer than the test however slow the machine)."""
    server = GatewayProcess(model_path, "--parallel", "2", "--ctx-size", "2048", "--cache-mb",
                            "6", "--pin-budget-mb", "3", "--tenant-cache-share", "1",
                            "--temperature", "0")
    client = openai_client(server)

    def ask(system: str, marked: bool) -> int:
        mark = {"prompt_cache_breakpoint": {"mode": "explicit"}} if marked else {}
        options = {"mode": "explicit", "ttl": "30m"}
        if api == "chat":
            return client.chat.completions.create(
                model=model_name, max_tokens=4, prompt_cache_options=options, messages=[
                    {"role": "system", "content": [{"type": "text", "text": system, **mark}]},
                    {"role": "user", "content": "Say one word."}]
            ).usage.prompt_tokens_details.cached_tokens
        return client.responses.create(
            model=model_name, max_output_tokens=4, store=False, prompt_cache_options=options,
            input=[{"role": "developer", "content": [
                {"type": "input_text", "text": system, **mark}]},
                {"role": "user", "content": "Say one word."}]
        ).usage.input_tokens_details.cached_tokens

    try:
        ask(story("The lighthouse"), marked=True)
        ask(story("The ferry"), marked=False)
        for topic in ("Salt", "Nets", "Ice", "Gulls", "Rope"):  # each evicts what it can
            ask(story(topic), marked=False)
            assert server.metrics()["prefixgate_prefix_cache_pinned_blocks"] <= 2
        assert ask(story("The ferry"), marked=False) < 8  # evicted
        assert ask(story("The lighthouse"), marked=False) >= 64  # pinned up to its part
        server.settled()
    finally:
        server.stop()


def test_a_request_refused_at_capacity_pins_nothing(model_path, model_name):
    """Room for one request: while a stream runs, a request asking to pin a cached prompt is
    refused with a 429, and its prompt stays unpinned (pins come after admission)."""
    server = GatewayProcess(model_path, "--parallel", "1", "--max-queue", "0", "--ctx-size",
                            "2048")
    try:
        client = openai_client(server)
        prompt = story("The breakwater")
        client.completions.create(model=model_name, prompt=prompt, max_tokens=2)  # cached
        running = client.completions.create(model=model_name, prompt="Once upon a time",
                                            max_tokens=400, stream=True,
                                            extra_body={"ignore_eos": True})
        next(iter(running))  # it holds the only room
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=model_name, prompt=prompt, max_tokens=2,
                                      extra_body={"prompt_cache_retention": "24h"})
        assert server.metrics()["prefixgate_prefix_cache_pinned_blocks"] == 0
        running.close()
        server.settled()
    finally:
        server.stop()


def test_the_admin_api_lists_drops_and_counts_with_its_key(tiny_pool, pin_clock, gateway,
                                                           model_name):
    assert admin(gateway, "GET", "/v1/cache/stats")[0] == 404  # no --admin-key: no admin API
    assert admin(tiny_pool, "GET", "/v1/cache/stats", key=None)[0] == 401
    assert admin(tiny_pool, "GET", "/v1/cache/stats", key="wrong")[0] == 401
    client = openai_client(tiny_pool)
    client.completions.create(model=model_name, prompt=story("The pier"), max_tokens=4,
                              extra_body={"prompt_cache_retention": "24h"})
    status, listing = admin(tiny_pool, "GET", "/v1/cache/prefixes")
    assert status == 200 and listing["data"]
    row = listing["data"][0]
    assert row["tokens"] > 60 and row["blocks"] == 2 and row["bytes"] > 0
    assert row["pinned_until"] > pin_clock.now() and len(row["namespace"]) == 16
    assert "preview" not in row  # prompts are shown only with --log-prompts
    status, stats = admin(tiny_pool, "GET", "/v1/cache/stats")
    metrics = tiny_pool.metrics()
    assert stats["pool"]["blocks_used"] == metrics["prefixgate_kv_pool_blocks_used"]
    assert stats["pins"]["blocks"] == metrics["prefixgate_prefix_cache_pinned_blocks"] > 0
    assert stats["cells"]["total"] == metrics["prefixgate_kv_cells_total"]
    status, dropped = admin(tiny_pool, "DELETE", "/v1/cache/prefixes")
    assert status == 200 and dropped["dropped_blocks"] == metrics["prefixgate_kv_pool_blocks_used"]
    assert tiny_pool.metrics()["prefixgate_kv_pool_blocks_used"] == 0


@pytest.mark.parametrize("share", ["0.5", "1"])
def test_one_tenants_flood_cannot_evict_another_tenants_prefix(model_path, model_name, tmp_path,
                                                                share):
    """A pool of 4 blocks. Past half of it (--tenant-cache-share 0.5, the default), tenant a's
    flood evicts its own prompts and tenant b's stays; with plain LRU (1) the flood takes it."""
    keys = tmp_path / "keys"
    keys.write_text("key-a tenant-a\nkey-b tenant-b\n")
    server = GatewayProcess(model_path, "--parallel", "2", "--ctx-size", "2048", "--cache-mb",
                            "6", "--api-keys-file", str(keys), "--tenant-cache-share", share)
    try:
        def ask(key: str, prompt: str) -> int:
            client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)
            r = client.completions.create(model=model_name, prompt=prompt, max_tokens=2,
                                          temperature=0)
            return r.usage.prompt_tokens_details.cached_tokens

        ask("key-b", story("The lighthouse"))
        for topic in ("Salt", "Nets", "Ice", "Gulls", "Rope"):
            ask("key-a", story(topic))
        assert ask("key-a", story("Rope")) > 60  # the flood still caches within its share
        kept = ask("key-b", story("The lighthouse"))
        assert kept > 60 if share == "0.5" else kept < 8
        server.settled()
    finally:
        server.stop()
