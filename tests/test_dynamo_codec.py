"""The engine's request and output dataclasses through JSON (gateway/dynamo/codec.py), as they
cross Dynamo's request plane between a front and a node: equal after the round trip, and
anything else refused."""

from __future__ import annotations

import json

import pytest

from engine.messages import GenerationRequest, Output, SamplerSettings, TokenLogprob, Usage
from gateway.config import SamplingDefaults
from gateway.core.requests import Serving
from gateway.dynamo import codec
from gateway.dynamo.requests import PLANNED, DynamoRequest, Planned, UnsupportedRequest
from gateway.formats.prompts import Pin


def through_json(kind, value):
    return codec.decode(kind, json.loads(json.dumps(codec.encode(value))))


def test_a_plan_comes_through_whole():
    generation = GenerationRequest(
        prompt_tokens=[1, 2, 3], max_tokens=7,
        sampler=SamplerSettings(temperature=0.5, seed=3, grammar='root ::= "a"',
                                grammar_triggers=("<tool_call>",)),
        stop=["\n\n"], logit_bias={42: -100.0, 7: 2}, namespace="tenant:a", logprobs=2,
        shown_tokens=frozenset({5, 9}), prediction=(4, 5), history=(6,))
    planned = Planned(generation, (Pin(32, 300.0),))
    assert through_json(Planned, planned) == planned


def test_an_output_comes_through_whole():
    output = Output(text="hé", finish_reason="stop", stop_sequence="\n", generated=(1, 2),
                    usage=Usage(3, 2, cached_tokens=1), token_ids=(2,), n_generated=2,
                    logprobs=(TokenLogprob(2, -0.5, ((2, -0.5), (9, -1.25))),))
    assert through_json(Output, output) == output


@pytest.mark.parametrize("value", [{"max_tokens": 1}, {"prompt_tokens": [], "max_tokens": "1"},
                                   {"prompt_tokens": [], "max_tokens": 1, "evil": 1}])
def test_anything_else_is_refused(value):
    with pytest.raises(ValueError):
        codec.decode(GenerationRequest, value)


def test_a_node_runs_the_plan_on_the_request_s_prompt_and_salt():
    generation = GenerationRequest(prompt_tokens=[9, 9], max_tokens=4, namespace="other")
    body = {"token_ids": [1, 2, 3], "routing": {"cache_salt": "tenant:a"},
            "extra_args": json.loads(json.dumps(Planned(generation, (Pin(3, 60.0),))
                                                .extra_args()))}
    assert body["extra_args"][PLANNED]["generation"]["prompt_tokens"] == []  # sent once
    request = DynamoRequest.of(body)
    assert request.planned.pins == (Pin(3, 60.0),)
    serving = Serving(8, 100, None, SamplingDefaults(), request.namespace)
    assert request.planned_generation(serving) == GenerationRequest(
        prompt_tokens=[1, 2, 3], max_tokens=4, namespace="tenant:a")
    # A node with less room: fewer completion tokens, as any request gets; none, refused.
    assert request.planned_generation(Serving(5, 100, None, SamplingDefaults(), "")
                                      ).max_tokens == 2
    with pytest.raises(UnsupportedRequest, match="maximum context length is 3"):
        request.planned_generation(Serving(3, 100, None, SamplingDefaults(), ""))
    with pytest.raises(UnsupportedRequest, match="max_tokens is too large"):  # --max-tokens
        request.planned_generation(Serving(8, 100, 2, SamplingDefaults(), ""))


def planned(generation: GenerationRequest, pins=(), salt: str = "tenant:a") -> DynamoRequest:
    return DynamoRequest.of({"token_ids": [1, 2, 3], "routing": {"cache_salt": salt},
                             "extra_args": json.loads(json.dumps(
                                 Planned(generation, pins).extra_args()))})


SERVING = Serving(64, 2000, None, SamplingDefaults(), "tenant:a")


@pytest.mark.parametrize("asks", [
    {"logit_bias": {2000: 1.0}}, {"shown_tokens": frozenset({-1})},
    {"prediction": (5, 2000)}, {"history": (2000,)}, {"sampler": SamplerSettings(script=(5,))},
    {"stop": ["x"] * 65}, {"stop": ["x" * 4097]}, {"logit_bias": {i: 1.0 for i in range(1025)}},
    {"logprobs": 21}, {"history": (1,) * 1025},
    {"sampler": SamplerSettings(grammar_triggers=("<a>",) * 65)},
])
def test_a_plan_asking_what_a_local_request_cannot_is_refused(asks):
    """A peer on Dynamo's request plane gets no more from a node than its own API gives: token
    ids in the vocabulary (the engine decodes drafts and indexes logits by them), bounded lists,
    no test hook."""
    request = planned(GenerationRequest(prompt_tokens=[], max_tokens=4, **asks))
    with pytest.raises(UnsupportedRequest):
        request.planned_generation(SERVING)


def test_a_plans_pins_are_a_local_requests():
    request = planned(GenerationRequest(prompt_tokens=[], max_tokens=4),
                      (Pin(3, 300.0), Pin(1_000_000, 1e12), Pin(-5, 60.0)))
    assert request.planned_pins(3600.0) == (Pin(3, 300.0), Pin(3, 3600.0), Pin(0, 60.0))
    with pytest.raises(UnsupportedRequest):
        planned(GenerationRequest(prompt_tokens=[], max_tokens=4),
                (Pin(3, 60.0),) * 6).planned_pins(3600.0)


@pytest.mark.parametrize("salt", ["tenant:a", "shared"])
def test_a_request_from_elsewhere_never_takes_a_fronts_tenant_namespace(salt):
    """Dynamo's frontend lets its clients choose their cache salt: none of them reads the
    blocks of a front's tenant."""
    with pytest.raises(UnsupportedRequest):
        DynamoRequest.of({"token_ids": [1, 2, 3], "routing": {"cache_salt": salt}})
    assert DynamoRequest.of({"token_ids": [1, 2, 3], "routing": {"cache_salt": "team:a"}}
                            ).namespace == "team:a"
    with pytest.raises(UnsupportedRequest):
        DynamoRequest.of({"token_ids": [1, 2, 3], "routing": {"cache_salt": ["tenant:a"]}})


@pytest.mark.parametrize("body", [
    {"sampling_options": {"temperature": "hot"}}, {"sampling_options": {"seed": 1.5}},
    {"stop_conditions": {"max_tokens": "8"}}, {"stop_conditions": {"stop": ["x"] * 65}},
    {"stop_conditions": {"stop": [7]}}, {"output_options": {"logprobs": 1000}},
])
def test_a_request_from_elsewhere_is_held_to_the_same_bounds_and_types(body):
    """Dynamo's frontend types its requests, but any peer may send one: a node's engine gets
    nothing its own API would refuse."""
    request = DynamoRequest.of({"token_ids": [1, 2, 3], **body})
    with pytest.raises(UnsupportedRequest):
        request.to_generation(SERVING, frozenset())
