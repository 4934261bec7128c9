"""Every malformed request gets its 4xx in OpenAI's error shape, and the server keeps serving."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def call(gateway, path: str, body: bytes | dict | None, method: str = "POST",
         headers: dict[str, str] | None = None):
    data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
    req = urllib.request.Request(gateway.base_url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def chat(**fields):
    return {"model": "{model}", "messages": MESSAGES, **fields}


CASES = [
    # (path, body, status, param, code)
    (CHAT, b"{not json", 400, None, None),
    (CHAT, b"[1, 2]", 400, None, None),
    (CHAT, {"model": "{model}"}, 400, "messages", None),
    (CHAT, {"messages": MESSAGES}, 400, "model", None),
    (CHAT, chat(messages=[]), 400, "messages", None),
    (CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role", None),
    (CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]), 400, "messages[0].content", None),
    (CHAT, chat(temperature=3), 400, "temperature", None),
    (CHAT, chat(temperature="hot"), 400, "temperature", None),
    (CHAT, chat(max_tokens=0), 400, "max_tokens", None),
    (CHAT, chat(stop=["a", "b", "c", "d", "e"]), 400, "stop", None),
    (CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options", None),
    (CHAT, chat(n=9), 400, "n", None),
    (CHAT, chat(n=0), 400, "n", None),
    (CHAT, chat(top_logprobs=21, logprobs=True), 400, "top_logprobs", None),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), 400,
     "response_format.json_schema", None),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "not a name!"}}]), 400,
     "tools[0].function.name", None),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "strict": True,
                                                          "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}}}],
        tool_choice="required"), 400, "tools", "unsupported"),
    (CHAT, chat(frobnicate=1), 400, "frobnicate", None),
    (CHAT, chat(logit_bias={"not-a-token": 1}), 400, "logit_bias", None),
    (CHAT, chat(model="no-such-model"), 404, "model", "model_not_found"),
    (CHAT, chat(messages=[{"role": "user", "content": "word " * 8300}]), 400, "messages",
     "context_length_exceeded"),
    (COMPLETIONS, {"model": "{model}"}, 400, "prompt", None),
    (COMPLETIONS, {"model": "{model}", "prompt": ["a", "b"]}, 400, "prompt", "unsupported"),
    (COMPLETIONS, {"model": "{model}", "prompt": [10 ** 9]}, 400, "prompt", None),
    (COMPLETIONS, {"model": "{model}", "prompt": "x", "echo": True}, 400, "echo", "unsupported"),
    (COMPLETIONS, {"model": "{model}", "prompt": "x", "best_of": 3}, 400, "best_of",
     "unsupported"),
]


@pytest.mark.parametrize("path,body,status,param,code", CASES)
def test_malformed_request_gets_openai_error(gateway, path, body, status, param, code):
    if isinstance(body, dict):
        body = json.loads(json.dumps(body).replace("{model}", gateway.model_name))
    got_status, payload = call(gateway, path, body)
    assert got_status == status, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert error["code"] == code


def test_http_level_errors_use_the_same_shape(gateway):
    status, payload = call(gateway, "/v1/nothing-here", {})
    assert status == 404 and payload["error"]["message"]
    status, payload = call(gateway, CHAT, None, method="GET")
    assert status == 405 and payload["error"]["message"]
    status, payload = call(gateway, CHAT, b"{" + b" " * (17 << 20) + b"}")
    assert status == 413 and payload["error"]["message"]


def test_sdk_raises_its_error_classes(client, model_name):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=model_name, messages=MESSAGES, temperature=5)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=MESSAGES)


def test_server_still_serves_after_errors(gateway, client, model_name):
    for path, body, *_ in CASES:
        if isinstance(body, bytes):
            call(gateway, path, body)
    r = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=4)
    assert r.usage.completion_tokens >= 1
    gateway.settled()


@pytest.fixture(scope="module")
def qwen3_coder(model_path):
    """A gateway rendering with Qwen3-Coder's template, which iterates a call's arguments as
    a mapping."""
    from loadtest.gateway_process import GatewayProcess
    from tests.templates import template_path
    server = GatewayProcess(model_path, "--parallel", "1", "--ctx-size", "2048",
                            "--model-alias", "*", "--chat-template-file",
                            str(template_path("Qwen3-Coder.jinja")))
    yield server
    server.stop()


@pytest.mark.parametrize("arguments", ['[1, 2]', '"Paris"', '3'])
def test_a_template_failing_on_the_request_is_a_400_on_every_api(qwen3_coder, arguments):
    """Tool-call arguments that are JSON but not an object: the template's loop over them
    fails inside Jinja (not its raise_exception). Each API answers a 400 in its own shape
    naming the conversation, never a 500, and the server serves on."""
    call_id, user = "call_1", {"role": "user", "content": "The weather in Paris?"}
    history = [user, {"role": "assistant", "tool_calls": [{"id": call_id, "type": "function",
               "function": {"name": "get_weather", "arguments": arguments}}]},
               {"role": "tool", "tool_call_id": call_id, "content": "Sunny"}]
    for path in (CHAT, "/apply-template", "/v1/cache/explain"):
        status, answer = call(qwen3_coder, path, {"model": "m", "messages": history,
                                                  "max_tokens": 1})
        assert status == 400 and answer["error"]["param"] == "messages", (path, answer)
        assert "template" in answer["error"]["message"]
    status, answer = call(qwen3_coder, "/v1/responses", {"model": "m", "input": [
        {"role": "user", "content": "The weather in Paris?"},
        {"type": "function_call", "call_id": call_id, "name": "get_weather",
         "arguments": arguments},
        {"type": "function_call_output", "call_id": call_id, "output": "Sunny"}],
        "max_output_tokens": 1})
    assert status == 400 and answer["error"]["param"] == "input", answer
    status, answer = call(qwen3_coder, CHAT, {"model": "m", "messages": [user],
                                              "max_tokens": 1})
    assert status == 200, answer


def test_a_responses_tool_of_no_known_type_is_a_400_and_hosted_ones_a_fixed_label(gateway,
                                                                                  model_name):
    """Before, any type was a hosted tool, left out silently, and a new metrics label and log
    line each time."""
    base = {"model": model_name, "input": "Hi", "max_output_tokens": 16}
    for kind in ("made_up_tool_1", "made_up_tool_2"):
        status, answer = call(gateway, "/v1/responses", base | {"tools": [{"type": kind}]})
        assert status == 400 and answer["error"]["param"] == "tools[0].type", answer
        assert kind in answer["error"]["message"]
    status, answer = call(gateway, "/v1/responses", base | {"tools": [{"type": "web_search"}]})
    assert status == 200, answer
    exposition = urllib.request.urlopen(gateway.base_url + "/metrics", timeout=10).read()
    assert b'type="web_search"' in exposition and b"made_up_tool" not in exposition


def test_tool_names_that_collide_and_truncation_auto_are_400s(gateway, model_name):
    function = {"type": "function", "name": "fs__read", "parameters": {"type": "object"}}
    namespace = {"type": "namespace", "name": "fs", "tools": [
        {"type": "function", "name": "read", "parameters": {"type": "object"}}]}
    status, answer = call(gateway, "/v1/responses", {"model": model_name, "input": "Hi",
                                                     "tools": [function, namespace]})
    assert status == 400 and answer["error"]["param"] == "tools", answer
    twice = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    status, answer = call(gateway, CHAT, chat(tools=[twice, twice], max_tokens=1) |
                          {"model": model_name})
    assert status == 400 and answer["error"]["param"] == "tools", answer
    status, answer = call(gateway, "/v1/responses", {"model": model_name, "input": "Hi",
                                                     "truncation": "auto"})
    assert status == 400 and answer["error"]["param"] == "truncation", answer
