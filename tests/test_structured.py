"""Structured outputs: every greedy and sampled answer to a json_schema response_format parses
and validates against the schema; json_object gives JSON; what cannot be enforced is a 400."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

SCHEMAS = {
    "nested object": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "address": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "array of enums": {
        "type": "object",
        "properties": {"colours": {"type": "array", "minItems": 1, "maxItems": 4,
                                   "items": {"enum": ["red", "green", "blue"]}}},
        "required": ["colours"], "additionalProperties": False},
    "required and optional": {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 30},
                       "year": {"type": "integer"}, "rating": {"type": "number"},
                       "available": {"type": "boolean"}},
        "required": ["title", "year", "available"], "additionalProperties": False},
}


def structured(client, model, schema, **sampling):
    r = client.chat.completions.create(
        model=model, max_tokens=200, messages=[
            {"role": "user", "content": "Describe a book, a person or colours as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": schema}}, **sampling)
    return r.choices[0]


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_output_validates_against_its_schema(client, model_name, name):
    schema = SCHEMAS[name]
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 1},
                     {"temperature": 1.0, "seed": 2}):
        choice = structured(client, model_name, schema, **sampling)
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_gives_json(client, model_name):
    """Every answer that ends by itself is a JSON object. (Sampled, an answer may also run into
    max_tokens, which cuts it anywhere: which seed does depends on what the cache holds.)"""
    finished = 0
    for seed in (3, 4, 5):
        r = client.chat.completions.create(
            model=model_name, max_tokens=200, temperature=0.7, seed=seed,
            messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
            response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":
            finished += 1
            assert isinstance(json.loads(r.choices[0].message.content), dict)
    assert finished


@pytest.mark.parametrize("keyword,schema", [
    ("minimum", {"type": "integer", "minimum": 3}),
    ("uniqueItems", {"type": "array", "items": {"type": "string"}, "uniqueItems": True}),
    ("not", {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}),
])
def test_a_keyword_that_cannot_be_enforced_is_a_400_naming_it(client, model_name, keyword,
                                                              schema):
    with pytest.raises(openai.BadRequestError) as raised:
        structured(client, model_name, schema)
    assert f"'{keyword}'" in raised.value.body["message"]
    assert raised.value.body["param"] == "response_format.json_schema"


@pytest.mark.parametrize("json_schema", [
    {"schema": {"type": "object"}},  # OpenAI requires a name
    {"name": "has spaces", "schema": {"type": "object"}},
    {"name": "x" * 65, "schema": {"type": "object"}},
])
def test_a_json_schema_needs_a_name_as_openai_requires(client, model_name, json_schema):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=model_name, max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
            response_format={"type": "json_schema", "json_schema": json_schema})
    assert raised.value.body["param"] == "response_format.json_schema.name"


@pytest.mark.parametrize("ending", [{"ignore_eos": True}, {"min_tokens": 200}])
def test_a_finished_grammar_ends_the_request_even_when_the_end_is_suppressed(
        client, gateway, model_name, ending):
    """Once the JSON is complete the grammar allows only the end, which ignore_eos and
    min_tokens suppress: the request ends there, with valid JSON, and the worker serves on.
    (Before, the sampler took an arbitrary token the grammar could not accept.) The schema
    leaves one boolean to choose, so the object completes within a few tokens on any machine
    (free JSON at temperature 1 wanders for hundreds of grammar-checked tokens)."""
    flag = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": False}
    restarts = [w["restarts"] for w in gateway.health()[1]["workers"]]
    for seed in range(3):
        r = client.chat.completions.create(
            model=model_name, max_tokens=300, temperature=1.0, seed=seed,
            messages=[{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "flag", "schema": flag}},
            extra_body=ending)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (choice.message.content, r.usage)
        assert isinstance(json.loads(choice.message.content)["ok"], bool)
        assert r.usage.completion_tokens < 300
    assert [w["restarts"] for w in gateway.health()[1]["workers"]] == restarts
    assert gateway.health()[1]["status"] == "ok"
    gateway.settled()


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "bio": {"type": "string"}},
          "required": ["name", "bio"], "additionalProperties": False}


def test_sampled_strings_are_json_strings(client, model_name):
    """No raw control character (a newline, say) inside a string: every answer that ended on
    its own parses. (Before, llama-cpp-python's converter let them in: 3 of 12 were invalid.)"""
    finished = 0
    for seed in range(12):
        r = client.chat.completions.create(
            model=model_name, max_tokens=200, temperature=0.9, seed=seed,
            messages=[{"role": "user", "content": "Invent a person."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": PERSON}})
        if r.choices[0].finish_reason == "stop":
            finished += 1
            jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    assert finished >= 6


@pytest.mark.parametrize("keyword,schema", [
    ("maxLength", {"type": "string", "maxLength": 100_000_000}),
    ("pattern", {"type": "string", "pattern": "^a{0,100000000}$"}),
    ("minItems", {"type": "array", "items": {"type": "string"}, "minItems": 1_000_000}),
])
def test_a_repetition_bomb_is_a_400_before_any_grammar_is_built(client, model_name, keyword,
                                                                  schema):
    """Past llama.cpp's own cap of 2,000 repetitions. (Before, the converter wrote them out on
    the event loop: 8 MB of grammar per million.) A strict tool's forced call is refused the
    same; one that is not strict is called without the bound, left to the client."""
    with pytest.raises(openai.BadRequestError) as raised:
        structured(client, model_name, {"type": "object", "properties": {"x": schema}})
    assert f"'{keyword}'" in raised.value.body["message"]
    function = {"name": "f", "parameters": {"type": "object", "properties": {"x": schema},
                                            "required": ["x"]}}
    forced = {"type": "function", "function": {"name": "f"}}
    with pytest.raises(openai.BadRequestError) as raised:  # a forced call builds one too
        client.chat.completions.create(
            model=model_name, max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
            tools=[{"type": "function", "function": {**function, "strict": True}}],
            tool_choice=forced)
    assert f"'{keyword}'" in raised.value.body["message"]
    r = client.chat.completions.create(
        model=model_name, max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
        tools=[{"type": "function", "function": function}], tool_choice=forced)
    assert r.choices[0].finish_reason in ("length", "stop")
