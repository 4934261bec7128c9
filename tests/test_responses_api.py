"""OpenAI's Responses API through the openai SDK, against the real server on loopback: the same
generation path as chat completions (a greedy answer is the same text), function calls (also
namespaced), structured output, streamed events, and what is refused."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from loadtest.gateway_process import GatewayProcess

QUESTION = "What is the capital of France? Answer in one sentence."
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(model_path):
    server = GatewayProcess(model_path, "--parallel", "4", "--ctx-size", "8192",
                            "--temperature", "0")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def test_a_response_is_the_chat_completion_of_the_same_input(client, server):
    response = client.responses.create(
        model=server.model_name, instructions="You are a terse geography tutor.",
        input=[{"role": "developer", "content": "Answer briefly."},
               {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        max_output_tokens=24)
    chat = client.chat.completions.create(
        model=server.model_name, max_tokens=24, messages=[
            {"role": "system", "content": "You are a terse geography tutor.\n\nAnswer briefly."},
            {"role": "user", "content": QUESTION}])
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat.choices[0].message.content
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.instructions == "You are a terse geography tutor."
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                               else "completed")


def test_a_string_input_and_the_length_limit(client, server):
    cut = client.responses.create(model=server.model_name, input=QUESTION, max_output_tokens=3)
    assert cut.status == "incomplete"
    assert cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3 and cut.output_text


def test_a_function_call_round_trip(client, server):
    question = {"role": "user", "content": "What is the weather in Paris?"}
    called = client.responses.create(model=server.model_name, input=[question],
                                     tools=[WEATHER], tool_choice="required",
                                     max_output_tokens=40)
    (call,) = called.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # The test model would call again after the result: "none" asks for the answer in text.
    answer = client.responses.create(model=server.model_name, tools=[WEATHER],
                                     tool_choice="none", max_output_tokens=24, input=[
        question, {"type": "function_call", "call_id": call.call_id, "name": call.name,
                   "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id,
         "output": "18 degrees and sunny"}])
    assert answer.output[0].type == "message" and answer.output_text


def test_a_namespaced_function_comes_back_under_its_namespace(client, server):
    namespace = {"type": "namespace", "name": "crm", "description": "Customer records",
                 "tools": [{"type": "function", "name": "find_customer",
                            "description": "Find a customer by name",
                            "parameters": {"type": "object", "required": ["name"],
                                           "properties": {"name": {"type": "string"}}}}]}
    response = client.responses.create(model=server.model_name, tools=[namespace],
                                       tool_choice="required", max_output_tokens=40,
                                       input="Find the customer Ada Lovelace.")
    (call,) = response.output
    assert call.type == "function_call" and call.name == "find_customer"
    assert call.namespace == "crm"


def test_hosted_tools_are_left_out_and_counted(client, server):
    name = "prefixgate_responses_hosted_tools_left_out_total"
    before = server.labelled(name, "type").get("web_search", 0)
    response = client.responses.create(
        model=server.model_name, input=QUESTION, max_output_tokens=8,
        tools=[{"type": "web_search"}, WEATHER])
    assert response.status in ("completed", "incomplete")
    assert server.labelled(name, "type")["web_search"] == before + 1


def test_text_format_json_schema(client, server):
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
              "properties": {"city": {"type": "string", "maxLength": 30},
                             "country": {"type": "string", "maxLength": 30}}}
    response = client.responses.create(
        model=server.model_name, input="Name a city and its country.", max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "place", "schema": schema}})
    jsonschema.validate(json.loads(response.output_text), schema)


def test_a_stream_is_the_whole_response_in_typed_events(client, server):
    request = {"model": server.model_name, "input": QUESTION, "max_output_tokens": 24}
    whole = client.responses.create(**request)
    with client.responses.stream(**request) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == whole.output_text
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]
    assert {"response.output_text.delta"} == set(kinds[4:-4])
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_a_streamed_function_call(client, server):
    with client.responses.stream(model=server.model_name, tools=[WEATHER],
                                 tool_choice="required", max_output_tokens=40,
                                 input="What is the weather in Oslo?") as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    (call,) = final.output
    assert call.type == "function_call" and json.loads(call.arguments)["city"]


@pytest.mark.parametrize(("fields", "param"), [
    ({"background": True}, "background"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}]}, "input[0].content"),
    ({"input": [{"type": "computer_call_output", "call_id": "x", "output": {}}]},
     "input[0].type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     "text.format"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ({"prompt_cache_options": {"prewarm": True}}, "prompt_cache_options.prewarm"),
    ({"context_management": [{"type": "compaction", "compact_threshold": 2}]},
     "context_management[0]"),
])
def test_what_cannot_be_served_is_a_400_naming_it(client, server, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**{"model": server.model_name, "input": "hi", **fields})
    assert refused.value.body["param"].startswith(param)


def test_previous_response_id_continues_from_the_exact_tokens(client, server):
    """Turn 2 starts from turn 1's own tokens (its prompt's and its generated ones): all of
    turn 1 loads from the cache."""
    first = client.responses.create(model=server.model_name, max_output_tokens=40,
                                    instructions="You are a terse geography tutor.",
                                    input="Name a large city in France.")
    second = client.responses.create(model=server.model_name, max_output_tokens=24,
                                     instructions="You are a terse geography tutor.",
                                     previous_response_id=first.id,
                                     input="And one in Italy?")
    history = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 0.9 * history
    assert second.usage.input_tokens > history
    assert second.previous_response_id == first.id
    # Other instructions: rendered afresh, the conversation still continued.
    third = client.responses.create(model=server.model_name, max_output_tokens=8,
                                    instructions="You are a historian.",
                                    previous_response_id=second.id, input="Thanks.")
    assert third.usage.input_tokens > second.usage.input_tokens


def test_a_chained_turn_is_stored_as_what_it_adds(client, server):
    """Each turn continued with previous_response_id adds about as many stored bytes as the
    first (what it adds, not its whole history again); a turn whose parent was deleted still
    continues from its whole history; deleting every turn frees them all."""
    def stored_bytes() -> float:
        return server.metrics()["prefixgate_response_store_bytes"]

    baseline, added, turns = stored_bytes(), [], []
    for i in range(4):
        before = stored_bytes()
        turns.append(client.responses.create(
            model=server.model_name, max_output_tokens=4, input=f"Note {i}: " + " ".join(
                f"the {w} crossed the bay on day {i}." for w in ("ferry", "barge", "tug")) * 8,
            previous_response_id=turns[-1].id if turns else None))
        added.append(stored_bytes() - before)
    assert max(added[1:]) < 1.5 * added[0], added
    client.responses.delete(turns[2].id)  # the fourth's parent
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(turns[2].id)
    assert stored_bytes() == baseline + sum(added)  # still the fourth's history
    fifth = client.responses.create(model=server.model_name, max_output_tokens=4,
                                    previous_response_id=turns[3].id, input="Which was first?")
    history = turns[3].usage.input_tokens + turns[3].usage.output_tokens
    assert fifth.usage.input_tokens > history
    assert fifth.usage.input_tokens_details.cached_tokens >= 0.9 * history
    for turn in (*turns[:2], turns[3], fifth):
        client.responses.delete(turn.id)
    assert stored_bytes() == baseline


def test_stored_responses_are_retrieved_listed_and_deleted(client, server):
    items = [{"role": "developer", "content": "Answer briefly."},
             {"role": "user", "content": "Name a colour."},
             {"role": "user", "content": "And a fruit."}]
    created = client.responses.create(model=server.model_name, input=items,
                                      max_output_tokens=8)
    got = client.responses.retrieve(created.id)
    assert got.id == created.id and got.output_text == created.output_text
    listed = client.responses.input_items.list(created.id, limit=2, order="asc")
    assert [i.role for i in listed.data] == ["developer", "user"] and listed.has_more
    rest = client.responses.input_items.list(created.id, limit=2, order="asc",
                                             after=listed.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["And a fruit."] and not rest.has_more
    newest_first = client.responses.input_items.list(created.id)
    assert [i.id for i in newest_first.data] == [i.id for i in [*listed.data, *rest.data]][::-1]
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    unstored = client.responses.create(model=server.model_name, input="Hi", store=False,
                                       max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=server.model_name, input="Hi", max_output_tokens=4,
                                previous_response_id=unstored.id)
    metrics = server.metrics()
    assert metrics["prefixgate_response_store_entries"] >= 1
    assert metrics["prefixgate_response_store_bytes"] > 0


def test_a_stored_response_belongs_to_its_tenant(model_path, tmp_path):
    """Another key gets a 404 for it on GET, DELETE and input_items, and cannot continue it
    (the error an unknown id gets), even a key whose tenant shares the cache namespace
    (--shared-prefix-tenants): a response is bound to its tenant, not to the namespace."""
    keys = tmp_path / "keys"
    keys.write_text("key-a tenant-a\nkey-b tenant-b\nkey-c tenant-c\nkey-d tenant-d\n")
    server = GatewayProcess(model_path, "--parallel", "2", "--ctx-size", "2048",
                            "--api-keys-file", str(keys),
                            "--shared-prefix-tenants", "tenant-c,tenant-d")
    try:
        clients = {key: openai.OpenAI(base_url=server.base_url + "/v1", api_key=f"key-{key}",
                                      max_retries=0) for key in "abcd"}
        created = {key: clients[key].responses.create(model=server.model_name, input="Hi",
                                                      max_output_tokens=4)
                   for key in "abcd"}
        with pytest.raises(openai.BadRequestError) as unknown:
            clients["a"].responses.create(model=server.model_name, input="Go on",
                                          max_output_tokens=4,
                                          previous_response_id="resp_" + "0" * 32)
        for owner, other in ("ab", "ba", "cd", "dc"):
            response_id, client = created[owner].id, clients[other]
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(response_id)
            with pytest.raises(openai.NotFoundError):
                client.responses.input_items.list(response_id)
            with pytest.raises(openai.NotFoundError):
                client.responses.delete(response_id)
            with pytest.raises(openai.BadRequestError) as refused:
                client.responses.create(model=server.model_name, input="Go on",
                                        max_output_tokens=4, previous_response_id=response_id)
            assert refused.value.body["code"] == unknown.value.body["code"] \
                == "previous_response_not_found"
        for key, client in clients.items():  # each still has its own, whole
            assert client.responses.retrieve(created[key].id).id == created[key].id
            assert client.responses.input_items.list(created[key].id).data
            assert client.responses.create(model=server.model_name, input="Go on",
                                           max_output_tokens=4,
                                           previous_response_id=created[key].id).output
    finally:
        server.stop()


def test_stored_responses_survive_a_restart_under_cache_dir(model_path, tmp_path):
    """Written at shutdown owner-only, read back at start: a conversation continues across a
    restart, its history read from the prefix cache's snapshot. A file that does not parse is
    refused, and the server serves on."""
    cache_dir = tmp_path / "cache"
    args = ("--parallel", "2", "--ctx-size", "2048", "--cache-dir", str(cache_dir))
    server = GatewayProcess(model_path, *args)
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        first = client.responses.create(model=server.model_name, max_output_tokens=16,
                                        input="Name a large city in France.")
    finally:
        server.stop()
    stored = cache_dir / "responses.json"
    assert stored.stat().st_mode & 0o777 == 0o600 and cache_dir.stat().st_mode & 0o777 == 0o700
    server = GatewayProcess(model_path, *args)
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        assert client.responses.retrieve(first.id).output_text == first.output_text
        second = client.responses.create(model=server.model_name, max_output_tokens=8,
                                         previous_response_id=first.id, input="And in Italy?")
        history = first.usage.input_tokens + first.usage.output_tokens
        assert second.usage.input_tokens_details.cached_tokens >= 0.9 * history - 64
    finally:
        server.stop()
    stored.write_bytes(stored.read_bytes()[:-10])  # cut short
    server = GatewayProcess(model_path, *args)
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)
        assert client.responses.create(model=server.model_name, input="Hi",
                                       max_output_tokens=4).output_text is not None
    finally:
        server.stop()


def test_logprobs_and_the_cache_key_as_codex_sends_it(client, server):
    """include message.output_text.logprobs with top_logprobs: OpenAI's shape per token; a
    prompt_cache_key routes as on chat completions (counted)."""
    before = server.metrics()["prefixgate_prompt_cache_key_requests_total"]
    response = client.responses.create(
        model=server.model_name, input=QUESTION, max_output_tokens=6, top_logprobs=2,
        include=["message.output_text.logprobs"], prompt_cache_key="session-1")
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) == response.usage.output_tokens
    assert "".join(entry.token for entry in logprobs) == response.output_text
    assert all(entry.logprob <= 0 and len(entry.top_logprobs) == 2 for entry in logprobs)
    assert server.metrics()["prefixgate_prompt_cache_key_requests_total"] == before + 1


def test_the_fields_the_current_sdk_sends_are_accepted(client, server):
    """Every field of openai 3.63's ResponseCreateParams that has no meaning here is accepted
    (before, each was a 400 "unknown parameter"), with the tools' and items' newer fields: the
    answer is the one without them. A compaction threshold the input is below changes nothing."""
    tool = {**WEATHER, "strict": True}
    plain = client.responses.create(model=server.model_name, input=QUESTION, max_output_tokens=12,
                                    tools=[tool], tool_choice="none")
    fields = {
        "model": server.model_name, "max_output_tokens": 12, "tool_choice": "none",
        "tools": [{**tool, "allowed_callers": ["direct"], "output_schema": {"type": "object"}},
                  {"type": "computer"}, {"type": "programmatic_tool_calling"}],
        "input": [{"role": "user", "content": [{
            "type": "input_text", "text": QUESTION,
            "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"}}]}],
        "prompt_cache_options": {"mode": "explicit", "ttl": "12h",
                                 "comparison_response_id": plain.id, "prewarm": False},
        "access_programs": {"cyber": "standard"}, "image": {"context_compression": "auto"},
        "background_options": {"completion_window": "soonest"},
        "context_management": [{"type": "compaction", "compact_threshold": 100_000}],
        "service_tier": "flex"}
    response = client.responses.create(**fields)
    assert response.output_text == plain.output_text
    with client.responses.stream(**fields, stream_options={"include_obfuscation": False}
                                 ) as stream:
        assert stream.get_final_response().output_text == plain.output_text
    history = [{"role": "user", "content": "What is the weather in Oslo?"},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                "arguments": '{"city": "Oslo"}', "caller": {"type": "direct"}},
               {"type": "function_call_output", "call_id": "call_1", "output": "4 degrees",
                "caller": {"type": "direct"}, "name": "get_weather"}]
    answer = client.responses.create(model=server.model_name, input=history, tools=[tool],
                                     tool_choice="none", max_output_tokens=8)
    assert answer.output_text
