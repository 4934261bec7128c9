"""cache_control on /v1/messages, against the real server: a breakpoint writes the prefix up to it
and pins it for its TTL (capped by --pin-hours, shortened here), within the pin budget and the
tenant's share of it; the usage fields tell what was written and read; Claude Code's billing
header never splits two sessions' prefixes."""

from __future__ import annotations

import anthropic
import pytest

from gateway.anthropic.requests import MessagesRequest
from loadtest.gateway_process import GatewayProcess
from tests.test_anthropic_api import ALIAS, client, prompt_total

CC = {"type": "ephemeral"}
PIN_SECONDS = 6


def story(topic: str) -> str:
    return f"{topic} was the subject of the harbour's evening talks for many years. " * 5


@pytest.fixture
def tiny_pool(model_path, tmp_path, pin_clock):
    """4 blocks of 64 tokens in the pool, at most 2 pinned, pins of at most 6 s of `pin_clock`;
    plain LRU across tenants (--tenant-cache-share 1), so that only pins keep a prefix from a
    flood."""
    keys = tmp_path / "keys"
    keys.write_text("key-a tenant-a\nkey-b tenant-b\n")
    server = pin_clock.gateway(model_path, "--parallel", "2", "--ctx-size", "2048",
                               "--cache-mb", "6", "--pin-budget-mb", "3",
                               "--pin-hours", str(PIN_SECONDS / 3600),
                               "--tenant-cache-share", "1", "--temperature", "0",
                               "--model-alias", "claude-*", "--api-keys-file", str(keys))
    yield server
    server.stop()


def ask(server: GatewayProcess, system: str, marked: bool, key: str = "key-a"):
    block = {"type": "text", "text": system, **({"cache_control": CC} if marked else {})}
    return client(server, key).messages.create(
        model=ALIAS, max_tokens=4, system=[block],
        messages=[{"role": "user", "content": "Say one word."}]).usage


def test_a_breakpoint_writes_then_reads_and_the_fields_add_up(tiny_pool):
    first = ask(tiny_pool, story("The lighthouse"), marked=True)
    assert first.cache_read_input_tokens < 16 and first.cache_creation_input_tokens >= 60
    again = ask(tiny_pool, story("The lighthouse"), marked=True)
    assert again.cache_read_input_tokens >= 64
    # What is left of the prefix past the last whole cached block is written again.
    assert again.cache_creation_input_tokens < 64
    assert prompt_total(again) == prompt_total(first)
    unmarked = ask(tiny_pool, story("The ferry"), marked=False)
    assert unmarked.cache_creation_input_tokens == 0  # no breakpoint, nothing written at one
    tiny_pool.settled()


def flood(server: GatewayProcess, send) -> None:
    """Five unmarked prompts, each evicting what it can; pins stay within their budget."""
    for topic in ("Salt", "Nets", "Ice", "Gulls", "Rope"):
        send(story(topic))
        metrics = server.metrics()
        assert metrics["prefixgate_prefix_cache_pinned_blocks"] <= \
            metrics["prefixgate_prefix_cache_pin_budget_blocks"] == 2


def test_a_pinned_prefix_survives_a_flood_then_falls_back_to_lru(tiny_pool, pin_clock):
    ask(tiny_pool, story("The lighthouse"), marked=True)
    ask(tiny_pool, story("The ferry"), marked=False)
    flood(tiny_pool, lambda system: ask(tiny_pool, system, marked=False))
    assert ask(tiny_pool, story("The ferry"), marked=False).cache_read_input_tokens < 16
    assert ask(tiny_pool, story("The lighthouse"), marked=False).cache_read_input_tokens >= 64
    pin_clock.advance(PIN_SECONDS + 0.5)  # the pin's TTL is over: an ordinary LRU prefix again
    for topic in ("Salt", "Nets", "Ice", "Gulls", "Rope"):
        ask(tiny_pool, story(topic), marked=False)
    assert ask(tiny_pool, story("The lighthouse"), marked=False).cache_read_input_tokens < 16
    tiny_pool.settled()


def test_one_tenants_pins_cannot_push_out_anothers(tiny_pool):
    """The budget is 2 blocks. Tenant a marks three prompts; past the budget its own pins give
    way (the tenant holding the most), and tenant b's pinned prefix survives a's flood."""
    ask(tiny_pool, story("The pier"), marked=True, key="key-b")
    for topic in ("Salt", "Nets", "Ice"):
        ask(tiny_pool, story(topic), marked=True)
        assert tiny_pool.metrics()["prefixgate_prefix_cache_pinned_blocks"] <= 2
    for topic in ("Gulls", "Rope", "Tar", "Oars"):
        ask(tiny_pool, story(topic), marked=False)
    kept = ask(tiny_pool, story("The pier"), marked=False, key="key-b")
    assert kept.cache_read_input_tokens >= 64
    tiny_pool.settled()


BILLING = "x-anthropic-billing-header: cc_version=2.1.328.{}; cc_entrypoint=sdk-cli;"
AGENT = "You are a Claude agent, built on Anthropic's Claude Agent SDK."


def claude_code_like(question: str, suffix: str) -> dict:
    """The system blocks Claude Code sends: its billing line (whose suffix is a hash of the
    first question), then two marked blocks."""
    return {"model": ALIAS, "max_tokens": 4, "system": [
        {"type": "text", "text": BILLING.format(suffix)},
        {"type": "text", "text": AGENT, "cache_control": CC},
        {"type": "text", "text": story("The archive") * 2, "cache_control": CC}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": question, "cache_control": CC}]}]}


def test_two_sessions_with_different_billing_headers_share_the_system_prompt(model_path):
    server = GatewayProcess(model_path, "--parallel", "2", "--ctx-size", "2048",
                            "--temperature", "0", "--model-alias", "claude-*")
    try:
        first = client(server).messages.create(**claude_code_like("What is 2+2?", "3a8")).usage
        second = client(server).messages.create(**claude_code_like("Name a color.", "4b8")
                                                ).usage
        assert first.cache_read_input_tokens < 16
        # The whole system prompt (~150 tokens) is shared, not only the template's opening.
        assert second.cache_read_input_tokens >= 128
        server.settled()
    finally:
        server.stop()


def test_the_billing_header_is_dropped_unless_kept():
    request = MessagesRequest.model_validate(claude_code_like("Hi", "3a8"))
    dropped = request.chat_messages(keep_billing_header=False)[0].content
    kept = request.chat_messages(keep_billing_header=True)[0].content
    assert "billing" not in dropped and dropped.startswith(AGENT)
    assert kept.startswith(BILLING.format("3a8"))


def test_a_breakpoint_reaches_as_far_as_its_block(tiny_pool):
    """The pins' lengths, seen through the usage: marking only the system block writes the
    system prompt; marking the question writes it too."""
    system = story("The quay")
    request = {"model": ALIAS, "max_tokens": 4, "system": [
        {"type": "text", "text": system, "cache_control": CC}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Name a fish."}]}]}
    at_system = client(tiny_pool).messages.create(**request).usage
    count = client(tiny_pool).messages.count_tokens(model=ALIAS, system=system, messages=[
        {"role": "user", "content": "Name a fish."}]).input_tokens
    assert at_system.cache_creation_input_tokens + at_system.cache_read_input_tokens < count
    request["messages"][0]["content"][0]["cache_control"] = CC
    at_question = client(tiny_pool).messages.create(**request).usage
    assert at_question.cache_creation_input_tokens + at_question.cache_read_input_tokens > \
        at_system.cache_creation_input_tokens + at_system.cache_read_input_tokens
    with pytest.raises(anthropic.BadRequestError):  # a TTL Anthropic does not have
        client(tiny_pool).messages.create(**{**request, "system": [
            {"type": "text", "text": system, "cache_control": {"type": "ephemeral",
                                                               "ttl": "2h"}}]})


@pytest.fixture
def long_pins(model_path):
    """The tiny pool of `tiny_pool` (4 blocks, 2 pinned at most), with pins that outlast any
    test, however slow the machine: only the flood can take what is not pinned."""
    server = GatewayProcess(model_path, "--parallel", "2", "--ctx-size", "2048", "--cache-mb",
                            "6", "--pin-budget-mb", "3", "--tenant-cache-share", "1",
                            "--temperature", "0", "--model-alias", "claude-*")
    yield server
    server.stop()


def automatic(server: GatewayProcess, system: str, cached: bool):
    """A request as the anthropic SDK sends automatic caching: `cache_control` at the top."""
    fields = {"cache_control": CC} if cached else {}
    return client(server).messages.create(
        model=ALIAS, max_tokens=4, system=system,
        messages=[{"role": "user", "content": "Say one word."}], **fields).usage


def test_top_level_cache_control_writes_the_whole_prompt_and_pins_it(long_pins):
    """Automatic caching: the breakpoint is the last block of the last message, so the whole
    prompt is written (nothing is left as plain input), read on a repeat, and pinned as a
    block's breakpoint is: it outlives a flood that takes an unmarked prompt."""
    first = automatic(long_pins, story("The lighthouse"), cached=True)
    assert first.cache_read_input_tokens < 16 and first.input_tokens == 0
    assert first.cache_creation_input_tokens >= 64
    again = automatic(long_pins, story("The lighthouse"), cached=True)
    assert again.cache_read_input_tokens >= 64 and again.input_tokens == 0
    assert prompt_total(again) == prompt_total(first)
    unmarked = automatic(long_pins, story("The ferry"), cached=False)
    assert unmarked.cache_creation_input_tokens == 0
    flood(long_pins, lambda system: automatic(long_pins, system, cached=False))
    assert automatic(long_pins, story("The ferry"), cached=False).cache_read_input_tokens < 16
    assert automatic(long_pins, story("The lighthouse"), cached=False
                     ).cache_read_input_tokens >= 64
    long_pins.settled()


def test_the_automatic_breakpoint_is_the_last_cacheable_block():
    """Anthropic's placement: the last block of the last message (a thinking block cannot be
    marked: the one before it), else the last system block, else the last tool; counted with
    the blocks' own marks, its TTL its own."""
    def marks(**fields):
        body = {"model": ALIAS, "max_tokens": 4, "cache_control": {"type": "ephemeral",
                                                                   "ttl": "1h"}, **fields}
        return [(m.where, m.seconds) for m in MessagesRequest.model_validate(body).breakpoints()]

    assert marks(messages=[{"role": "user", "content": "Hi"}]) == [(("messages", 0, 0), 3600.0)]
    assert marks(system=[{"type": "text", "text": "A", "cache_control": CC}],
                 messages=[{"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": [
                               {"type": "text", "text": "Hello"},
                               {"type": "thinking", "thinking": "hm", "signature": "s"}]}]) == [
        (("system", 0), 300.0), (("messages", 1, 0), 3600.0)]
    assert marks(system="Be brief.", messages=[{"role": "user", "content": []}]) == [
        (("system", 0), 3600.0)]
    request = MessagesRequest.model_validate({"model": ALIAS, "max_tokens": 4,
                                              "system": "Be brief.",
                                              "messages": [{"role": "user", "content": []}]})
    assert request.cut(("system", 0)).system_blocks(True)[0].text == "Be brief."
