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
from gateway.core.models import ServedModel
from gateway.formats.prompts import RenderedPrompt, breakpoint_pins

routes = web.RouteTableDef()


@routes.post("/v1/messages")
async def messages(request: web.Request) -> web.StreamResponse:
    body, model = await read_body(request, MessagesRequest)
    keep = request.app["gateway"].config.keep_billing_header
    prompt = await asyncio.to_thread(_render, model, body, keep)
    wire = AnthropicWire(body.model, prompt.parser, len(prompt.tokens),
                         max((pin.n_tokens for pin in prompt.pins), default=0))
    return await generate(request, model, body, prompt, wire)


@routes.post("/v1/messages/count_tokens")
async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's tokens as /v1/messages would render it, tools included."""
    body, model = await read_body(request, CountTokensRequest)
    keep = request.app["gateway"].config.keep_billing_header
    prompt = await asyncio.to_thread(_render, model, body, keep, with_pins=False)
    return json_response({"input_tokens": len(prompt.tokens)})


def _render(model: ServedModel, body: CountTokensRequest, keep_billing_header: bool,
            with_pins: bool = True) -> RenderedPrompt:
    """The prompt, and how far each breakpoint reaches into it (breakpoint_pins)."""
    prompt = _chat(model, body, keep_billing_header)
    if not with_pins:
        return prompt

    def cut_tokens(where: tuple) -> list[int]:
        cut = body.cut(where)  # the whole request, when the mark is its last block
        return prompt.tokens if cut == body else _chat(model, cut, keep_billing_header).tokens

    pins = breakpoint_pins(prompt.tokens, [(m.where, m.seconds) for m in body.breakpoints()],
                           cut_tokens, model.config.workers.pin_hours * 3600)
    return dataclasses.replace(prompt, pins=pins)


def _chat(model: ServedModel, body: CountTokensRequest, keep_billing_header: bool
          ) -> RenderedPrompt:
    return model.prompts.chat(body.chat_messages(keep_billing_header), body.toolbox(),
                              body.reasoning())
