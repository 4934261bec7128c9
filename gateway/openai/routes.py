"""OpenAI's chat completions, completions and models: each request translated onto the one
generation path (gateway/core/generation.py), its outputs worded by gateway/openai/wire.py."""

from __future__ import annotations

import asyncio
import dataclasses

from aiohttp import web

from gateway.core.generation import generate, json_response, read_body
from gateway.core.models import ServedModel
from gateway.core.service import Gateway
from gateway.formats.chat_formats import Reasoning
from gateway.formats.prompts import RenderedPrompt, breakpoint_pins
from gateway.openai.requests import ChatCompletionRequest, CompletionRequest
from gateway.openai.wire import ChatWire, CompletionWire

routes = web.RouteTableDef()


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    """Every model served, loaded or not, with its state (as llama-server's router lists them:
    a `status` the SDKs ignore)."""
    gateway: Gateway = request.app["gateway"]
    return json_response({"object": "list", "data": [
        {"id": model.name, "object": "model", "created": 0, "owned_by": "prefixgate",
         "status": {"value": model.state} | ({"error": model.load_error}
                                              if model.load_error else {})}
        for model in gateway.models.all]})


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    body, model = await read_body(request, ChatCompletionRequest)
    prompt = await chat_prompt(model, body, with_pins=True)
    wire = ChatWire(body.model, _token_bytes(model, body), body.include_usage, prompt.parser)
    return await generate(request, model, body, prompt, wire)


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    body, model = await read_body(request, CompletionRequest)
    prompt = await completion_prompt(model, body)
    wire = CompletionWire(body.model, _token_bytes(model, body), body.include_usage)
    return await generate(request, model, body, prompt, wire)


async def chat_prompt(model: ServedModel, body: ChatCompletionRequest,
                      with_pins: bool = False) -> RenderedPrompt:
    """The prompt of a chat completion (POST /v1/chat/completions and /v1/cache/explain)."""
    # Rendering and tokenizing a long prompt takes milliseconds: off the loop, streams keep going.
    return await asyncio.to_thread(_chat_prompt, model, body, with_pins)


def _chat_prompt(model: ServedModel, body: ChatCompletionRequest,
                 with_pins: bool) -> RenderedPrompt:
    """The prompt, and with `with_pins` a pin per prompt_cache_breakpoint."""
    reasoning = Reasoning.of_effort(body.reasoning_effort)
    prompt = model.prompts.chat(body.messages, body.toolbox, reasoning)
    if not with_pins:
        return prompt
    pins = breakpoint_pins(
        prompt.tokens, [((m, p), seconds) for m, p, seconds in body.cache_breakpoints()],
        lambda cut: model.prompts.chat(body.cut(*cut), body.toolbox, reasoning).tokens,
        model.config.workers.pin_hours * 3600)
    return dataclasses.replace(prompt, pins=pins)


async def completion_prompt(model: ServedModel, body: CompletionRequest) -> RenderedPrompt:
    """The prompt of a completion (POST /v1/completions and /v1/cache/explain)."""
    return await asyncio.to_thread(model.prompts.completion, body.single_prompt())


def _token_bytes(model: ServedModel, body: ChatCompletionRequest | CompletionRequest):
    """What a wire spells tokens with, when the request asked for logprobs."""
    return model.vocab.token_piece if body.logprob_count() is not None else None
