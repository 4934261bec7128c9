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
import dataclasses

from aiohttp import web

from gateway.anthropic.requests import CountTokensRequest, MessagesRequest
from gateway.anthropic.wire import AnthropicWire
from gateway.core.generation import generate, json_response, read_body
from gateway.core.service import Gateway
from gateway.formats.prompts import RenderedPrompt, breakpoint_pins

routes = web.RouteTableDef()


@routes.post("/v1/messages")
async def messages(request: web.Request) -> web.StreamResponse:
    gateway: Gateway = request.app["gateway"]
    body = await read_body(request, MessagesRequest)
    prompt = await asyncio.to_thread(_render, gateway, body)
    wire = AnthropicWire(body.model, prompt.parser, len(prompt.tokens),
                         max((pin.n_tokens for pin in prompt.pins), default=0))
    return await generate(request, body, prompt, wire)


@routes.post("/v1/messages/count_tokens")
async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's tokens as /v1/messages would render it, tools included."""
    gateway: Gateway = request.app["gateway"]
    body = await read_body(request, CountTokensRequest)
    prompt = await asyncio.to_thread(_render, gateway, body, with_pins=False)
    return json_response({"input_tokens": len(prompt.tokens)})


def _render(gateway: Gateway, body: CountTokensRequest, with_pins: bool = True
            ) -> RenderedPrompt:
    """The prompt, and how far each breakpoint reaches into it (breakpoint_pins)."""
    prompt = _chat(gateway, body)
    if not with_pins:
        return prompt

    def cut_tokens(where: tuple) -> list[int]:
        cut = body.cut(where)  # the whole request, when the mark is its last block
        return prompt.tokens if cut == body else _chat(gateway, cut).tokens

    pins = breakpoint_pins(prompt.tokens, [(m.where, m.seconds) for m in body.breakpoints()],
                           cut_tokens, gateway.config.workers.pin_hours * 3600)
    return dataclasses.replace(prompt, pins=pins)


def _chat(gateway: Gateway, body: CountTokensRequest) -> RenderedPrompt:
    keep = gateway.config.keep_billing_header
    return gateway.prompts.chat(body.chat_messages(keep), body.toolbox(), body.reasoning())
