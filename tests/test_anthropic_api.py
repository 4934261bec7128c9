"""Anthropic's Messages API through the anthropic SDK, against the real server on loopback: the
same generation path as chat completions (a greedy answer is the same text), errors in
Anthropic's shape, count_tokens, keys and tenants."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import anthropic
import openai
import pytest

from loadtest.gateway_process import GatewayProcess

KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
ALIAS = "claude-sonnet-4-5"  # served through --model-alias 'claude-*'
QUESTION = "What is the capital of France? Answer in one sentence."
SYSTEM = "You are a terse geography tutor. " * 20  # ~140 tokens: a couple of cached blocks


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    """Greedy by default (--temperature 0), as agent clients send no temperature."""
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text("".join(f"{key} {tenant}\n" for key, tenant in KEYS.items()))
    server = GatewayProcess(model_path, "--parallel", "4", "--ctx-size", "8192",
                            "--temperature", "0", "--model-alias", "claude-*",
                            "--api-keys-file", str(keys), "--max-body-mb", "1")
    yield server
    server.stop()


def client(server: GatewayProcess, key: str = "key-a") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0)


def ask(server: GatewayProcess, key: str = "key-a", **fields) -> anthropic.types.Message:
    request = {"model": ALIAS, "max_tokens": 24,
               "messages": [{"role": "user", "content": QUESTION}], **fields}
    return client(server, key).messages.create(**request)


def prompt_total(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens \
        + usage.cache_creation_input_tokens


def test_a_message_is_the_chat_completion_of_the_same_conversation(server):
    """One generation path: the greedy answer to the same system prompt and question is the
    same text, on the same prompt tokens. Neither request sends a temperature: --temperature 0
    applies to both APIs."""
    message = ask(server, system=SYSTEM)
    chat = openai.OpenAI(base_url=server.base_url + "/v1", api_key="key-a", max_retries=0
                         ).chat.completions.create(
        model=server.model_name, max_tokens=24,  # greedy by the server's default, as is ask()
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == ALIAS
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[
        chat.choices[0].finish_reason]
    assert prompt_total(message.usage) == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens


def test_the_server_default_temperature_applies_when_none_is_sent(server):
    """--temperature 0: two requests without a temperature give one answer."""
    first, second = ask(server, max_tokens=32), ask(server, max_tokens=32)
    assert first.content[0].text == second.content[0].text


def test_stop_sequences_and_max_tokens_end_as_anthropic_says(server):
    whole = ask(server).content[0].text
    word = whole.split()[2]
    stopped = ask(server, stop_sequences=["zzz-never", word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert whole.startswith(stopped.content[0].text) and word not in stopped.content[0].text
    cut = ask(server, max_tokens=3)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


def test_count_tokens_is_the_prompt_the_message_is_made_of(server):
    tools = [{"name": "get_weather", "description": "Weather of a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]}}]
    messages = [{"role": "user", "content": QUESTION}]
    count = client(server).messages.count_tokens(model=ALIAS, system=SYSTEM, tools=tools,
                                                 messages=messages)
    message = ask(server, system=SYSTEM, tools=tools, max_tokens=4)
    assert count.input_tokens == prompt_total(message.usage)
    without_tools = client(server).messages.count_tokens(model=ALIAS, system=SYSTEM,
                                                         messages=messages)
    assert without_tools.input_tokens < count.input_tokens


def test_a_repeated_prompt_reads_the_cache_and_a_tenant_never_reads_anothers(server):
    system = "You keep the harbour's logbook and answer about it. " * 12
    first = ask(server, system=system)
    again = ask(server, system=system)
    # The first shares no more than the template's opening with earlier requests of tenant a.
    assert first.usage.cache_read_input_tokens < 16
    assert again.usage.cache_read_input_tokens >= 128
    assert prompt_total(again.usage) == prompt_total(first.usage)
    other = ask(server, "key-b", system=system)
    assert other.usage.cache_read_input_tokens == 0
    assert other.content[0].text == first.content[0].text


WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}


def test_a_stream_is_the_whole_message_in_anthropics_events(server):
    request = {"model": ALIAS, "max_tokens": 24, "system": SYSTEM,
               "messages": [{"role": "user", "content": QUESTION}]}
    whole = client(server).messages.create(**request)
    with client(server).messages.stream(**request) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.id.startswith("msg_")
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert prompt_total(final.usage) == prompt_total(whole.usage)
    events = sse_events(server, {**request, "stream": True})
    kinds = [name for name, _ in events]
    assert all(data["type"] == name for name, data in events)
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    start, delta = events[0][1]["message"]["usage"], events[-2][1]["usage"]
    assert {k: start[k] for k in start if k != "output_tokens"} == \
        {k: delta[k] for k in delta if k != "output_tokens"}  # the same split, told twice


def sse_events(server: GatewayProcess, body: dict) -> list[tuple[str, dict]]:
    request = urllib.request.Request(server.base_url + "/v1/messages",
                                     data=json.dumps(body).encode(), headers={
                                         "Content-Type": "application/json", "x-api-key": "key-a"})
    events, name = [], None
    with urllib.request.urlopen(request, timeout=60) as response:
        for line in response:
            if line.startswith(b"event: "):
                name = line[7:].strip().decode()
            elif line.startswith(b"data: "):
                events.append((name, json.loads(line[6:])))
    return events


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_use_then_its_result(server, stream):
    """tool_choice `tool` forces a call whose input fits the schema (a grammar); the result
    goes back as a tool_result and the model answers in text. The answer is asked with
    tool_choice `none`: whether a 135M model calls the tool again under `auto` is a near tie
    that a prompt cut into other chunks (the step budget follows the machine's speed) flips."""
    import jsonschema

    question = {"role": "user", "content": "What is the weather in Paris?"}
    request = {"model": ALIAS, "max_tokens": 40, "tools": [WEATHER], "messages": [question],
               "tool_choice": {"type": "tool", "name": "get_weather"}}
    if stream:
        with client(server).messages.stream(**request) as events:
            message = events.get_final_message()
    else:
        message = client(server).messages.create(**request)
    assert message.stop_reason == "tool_use"
    (call,) = message.content
    assert call.type == "tool_use" and call.name == "get_weather"
    assert call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    def after_the_call(result: str) -> dict:
        return {"model": ALIAS, "tools": [WEATHER], "tool_choice": {"type": "none"},
                "messages": [question, {"role": "assistant", "content": [
                    {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": call.id, "content": result}]}]}

    answer = client(server).messages.create(max_tokens=24, **after_the_call("18 degrees and sunny"))
    assert answer.content and answer.content[0].type == "text"
    assert answer.stop_reason in ("end_turn", "max_tokens")
    empty = client(server).messages.count_tokens(**after_the_call(""))
    assert prompt_total(answer.usage) > empty.input_tokens  # the result is in the prompt


def test_tool_choice_any_calls_one_of_the_tools(server):
    clock = {"name": "get_time", "description": "The time in a city",
             "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                              "required": ["city"]}}
    message = client(server).messages.create(
        model=ALIAS, max_tokens=40, tools=[WEATHER, clock], tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "What time is it in Oslo?"}])
    assert message.stop_reason == "tool_use"
    assert message.content[-1].type == "tool_use"
    assert message.content[-1].name in ("get_weather", "get_time")


def raw(server: GatewayProcess, body: bytes | dict, headers: dict | None = None,
        path: str = "/v1/messages") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(server.base_url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json",
                                              **(headers if headers is not None
                                                 else {"x-api-key": "key-a"})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


USER = [{"role": "user", "content": "hi"}]
ERRORS = [
    # (body, status, error type, words the message holds)
    (b"{not json", 400, "invalid_request_error", "JSON"),
    ({"model": ALIAS, "messages": USER}, 400, "invalid_request_error", "max_tokens"),
    ({"model": ALIAS, "max_tokens": 0, "messages": USER}, 400, "invalid_request_error",
     "max_tokens"),
    ({"model": ALIAS, "max_tokens": 8, "messages": []}, 400, "invalid_request_error",
     "messages"),
    ({"model": ALIAS, "max_tokens": 8, "messages": USER, "temperature": 1.5}, 400,
     "invalid_request_error", "temperature"),
    ({"model": ALIAS, "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}]}]}, 400, "invalid_request_error",
     "image"),
    ({"model": ALIAS, "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                        "data": "x"}}]}]}, 400, "invalid_request_error",
     "document"),
    ({"model": ALIAS, "max_tokens": 8, "messages": USER, "mcp_servers": [{"url": "x"}]}, 400,
     "invalid_request_error", "mcp_servers"),
    ({"model": ALIAS, "max_tokens": 8, "messages": USER, "tools": [
        {"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "invalid_request_error", "tools"),
    ({"model": ALIAS, "max_tokens": 8, "messages": USER,
      "tool_choice": {"type": "tool", "name": "nope"},
      "tools": [{"name": "f", "input_schema": {"type": "object"}}]}, 400,
     "invalid_request_error", "nope"),
    ({"model": ALIAS, "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "tool_reference", "tool_name": "f"}]}]}]}, 400, "invalid_request_error",
     "tool_reference"),
    ({"model": "gpt-4o", "max_tokens": 8, "messages": USER}, 404, "not_found_error", "gpt-4o"),
    ({"model": ALIAS, "max_tokens": 8, "messages": [{"role": "user", "content": "word " * 9000}]},
     400, "invalid_request_error", "context length"),
]


@pytest.mark.parametrize(("body", "status", "kind", "words"), ERRORS)
def test_what_cannot_be_served_is_an_anthropic_error(server, body, status, kind, words):
    got_status, error = raw(server, body)
    assert got_status == status
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert words.lower() in error["error"]["message"].lower()


def test_the_middlewares_answer_in_anthropic_shape_and_x_api_key_is_a_key(server):
    status, error = raw(server, {"model": ALIAS, "max_tokens": 8, "messages": USER},
                        {"x-api-key": "wrong"})
    assert status == 401 and error["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        client(server, "wrong").messages.create(model=ALIAS, max_tokens=8, messages=USER)
    status, error = raw(server, b"{" + b" " * (2 << 20) + b"}")
    assert status == 413 and error["error"]["type"] == "request_too_large"
    status, _ = raw(server, {"model": ALIAS, "max_tokens": 8, "messages": USER},
                    {"Authorization": "Bearer key-b"})
    assert status == 200
    server.settled()


def test_a_recorded_full_size_claude_code_request_is_understood():
    """Claude Code 2.1.328's whole body (its default system prompt, 12 tools, a system turn),
    recorded: every field parses, the billing header is left out, and the breakpoints are its
    two system blocks and its last message's block."""
    from pathlib import Path

    from gateway.anthropic.requests import BILLING_HEADER, MessagesRequest
    from gateway.core.requests import parse_request

    body = (Path(__file__).parent / "fixtures" / "claude_code_2.1.328_request.json").read_bytes()
    request = parse_request(MessagesRequest, body)
    turns = request.chat_messages(keep_billing_header=False)
    assert turns[0].role == "system" and BILLING_HEADER not in turns[0].content
    assert "# Environment" in turns[0].content  # its system turn, folded in
    assert [t.role for t in turns[1:]] == ["user"]
    assert len(request.toolbox().functions) == 12
    assert [mark.where for mark in request.breakpoints()] == [
        ("system", 1), ("system", 2), ("messages", 1, 0)]


def test_with_tools_offered_a_text_answer_streams_as_it_comes(server):
    """A call is the whole answer as a JSON object: an answer that starts otherwise is text and
    is streamed at once. (Before, with tools offered every answer was held back to its end, so
    Claude Code, which always sends tools, saw its first token only with the last.)"""
    events = sse_events(server, {"model": ALIAS, "max_tokens": 24, "stream": True,
                                 "tools": [WEATHER],
                                 "messages": [{"role": "user", "content": QUESTION}]})
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert all(d["type"] == "text_delta" for d in deltas)
    # The first token is computed in a step of its own, so it comes before the rest (later
    # ones may come several to a delta: drafts accepted in one step, as an earlier test's
    # answer to the same question drafts this one).
    assert len(deltas) >= 2 and deltas[0]["text"].strip()
    assert events[-2][1]["delta"]["stop_reason"] in ("end_turn", "max_tokens")


def test_the_fields_the_current_sdk_sends_are_accepted(server):
    """Every field of anthropic 2.17's MessageCreateParams that has no meaning for a local model
    is accepted (before, each was a 400 "unknown parameter"), and a tool use sent back with its
    `caller` and the tool's newer fields too. The answer is the one without them."""
    plain = ask(server, system=SYSTEM)
    message = ask(server, system=SYSTEM, service_tier="standard_only", inference_geo="us",
                  speed="standard", container="container_011", user_profile_id="up_1",
                  workspace_id="wrkspc_1", diagnostics={"previous_message_id": plain.id},
                  metadata={"user_id": "u-1"}, output_config={"effort": "max"})
    assert message.content[0].text == plain.content[0].text
    tool = {**WEATHER, "allowed_callers": ["direct"], "eager_input_streaming": True,
            "defer_loading": False, "strict": True}
    answer = client(server).messages.create(
        model=ALIAS, max_tokens=8, tools=[tool], tool_choice={"type": "none"}, messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris", "unit": "celsius"}, "caller": {"type": "direct"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": "18 degrees"}]}])
    assert answer.content[0].type == "text"
    count = client(server).messages.count_tokens(
        model=ALIAS, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}],
        cache_control={"type": "ephemeral"}, output_config={"effort": "low"}, speed="fast",
        user_profile_id="up_1", workspace_id="wrkspc_1")
    assert count.input_tokens == prompt_total(plain.usage)


def test_output_config_format_is_enforced(server):
    """Structured outputs: the answer is JSON that the schema accepts, by the grammar."""
    import jsonschema

    schema = {"type": "object", "properties": {"capital": {"enum": ["Paris", "Lyon"]}},
              "required": ["capital"], "additionalProperties": False}
    message = ask(server, max_tokens=40,
                  output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(message.content[0].text), schema)
    with pytest.raises(anthropic.BadRequestError, match="multipleOf"):
        ask(server, output_config={"format": {"type": "json_schema", "schema": {
            "type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}}})


def test_a_tools_input_examples_are_shown_to_the_model(server):
    messages = [{"role": "user", "content": QUESTION}]
    without = client(server).messages.count_tokens(model=ALIAS, tools=[WEATHER],
                                                   messages=messages).input_tokens
    example = {"city": "Bergen", "unit": "celsius"}
    tokens = client(server).messages.count_tokens(
        model=ALIAS, tools=[{**WEATHER, "input_examples": [example]}],
        messages=messages).input_tokens
    assert tokens > without + 5


def test_top_level_cache_control_counts_among_the_four_breakpoints(server):
    marked = [{"type": "text", "text": f"Part {i}.", "cache_control": {"type": "ephemeral"}}
              for i in range(4)]
    four = ask(server, max_tokens=2, system=marked)
    assert four.stop_reason in ("end_turn", "max_tokens")
    with pytest.raises(anthropic.BadRequestError, match="Found 5"):
        ask(server, max_tokens=2, system=marked, cache_control={"type": "ephemeral"})
