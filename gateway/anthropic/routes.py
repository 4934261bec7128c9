"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), for the anthropic SDK and
Claude Code: each request translated into chat messages (gateway/anthropic/requests.py),
rendered by the one prompt path, and sent down the one generation path; its outputs worded by
gateway/anthropic/wire.py. Errors leave in Anthropic's shape (the app's error middleware picks
it by path).

cache_control breakpoints pin the prompt's prefix up to each of them for its TTL (5 minutes
unless `ttl` says 1h), in the tree's own pin accounting, refreshed by every request that marks
them again, as Anthropic's cache is refreshed on each hit. A top-level cache_control (automatic
caching) is one more, on the request's last cacheable block: the whole prompt, turn after turn.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
from aiohttp import web

from cache.tokens import common_prefix
from engine.messages import GenerationRequest
from gateway.anthropic.requests import CountTokensRequest, MessagesRequest
from gateway.anthropic.wire import AnthropicWire
from gateway.core.generation import Pin, Plan, admit, generate, json_response
from gateway.core.requests import completion_room, parse_request, sampler_settings
from gateway.core.service import Gateway
from gateway.formats.chat_formats import OutputParser, call_grammar_of
from gateway.formats.prompts import ChatPrompt

routes = web.RouteTableDef()


@dataclass(frozen=True)
class RenderedPrompt:
    tokens: list[int]
    pins: tuple[Pin, ...]  # one per cache_control breakpoint
    parser: OutputParser | None


@routes.post("/v1/messages")
async def messages(request: web.Request) -> web.StreamResponse:
    gateway: Gateway = request.app["gateway"]
    body = parse_request(MessagesRequest, await request.read())
    gateway.require_model(body.model)
    admit(request)
    prompt = await asyncio.to_thread(_render, gateway, body)
    wire = AnthropicWire(body.model, prompt.parser, len(prompt.tokens),
                         max((pin.n_tokens for pin in prompt.pins), default=0))

    def plan() -> Plan:
        generation = GenerationRequest(
            prompt_tokens=prompt.tokens,
            max_tokens=completion_room(len(prompt.tokens), gateway.workers.seq_len,
                                       body.max_tokens, gateway.config.limits.max_tokens,
                                       "messages"),
            sampler=sampler_settings(
                gateway.config.sampling, body.temperature, body.top_p, body.top_k,
                grammar=body.output_grammar(call_grammar_of(prompt.parser))),
            stop=list(body.stop_sequences or []),
            namespace=request["namespace"])
        return Plan(generation, stream=body.stream, pins=prompt.pins)

    return await generate(request, prompt.tokens, plan, wire)


@routes.post("/v1/messages/count_tokens")
async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's tokens as /v1/messages would render it, tools included."""
    gateway: Gateway = request.app["gateway"]
    body = parse_request(CountTokensRequest, await request.read())
    gateway.require_model(body.model)
    admit(request)
    prompt = await asyncio.to_thread(_render, gateway, body, with_pins=False)
    return json_response({"input_tokens": len(prompt.tokens)})


def _render(gateway: Gateway, body: CountTokensRequest, with_pins: bool = True
            ) -> RenderedPrompt:
    """The prompt's tokens, and how far each breakpoint reaches into them: the request cut
    after the marked block renders a prompt that shares exactly that much with the whole one
    (whatever the chat template writes around the parts)."""
    prompt = _chat(gateway, body)
    tokens = prompt.tokens
    pins = []
    if with_pins:
        whole, longest = np.asarray(tokens), gateway.config.workers.pin_hours * 3600
        for mark in body.breakpoints():
            cut = body.cut(mark.where)  # the whole request, when the mark is its last block
            reach = len(tokens) if cut == body else \
                common_prefix(whole, np.asarray(_chat(gateway, cut).tokens))
            pins.append(Pin(reach, min(mark.seconds, longest)))
    return RenderedPrompt(tokens, tuple(pins), prompt.parser)


def _chat(gateway: Gateway, body: CountTokensRequest) -> ChatPrompt:
    keep = gateway.config.keep_billing_header
    return gateway.prompts.chat(body.chat_messages(keep), body.toolbox(), body.reasoning())
