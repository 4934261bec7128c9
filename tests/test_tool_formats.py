"""Each model family's own call and reasoning format through the real server: its real chat
template (llama.cpp's models/templates, --chat-template-file) renders the tools and the history,
the test model's engine replays the family's scripted output (tests/replay_gateway.py), and the
answer comes back parsed on all three APIs, whole and streamed, through the openai and anthropic
SDKs. For the families whose outputs think, every request asks for reasoning (reasoning_effort,
thinking, reasoning.effort): the R1 template opens its <think> only when asked, and DeepSeek
V3.1's answers without it unless asked."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from gateway.core.conversation import NamedToolChoice
from loadtest.gateway_process import GatewayProcess
from tests.chat_outputs import CODE, OUTPUTS, TEXT_CALLS, TOOLS, WRITE, Scripted, write_call
from tests.templates import template_path
from tests.test_call_grammars import accepts, grammar_of
from tests.test_chat_formats import family_format
from tests.test_errors import call as post

# How each family's template renders an earlier call get_weather(city="Paris") in the history:
# the same text its model writes (the parser reads it back, tests/test_chat_formats.py).
HISTORY_CALLS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "hermes-thinking": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                       '</tool_call>',
    "qwen3-coder": "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>",
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": ',
    "mistral-args": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
    "mistral-args-ids": '[TOOL_CALLS]get_weather[CALL_ID]',
    "harmony": 'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}',
    "deepseek": '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}',
    "deepseek-r1": '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                   '{"city": "Paris"}\n```',
    "glm": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>",
    "json": '{"name": "get_weather", "arguments": {"city": "Paris"}}',
}
# Where a template renders the reasoning of the turn that made the call, and how.
HISTORY_REASONING = {
    "hermes-thinking": "<think>\nI need the weather.\n</think>",
    "harmony": "<|channel|>analysis<|message|>I need the weather.",
    "glm": "<think>I need the weather.</think>",
}
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
THINKING = {family for family, (_, cases) in OUTPUTS.items()
            if any(scripted.reasoning() for scripted in cases.values())}


@pytest.fixture(scope="module", params=list(OUTPUTS))
def served(request, model_path, tmp_path_factory):
    family = request.param
    rules = tmp_path_factory.mktemp(family) / "replay.json"
    rules.write_text(json.dumps([
        {"when": _question(case), "output": scripted.output}
        for case, scripted in OUTPUTS[family][1].items()]))
    server = GatewayProcess(model_path, "--parallel", "2", "--ctx-size", "4096",
                            "--model-alias", "*",
                            "--chat-template-file", str(template_path(OUTPUTS[family][0])),
                            "--replay-rules", str(rules), module="tests.replay_gateway")
    yield family, server, rules
    server.stop()


def test_the_production_entry_point_cannot_be_told_to_replay(model_path, tmp_path):
    """Replaying is the tests' own entry point's (tests/replay_gateway.py): `python -m gateway`
    with the variable that once turned it on (and the flag's would-be twin) set answers with the
    model."""
    rules = tmp_path / "replay.json"
    rules.write_text(json.dumps([{"when": "harbour", "output": "REPLAYED, NOT SAMPLED"}]))
    server = GatewayProcess(model_path, "--parallel", "1", "--ctx-size", "1024",
                            env={"PREFIXGATE_REPLAY": str(rules),
                                 "PREFIXGATE_REPLAY_RULES": str(rules)})
    try:
        r = _openai(server).chat.completions.create(
            model=server.model_name, max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": "Tell me about the harbour."}])
    finally:
        server.stop()
    assert "REPLAYED" not in (r.choices[0].message.content or "")
    assert r.usage.completion_tokens == 8 or r.choices[0].finish_reason == "stop"


def _question(case: str) -> str:
    return f"A question whose answer is the case {case}."


def _cases(served) -> list[tuple[str, Scripted]]:
    family, *_ = served
    return list(OUTPUTS[family][1].items())


def _thinking(served, **ask) -> dict:
    """How an API asks for reasoning, where the family's outputs think."""
    family, *_ = served
    return ask if family in THINKING else {}


def _openai(server: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _anthropic(server: GatewayProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def _expect_calls(scripted: Scripted, calls: list[tuple[str, dict]]) -> None:
    assert calls == scripted.calls()


def test_chat_completions_whole(served):
    _, server, _ = served
    for case, scripted in _cases(served):
        r = _openai(server).chat.completions.create(
            model="m", messages=[{"role": "user", "content": _question(case)}], tools=TOOLS,
            **_thinking(served, reasoning_effort="high"))
        message = r.choices[0].message
        _expect_calls(scripted, [(c.function.name, json.loads(c.function.arguments))
                                 for c in message.tool_calls or []])
        assert (message.content or "") == scripted.text(), case
        assert (getattr(message, "reasoning_content", None) or "") == scripted.reasoning()
        assert r.choices[0].finish_reason == ("tool_calls" if scripted.calls() else "stop")


def test_chat_completions_streamed(served):
    _, server, _ = served
    for case, scripted in _cases(served):
        stream = _openai(server).chat.completions.create(
            model="m", messages=[{"role": "user", "content": _question(case)}], tools=TOOLS,
            stream=True, **_thinking(served, reasoning_effort="high"))
        text, reasoning, calls, finish, argument_chunks = "", "", {}, None, 0
        for chunk in stream:
            choice = chunk.choices[0]
            delta = choice.delta
            text += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": call.id, "name": "", "args": ""})
                entry["name"] += call.function.name or ""
                entry["args"] += call.function.arguments or ""
                argument_chunks += 1
            finish = choice.finish_reason or finish
        _expect_calls(scripted, [(c["name"], json.loads(c["args"])) for _, c in
                                 sorted(calls.items())])
        assert all(c["id"] for c in calls.values())
        assert text == scripted.text() and reasoning == scripted.reasoning(), case
        assert finish == ("tool_calls" if scripted.calls() else "stop")
        if scripted.calls():  # the arguments came as they were generated, not in one piece
            assert argument_chunks > len(scripted.calls())


def _anthropic_parts(content) -> tuple[list, str, str]:
    calls = [(b.name, b.input) for b in content if b.type == "tool_use"]
    text = "".join(b.text for b in content if b.type == "text")
    thinking = "".join(b.thinking for b in content if b.type == "thinking")
    return calls, text, thinking


def _whole_and_streamed(served, create, stream, ask_for):
    """Each scripted case asked for whole and streamed: the case, its script, and both answers
    (the stream's as the SDK assembles it)."""
    for case, scripted in _cases(served):
        ask = ask_for(case)
        whole = create(**ask)
        with stream(**ask) as events:
            streamed = events.get_final_message() if hasattr(events, "get_final_message") \
                else events.get_final_response()
        yield case, scripted, (whole, streamed)


def test_anthropic_messages_whole_and_streamed(served):
    client = _anthropic(served[1])
    for case, scripted, answers in _whole_and_streamed(
            served, client.messages.create, client.messages.stream, lambda case: {
                "model": "m", "max_tokens": 2000, "tools": ANTHROPIC_TOOLS,
                "messages": [{"role": "user", "content": _question(case)}],
                **_thinking(served, thinking={"type": "enabled", "budget_tokens": 1024})}):
        for message in answers:
            calls, text, thinking = _anthropic_parts(message.content)
            _expect_calls(scripted, calls)
            assert (text, thinking) == (scripted.text(), scripted.reasoning()), case
            assert message.stop_reason == ("tool_use" if scripted.calls() else "end_turn")


def _responses_parts(output) -> tuple[list, str, str]:
    calls = [(i.name, json.loads(i.arguments)) for i in output if i.type == "function_call"]
    text = "".join(c.text for i in output if i.type == "message" for c in i.content)
    reasoning = "".join(c.text for i in output if i.type == "reasoning" for c in i.content or [])
    return calls, text, reasoning


def test_responses_whole_and_streamed(served):
    client = _openai(served[1])
    for case, scripted, answers in _whole_and_streamed(
            served, client.responses.create, client.responses.stream, lambda case: {
                "model": "m", "input": _question(case), "tools": RESPONSES_TOOLS,
                "store": False, **_thinking(served, reasoning={"effort": "high"})}):
        for response in answers:
            calls, text, reasoning = _responses_parts(response.output)
            _expect_calls(scripted, calls)
            assert (text, reasoning) == (scripted.text(), scripted.reasoning()), case
            assert response.status == "completed"


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                "function": {"name": "get_time"}}])
def test_a_required_call_is_written_by_the_model_in_its_familys_syntax(served, choice):
    """No replay: the test model itself writes the call, under the grammar of the family's
    syntax (its arguments under their schema), and it comes back parsed."""
    family, server, _ = served
    r = _openai(server).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "What is the time in Tokyo?"}],
        tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, max_tokens=400,
        temperature=0)
    calls, finish = r.choices[0].message.tool_calls, r.choices[0].finish_reason
    assert calls and finish in ("tool_calls", "length"), r.choices[0]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    if finish == "length":  # greedy, the test model may repeat itself inside a string
        (cut,) = calls
        assert cut.function.name in schemas and cut.function.arguments.startswith("{")
    else:
        for called in calls:
            jsonschema.validate(json.loads(called.function.arguments),
                                schemas[called.function.name])
    if isinstance(choice, dict):
        assert {c.function.name for c in calls} == {"get_time"}


def test_auto_holds_any_call_the_model_writes_to_the_grammar(served):
    """No replay, tools offered, the model free: whatever it writes, text or calls in its
    family's syntax (the lazy grammar on from a call's first marker), a call it finishes
    parses and fits its tool's schema."""
    _, server, _ = served
    r = _openai(server).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Say hello, then tell me the time."}],
        tools=TOOLS, max_tokens=200, temperature=0)
    choice = r.choices[0]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    if choice.finish_reason == "tool_calls":
        for called in choice.message.tool_calls:
            jsonschema.validate(json.loads(called.function.arguments),
                                schemas[called.function.name])
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content


def test_the_template_renders_tools_calls_and_reasoning_in_the_models_format(served):
    """Tools in the template's own words, an earlier call as the model writes one, the
    reasoning of the turn that made it where the template keeps it, and the result."""
    family, server, _ = served
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "I need the weather.",
         "tool_calls": [{"id": "call_0123456789abcdef", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "RESULT-42"}]
    status, body = post(server, "/apply-template", {"model": "m", "messages": messages,
                                                     "tools": TOOLS})
    assert status == 200, body
    prompt = body["prompt"]
    assert body["format"] == family_format(family)
    assert "The weather in a city" in prompt  # the tools' definitions
    question = prompt.index("What is the weather in Paris?")
    earlier_call = prompt.index(HISTORY_CALLS[family], question)
    assert prompt.index("RESULT-42") > earlier_call
    if family in HISTORY_REASONING:
        assert HISTORY_REASONING[family] in prompt[question:]


LONG_ANSWER = "The harbour is calm today and every boat is in. " * 12
# Turn 1's answer, and whether the template renders it back as the model wrote it.
REWRITES = {"hermes": (LONG_ANSWER, True),
            "hermes-thinking": ("<think>\n" + "I should describe the harbour. " * 12 +
                                "\n</think>\n\n" + LONG_ANSWER, False)}


@pytest.mark.parametrize("served", list(REWRITES), indirect=True)
def test_what_a_template_that_rewrites_earlier_turns_costs_the_cache(served):
    """Qwen3's template drops the reasoning of earlier turns: the answer the model wrote
    (thinking, then text) is not what the next turn renders, so the next turn reads its
    prompt from the cache up to where that answer began, and computes the rest. A template
    that renders the answer as written (Qwen 2.5's) reads the answer from the cache too."""
    family, server, rules = served
    output, kept = REWRITES[family]
    question = "Describe the harbour for the cache."
    rules.write_text(json.dumps([{"when": question, "output": output},
                                 *json.loads(rules.read_text())]))
    client = _openai(server)
    first = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": question}], max_tokens=400)
    answer = first.choices[0].message
    second = client.chat.completions.create(model="m", max_tokens=4, messages=[
        {"role": "user", "content": question},
        {"role": "assistant", "content": answer.content,
         "reasoning_content": getattr(answer, "reasoning_content", None)},
        {"role": "user", "content": "Thanks."}])
    cached = second.usage.prompt_tokens_details.cached_tokens
    written = first.usage.prompt_tokens + first.usage.completion_tokens
    if kept:
        assert cached >= written - 64  # the whole answer, to its last full block
    else:
        assert first.usage.prompt_tokens - 64 <= cached <= first.usage.prompt_tokens


# A forced Write call's content, and how each API forces it (any tool; the tool named).
FORCED_WRITES = {"c": ("required", {"type": "any"}),
                 "template": ({"type": "function", "function": {"name": "Write"}},
                              {"type": "tool", "name": "Write"})}


@pytest.mark.parametrize("code", FORCED_WRITES)
@pytest.mark.parametrize("served", list(TEXT_CALLS), indirect=True)
def test_a_forced_write_call_holding_code_comes_back_intact(served, local_model, code):
    """A coding agent's Write call, forced, its content C code (`#include <stdio.h>`,
    `a < b`) or a template holding the format's own call markers: the grammar the server holds
    the call to lets it through (llama.cpp's sampler over the test model's tokens), and the
    call the engine replays comes back whole and streamed on the OpenAI API, and streamed on
    Anthropic's, its content intact."""
    family, server, rules = served
    choice, anthropic_choice = FORCED_WRITES[code]
    question, content = f"Write the {code} file main.c for me.", CODE[code]
    output = write_call(family, content)
    named = NamedToolChoice.model_validate(choice) if isinstance(choice, dict) else choice
    assert accepts(local_model, grammar_of(family, named, [WRITE]), output)
    rules.write_text(json.dumps([{"when": question, "output": output},
                                 *json.loads(rules.read_text())]))
    written = [("Write", {"file_path": "main.c", "content": content})]
    messages = [{"role": "user", "content": question}]
    client, claude = _openai(server), _anthropic(server)
    whole = client.chat.completions.create(model="m", messages=messages, tools=[WRITE],
                                           tool_choice=choice)
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in whole.choices[0].message.tool_calls] == written
    arguments = "".join(
        call.function.arguments or "" for chunk in client.chat.completions.create(
            model="m", messages=messages, tools=[WRITE], tool_choice=choice, stream=True)
        for call in chunk.choices[0].delta.tool_calls or [])
    assert json.loads(arguments) == written[0][1]
    ask = {"model": "m", "max_tokens": 400, "messages": messages, "tool_choice": anthropic_choice,
           "tools": [{"name": "Write", "input_schema": WRITE["function"]["parameters"]}]}
    with claude.messages.stream(**ask) as events:  # as Claude Code asks
        assert _anthropic_parts(events.get_final_message().content)[0] == written


def _tool(parameters: object) -> dict:
    return {"type": "function", "function": {"name": "Write", "parameters": parameters}}


# Tools whose parameters no grammar can be made of, or made of faithfully.
MALFORMED = {
    "properties not an object": {"type": "object", "properties": "x"},
    "a property not a schema": {"type": "object", "properties": {"path": "x"}},
    "required not a list of names": {"type": "object", "properties": {
        "path": {"type": "string"}}, "required": "path"},
    "a type JSON schema has not": {"type": "object", "properties": {"path": {"type": "text"}}},
    "a name the format cannot write": {"type": "object", "properties": {
        "<path>": {"type": "string"}}},
}


@pytest.mark.parametrize("served", list(TEXT_CALLS), indirect=True)
def test_a_malformed_tool_schema_is_a_400_before_anything_streams(served):
    """The per-parameter formats check every tool as the JSON ones do: a 400 in each API's
    own shape, asked for a stream, whether a call is required or not; and the server goes on
    serving."""
    _, server, _ = served
    client, claude = _openai(server), _anthropic(server)
    messages = [{"role": "user", "content": "Write main.c."}]
    for case, parameters in MALFORMED.items():
        for choice in ("required", "auto"):
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(model="m", messages=messages, max_tokens=4,
                                               tools=[_tool(parameters)], tool_choice=choice,
                                               stream=True)
            assert refused.value.body["param"] == "tools", (case, choice)
        with pytest.raises(anthropic.BadRequestError) as refused:
            claude.messages.create(model="m", max_tokens=4, messages=messages, tools=[
                {"name": "Write", "input_schema": parameters}], stream=True)
        assert refused.value.body["error"]["type"] == "invalid_request_error", case
    # A keyword no grammar enforces, in a strict tool (in one that is not, it is left to the
    # client: test_call_grammars.py).
    unenforceable = {"type": "object", "properties": {"lines": {"type": "integer", "minimum": 1}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="m", messages=messages, max_tokens=4, stream=True,
                                       tools=[{"type": "function", "function": {
                                           "name": "Write", "parameters": unenforceable,
                                           "strict": True}}])
    assert refused.value.body["param"] == "tools"
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")
