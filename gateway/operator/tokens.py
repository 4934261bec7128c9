"""llama-server's /tokenize, /detokenize and /apply-template. Vocabulary-sized work (a ctypes
call per token) runs on a thread, within a bound, after the key's rate limit: never on the event
loop the streams share."""

from __future__ import annotations

import asyncio
from typing import Annotated

from aiohttp import web

from engine.llama import Model
from gateway.core import bounds
from gateway.core.bounds import at_most
from gateway.core.generation import admit, json_response
from gateway.core.requests import Strict, parse_request
from gateway.core.service import Gateway
from gateway.edge.errors import invalid
from gateway.formats.chat_formats import Reasoning
from gateway.openai.requests import ChatCompletionRequest

MIN_TOKENIZE_BOUND = 65536  # tokens /tokenize and /detokenize take, if the context is shorter

routes = web.RouteTableDef()


@routes.post("/tokenize")
async def tokenize(request: web.Request) -> web.Response:
    gateway: Gateway = request.app["gateway"]
    admit(request)
    body = await asyncio.to_thread(parse_request, TokenizeRequest, await request.read())
    gateway.require_model(gateway.config.model_name)
    tokens = await asyncio.to_thread(gateway.model.tokenize, body.content,
                                     add_special=body.add_special, parse_special=True)
    _within_token_bound(gateway, len(tokens), "content")
    if body.with_pieces:
        return json_response({"tokens": await asyncio.to_thread(_pieces, gateway.model, tokens)})
    return json_response({"tokens": tokens})


@routes.post("/detokenize")
async def detokenize(request: web.Request) -> web.Response:
    gateway: Gateway = request.app["gateway"]
    admit(request)
    raw = await request.read()
    # Validating a huge list holds the GIL, thread or not: refuse it by its size first (an id
    # and its comma take at most 8 bytes with this vocabulary's 6-digit ids and a space).
    _within_token_bound(gateway, len(raw) // 8, "tokens")
    body = await asyncio.to_thread(parse_request, DetokenizeRequest, raw)
    gateway.require_model(gateway.config.model_name)
    _within_token_bound(gateway, len(body.tokens), "tokens")
    content = await asyncio.to_thread(_detokenized, gateway.model, body.tokens)
    return json_response({"content": content})


@routes.post("/apply-template")
async def apply_template(request: web.Request) -> web.Response:
    """A chat completion request's prompt, as the model's template renders it (tools and
    earlier calls in the model's own format), without generating: what a cache miss can be
    checked against."""
    gateway: Gateway = request.app["gateway"]
    admit(request)
    body = await asyncio.to_thread(parse_request, ChatCompletionRequest, await request.read())
    text = await asyncio.to_thread(gateway.prompts.render_chat, body.messages,
                                   body.toolbox, Reasoning.of_effort(body.reasoning_effort))
    return json_response({"prompt": text, "format": gateway.prompts.format.name})


def _within_token_bound(gateway: Gateway, n_tokens: int, param: str) -> None:
    """No more tokens than a prompt of this server may have (its context, at least 64k)."""
    bound = max(gateway.workers.seq_len, MIN_TOKENIZE_BOUND)
    if n_tokens > bound:
        raise invalid(f"{n_tokens} tokens; this server tokenizes at most {bound}", param)


def _pieces(model: Model, tokens: list[int]) -> list[dict]:
    return [{"id": t, "piece": model.token_piece(t).decode(errors="replace")} for t in tokens]


def _detokenized(model: Model, tokens: list[int]) -> str:
    if any(not 0 <= t < model.n_vocab for t in tokens):
        raise invalid("tokens holds an id outside the vocabulary", "tokens")
    return model.detokenize(tokens)


class TokenizeRequest(Strict):
    """llama-server's /tokenize."""

    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(Strict):
    """llama-server's /detokenize."""

    tokens: Annotated[list[int], at_most(bounds.TOKEN_IDS)]
