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
from gateway.core.generation import admit, json_response, requested_model
from gateway.core.models import ServedModel
from gateway.core.requests import Strict, parse_request
from gateway.core.service import Gateway
from gateway.edge.errors import invalid
from gateway.formats.chat_formats import Reasoning
from gateway.openai.requests import ChatCompletionRequest

MIN_TOKENIZE_BOUND = 65536  # tokens /tokenize and /detokenize take, if the context is shorter

routes = web.RouteTableDef()


@routes.post("/tokenize")
async def tokenize(request: web.Request) -> web.Response:
    admit(request)
    body = await asyncio.to_thread(parse_request, TokenizeRequest, await request.read())
    model = _model(request, body.model)
    tokens = await asyncio.to_thread(model.vocab.tokenize, body.content,
                                     add_special=body.add_special, parse_special=True)
    _within_token_bound(model, len(tokens), "content")
    if body.with_pieces:
        return json_response({"tokens": await asyncio.to_thread(_pieces, model.vocab, tokens)})
    return json_response({"tokens": tokens})


@routes.post("/detokenize")
async def detokenize(request: web.Request) -> web.Response:
    gateway: Gateway = request.app["gateway"]
    admit(request)
    raw = await request.read()
    # Validating a huge list holds the GIL, thread or not: refuse it by its size first (an id
    # and its comma take at most 8 bytes with this vocabulary's 6-digit ids and a space).
    _within_token_bound(gateway.default_model, len(raw) // 8, "tokens")
    body = await asyncio.to_thread(parse_request, DetokenizeRequest, raw)
    model = _model(request, body.model)
    _within_token_bound(model, len(body.tokens), "tokens")
    content = await asyncio.to_thread(_detokenized, model.vocab, body.tokens)
    return json_response({"content": content})


@routes.post("/apply-template")
async def apply_template(request: web.Request) -> web.Response:
    """A chat completion request's prompt, as the model's template renders it (tools and
    earlier calls in the model's own format), without generating: what a cache miss can be
    checked against."""
    admit(request)
    body = await asyncio.to_thread(parse_request, ChatCompletionRequest, await request.read())
    model = requested_model(request, body.model)
    text = await asyncio.to_thread(model.prompts.render_chat, body.messages,
                                   body.toolbox, Reasoning.of_effort(body.reasoning_effort))
    return json_response({"prompt": text, "format": model.prompts.format.name})


def _model(request: web.Request, name: str | None) -> ServedModel:
    """The model a body names (llama-server's router takes `model` there too), else the
    first served."""
    return requested_model(request, request.app["gateway"].default_model.name
                           if name is None else name)


def _within_token_bound(model: ServedModel, n_tokens: int, param: str) -> None:
    """No more tokens than a prompt of the model may have (its context, at least 64k)."""
    bound = max(model.engines.seq_len, MIN_TOKENIZE_BOUND)
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
    model: str | None = None  # None: the first served


class DetokenizeRequest(Strict):
    """llama-server's /detokenize."""

    tokens: Annotated[list[int], at_most(bounds.TOKEN_IDS)]
    model: str | None = None  # None: the first served
