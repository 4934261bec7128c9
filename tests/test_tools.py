"""Tool calls with the official SDK on the default model: a required or named call returns
arguments that validate against the tool's parameters, whole and streamed (assembled by the
SDK's own accumulator), and a turn with the tool's result is accepted."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Oulu today?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def validate(call, tools) -> None:
    spec = next(t["function"] for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), spec["parameters"])


@pytest.mark.parametrize("choice", [NAMED, "required"], ids=["named", "required"])
def test_a_forced_call_validates_whole(client, model_name, choice):
    tools = [WEATHER, TIME]
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 5}):
        r = client.chat.completions.create(model=model_name, messages=ASK, tools=tools,
                                           tool_choice=choice, max_tokens=120, **sampling)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and message.content is None
        (call,) = message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        if choice == NAMED:
            assert call.function.name == "get_weather"
        validate(call, tools)


def test_a_streamed_call_assembles_with_the_sdks_accumulator(client, model_name):
    state = ChatCompletionStreamState(input_tools=[WEATHER])
    roles = []
    for chunk in client.chat.completions.create(model=model_name, messages=ASK,
                                                tools=[WEATHER], tool_choice=NAMED,
                                                max_tokens=120, temperature=0, stream=True):
        state.handle_chunk(chunk)
        roles += [c.delta.role for c in chunk.choices if c.delta.role]
    assert roles == ["assistant"]  # once, as OpenAI sends it
    final = state.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    validate(call, [WEATHER])
    whole = client.chat.completions.create(model=model_name, messages=ASK, tools=[WEATHER],
                                           tool_choice=NAMED, max_tokens=120, temperature=0)
    assert json.loads(whole.choices[0].message.tool_calls[0].function.arguments) == \
        json.loads(call.function.arguments)


def test_a_turn_with_the_tools_result_is_accepted(client, model_name):
    first = client.chat.completions.create(model=model_name, messages=ASK, tools=[WEATHER],
                                           tool_choice=NAMED, max_tokens=120, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny", "c": 18}'}]
    answer = client.chat.completions.create(model=model_name, messages=history,
                                            tools=[WEATHER], max_tokens=24, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_none_and_unknown_names(client, model_name):
    plain = client.chat.completions.create(model=model_name, messages=ASK, tools=[WEATHER],
                                           tool_choice="none", max_tokens=8, temperature=0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=model_name, messages=ASK, tools=[WEATHER],
                                       tool_choice={"type": "function",
                                                    "function": {"name": "nope"}},
                                       max_tokens=8)
    assert raised.value.body["param"] == "tool_choice"


def test_a_named_call_of_two_short_fields_fits_in_20_tokens(client, model_name):
    """The model writes only the arguments; the gateway writes the call around them. (Before,
    the model wrote the wrapper too: 25 tokens, and nothing came back at 24.)"""
    r = client.chat.completions.create(model=model_name, messages=ASK, tools=[WEATHER],
                                       tool_choice=NAMED, max_tokens=20, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls" and r.usage.completion_tokens <= 20
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    validate(call, [WEATHER])


def test_a_named_call_cut_short_comes_back_as_openai_returns_it(client, model_name):
    """tool_calls with the arguments as far as they got and finish_reason length: never the
    call's JSON as content."""
    whole = client.chat.completions.create(model=model_name, messages=ASK, tools=[WEATHER],
                                           tool_choice=NAMED, max_tokens=20, temperature=0)
    cut = client.chat.completions.create(model=model_name, messages=ASK, tools=[WEATHER],
                                         tool_choice=NAMED, max_tokens=3, temperature=0)
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments
    full = whole.choices[0].message.tool_calls[0].function.arguments
    assert json.loads(full)  # the whole one parses; the cut one is where it stopped
    assert call.function.arguments.replace(" ", "") in full.replace(" ", "")


def test_a_call_cut_short_sent_back_renders_as_an_empty_object(client, model_name):
    """A client replays our own answer, cut by max_tokens, in the next turn's history: its
    arguments are not JSON. Rendered as an empty object, as Responses and Messages render
    theirs, not a 400 for the template (chat alone refused it before)."""
    cut = client.chat.completions.create(model=model_name, messages=ASK, tools=[WEATHER],
                                         tool_choice=NAMED, max_tokens=3, temperature=0)
    call = cut.choices[0].message.tool_calls[0].model_dump()
    with pytest.raises(json.JSONDecodeError):
        json.loads(call["function"]["arguments"])

    def prompt_tokens(arguments: str) -> int:
        replayed = {**call, "function": {**call["function"], "arguments": arguments}}
        history = ASK + [{"role": "assistant", "content": None, "tool_calls": [replayed]},
                         {"role": "tool", "tool_call_id": call["id"], "content": "cut short"}]
        return client.chat.completions.create(model=model_name, messages=history,
                                              tools=[WEATHER], max_tokens=1).usage.prompt_tokens

    assert prompt_tokens(call["function"]["arguments"]) == prompt_tokens("{}")


def test_auto_with_tools_still_answers_text(client, model_name):
    """Offered tools it has no use for, the model answers in text, streamed as it comes."""
    ask = {"model": model_name, "tools": [WEATHER, TIME], "tool_choice": "auto",
           "messages": [{"role": "user", "content": "Say hello to the harbour master."}],
           "max_tokens": 24, "temperature": 0}
    whole = client.chat.completions.create(**ask)
    assert whole.choices[0].message.tool_calls is None and whole.choices[0].message.content
    chunks = [c.choices[0].delta.content for c in client.chat.completions.create(
        **ask, stream=True) if c.choices and c.choices[0].delta.content]
    assert len(chunks) > 1 and "".join(chunks) == whole.choices[0].message.content
