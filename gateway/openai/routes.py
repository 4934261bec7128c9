"""OpenAI's chat completions, completions and models: each request translated onto the one
generation path (gateway/core/generation.py), its outputs worded by gateway/openai/wire.py."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
from aiohttp import web

from cache.tokens import common_prefix
from gateway.core.generation import Pin, Plan, admit, generate, json_response
from gateway.core.requests import parse_request
from gateway.core.service import Gateway
from gateway.edge.errors import APIError, invalid
from gateway.formats.chat_formats import OutputParser, Reasoning, call_grammar_of
from gateway.formats.prompts import ChatPrompt
from gateway.openai.requests import ChatCompletionRequest, CompletionRequest
from gateway.openai.wire import ChatWire, CompletionWire

routes = web.RouteTableDef()


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    gateway: Gateway = request.app["gateway"]
    return json_response({"object": "list", "data": [{
        "id": gateway.config.model_name, "object": "model", "created": 0,
        "owned_by": "prefixgate"}]})


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    gateway: Gateway = request.app["gateway"]
    body = parse_request(ChatCompletionRequest, await request.read())
    gateway.require_model(body.model)
    admit(request)
    prompt = await chat_prompt(gateway, body)
    pins = await asyncio.to_thread(_breakpoint_pins, gateway, body, prompt.tokens)
    wire = ChatWire(body.model, _token_bytes(gateway, body), body.include_usage, prompt.parser)
    return await generate(request, prompt.tokens,
                          _planner(request, body, prompt.tokens, prompt.parser, pins), wire)


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    gateway: Gateway = request.app["gateway"]
    body = parse_request(CompletionRequest, await request.read())
    gateway.require_model(body.model)
    admit(request)
    prompt_tokens = await completion_prompt(gateway, body)
    wire = CompletionWire(body.model, _token_bytes(gateway, body), body.include_usage)
    return await generate(request, prompt_tokens, _planner(request, body, prompt_tokens), wire)


async def chat_prompt(gateway: Gateway, body: ChatCompletionRequest) -> ChatPrompt:
    """The prompt of a chat completion (POST /v1/chat/completions and /v1/cache/explain)."""
    # Rendering and tokenizing a long prompt takes milliseconds: off the loop, streams keep going.
    return await asyncio.to_thread(gateway.prompts.chat, body.messages, body.toolbox,
                                   Reasoning.of_effort(body.reasoning_effort))


async def completion_prompt(gateway: Gateway, body: CompletionRequest) -> list[int]:
    """The prompt tokens of a completion (POST /v1/completions and /v1/cache/explain)."""
    try:
        return await asyncio.to_thread(gateway.prompts.completion, body.single_prompt())
    except ValueError as exc:
        raise invalid(str(exc), "prompt") from None


def _breakpoint_pins(gateway: Gateway, body: ChatCompletionRequest,
                     tokens: list[int]) -> tuple[Pin, ...]:
    """A pin per prompt_cache_breakpoint, for its TTL (at most --pin-hours), as far into the
    prompt as the conversation cut after its part renders the same tokens (whatever the
    template writes around the parts). A cut the template cannot render pins nothing."""
    pins = []
    whole, longest = np.asarray(tokens), gateway.config.workers.pin_hours * 3600
    for m, p, seconds in body.cache_breakpoints():
        try:
            cut = gateway.prompts.chat(body.cut(m, p), body.toolbox,
                                       Reasoning.of_effort(body.reasoning_effort)).tokens
        except APIError:
            continue
        pins.append(Pin(common_prefix(whole, np.asarray(cut)), min(seconds, longest)))
    return tuple(pins)


def _token_bytes(gateway: Gateway, body: ChatCompletionRequest | CompletionRequest):
    """What a wire spells tokens with, when the request asked for logprobs."""
    return gateway.model.token_piece if body.logprob_count() is not None else None


def _planner(request: web.Request, body: ChatCompletionRequest | CompletionRequest,
             prompt_tokens: list[int], parser: OutputParser | None = None,
             breakpoints: tuple[Pin, ...] = ()):
    gateway: Gateway = request.app["gateway"]

    def plan() -> Plan:
        generation = body.to_generation(
            prompt_tokens, gateway.workers.seq_len, gateway.model.n_vocab,
            gateway.config.limits.max_tokens, request["namespace"], gateway.config.sampling,
            call_grammar_of(parser))
        if predicted := body.predicted_text():
            generation = dataclasses.replace(generation, prediction=tuple(
                gateway.model.tokenize(predicted, add_special=False, parse_special=False)))
        # "24h" keeps the prompt's blocks past LRU (OpenAI's extended retention).
        pins = (Pin(len(prompt_tokens), gateway.config.workers.pin_hours * 3600),) \
            if body.prompt_cache_retention == "24h" else ()
        return Plan(generation, body.n or 1, body.stream, body.prompt_cache_key,
                    pins + breakpoints)

    return plan
