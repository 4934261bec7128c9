"""OpenAI's chat completions, completions and models: each request translated onto the one
generation path (gateway/core/generation.py), its outputs worded by gateway/openai/wire.py."""

from __future__ import annotations

import asyncio
import dataclasses

from aiohttp import web

from gateway.core.generation import generate, json_response, read_body
from gateway.core.service import Gateway
from gateway.formats.chat_formats import Reasoning
from gateway.formats.prompts import RenderedPrompt, breakpoint_pins
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
    body = await read_body(request, ChatCompletionRequest)
    prompt = await chat_prompt(gateway, body, with_pins=True)
    wire = ChatWire(body.model, _token_bytes(gateway, body), body.include_usage, prompt.parser)
    return await generate(request, body, prompt, wire)


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    gateway: Gateway = request.app["gateway"]
    body = await read_body(request, CompletionRequest)
    prompt = await completion_prompt(gateway, body)
    wire = CompletionWire(body.model, _token_bytes(gateway, body), body.include_usage)
    return await generate(request, body, prompt, wire)


async def chat_prompt(gateway: Gateway, body: ChatCompletionRequest,
                      with_pins: bool = False) -> RenderedPrompt:
    """The prompt of a chat completion (POST /v1/chat/completions and /v1/cache/explain)."""
    # Rendering and tokenizing a long prompt takes milliseconds: off the loop, streams keep going.
    return await asyncio.to_thread(_chat_prompt, gateway, body, with_pins)


def _chat_prompt(gateway: Gateway, body: ChatCompletionRequest,
                 with_pins: bool) -> RenderedPrompt:
    """The prompt, and with `with_pins` a pin per prompt_cache_breakpoint."""
    reasoning = Reasoning.of_effort(body.reasoning_effort)
    prompt = gateway.prompts.chat(body.messages, body.toolbox, reasoning)
    if not with_pins:
        return prompt
    pins = breakpoint_pins(
        prompt.tokens, [((m, p), seconds) for m, p, seconds in body.cache_breakpoints()],
        lambda cut: gateway.prompts.chat(body.cut(*cut), body.toolbox, reasoning).tokens,
        gateway.config.workers.pin_hours * 3600)
    return dataclasses.replace(prompt, pins=pins)


async def completion_prompt(gateway: Gateway, body: CompletionRequest) -> RenderedPrompt:
    """The prompt of a completion (POST /v1/completions and /v1/cache/explain)."""
    return await asyncio.to_thread(gateway.prompts.completion, body.single_prompt())


def _token_bytes(gateway: Gateway, body: ChatCompletionRequest | CompletionRequest):
    """What a wire spells tokens with, when the request asked for logprobs."""
    return gateway.model.token_piece if body.logprob_count() is not None else None
