"""POST /v1/cache/explain: why a prompt misses the cache, answered without running the model.

It takes the body of a chat completion (`messages`), a completion (`prompt`) or a Responses
request (`input`), renders and tokenizes it with the functions those endpoints use, and says:
its tokens; how many of them are held where (by a request in flight of the same namespace, whose
cells a request running beside it shares; in the local pool; in Redis; pinned); where the
longest cached path leaves the prompt (the message, the character, the text on both sides); and
the time to first token the prefill speed measured lately predicts.

A tenant asks with its own key, about its own namespace; the admin key asks about any, named as
the admin API lists namespaces (`?namespace=<hash>`). Without API keys every request shares one
namespace, and anyone may ask.

Only the admin key is shown cached text (`divergence.cached`: what the cache holds past the
divergence). Others are told counts, and places and text in their own prompt: a namespace may be
shared (--shared-prefix-tenants, or no keys at all), and cached text shown to whoever asks would
let one member read another's conversations out of the cache a token at a time.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
import orjson
from aiohttp import web

from cache.index import namespace_hash
from cache.tokens import COMPUTED_TAIL, resume_point
from gateway.core.conversation import Message
from gateway.core.generation import admit, json_response, requested_model
from gateway.core.models import ServedModel
from gateway.core.requests import parse_request
from gateway.core.service import Gateway
from gateway.edge.auth import bearer_matches
from gateway.edge.errors import APIError, invalid
from gateway.formats.prompts import RenderedPrompt
from gateway.openai.requests import ChatCompletionRequest, CompletionRequest
from gateway.openai.routes import chat_prompt, completion_prompt
from gateway.responses.requests import ResponsesRequest
from gateway.responses.routes import owner, response_prompt
from gateway.workers.shared_pool import SharedPool

CONTEXT_CHARS = 40  # of text on each side of a divergence
FOLLOWING_TOKENS = 32  # of the cached path past it
# A completion's prompt has no messages; nor does a chat's that the template rewrote entirely.
NO_MESSAGE = {"message": None, "role": None, "offset": None, "in_content": False}

routes = web.RouteTableDef()


@dataclass(frozen=True)
class Found:
    """What the tiers hold of a prompt, from its first token."""

    live: int
    pool: int
    redis: int | None  # None: no Redis tier, or it could not say
    pinned: int
    following: dict[str, np.ndarray]  # by tier: what it holds past the prompt's common part


@routes.post("/v1/cache/explain")
async def explain(request: web.Request) -> web.Response:
    gateway: Gateway = request.app["gateway"]
    gateway.default_model.require_pool()  # before a key is asked for: no cache, no explain
    namespace, admin = _namespace(request, gateway)
    admit(request)
    model, rendered = await _render(request, gateway)
    pool = model.require_pool()
    tokens = np.asarray(rendered.tokens, dtype=np.int32)
    found = await asyncio.to_thread(_find, model, pool, tokens, namespace)
    best = max(found.live, found.pool, found.redis or 0)
    cached = resume_point(min(best, len(tokens) - COMPUTED_TAIL)) if best else 0
    speed = gateway.metrics.prefill[model.name].tokens_per_second()
    to_compute = len(tokens) - cached
    return json_response({
        "object": "cache.explanation",
        "namespace": namespace_hash(namespace.encode()),
        "tokens": {"count": len(tokens), "ids": rendered.tokens},
        "held": {"live": found.live, "pool": found.pool, "redis": found.redis,
                 "pinned": found.pinned},
        "cached_tokens": cached,
        "divergence": _divergence(model, rendered, found, best, admin)
        if best < len(tokens) else None,
        "ttft": {"tokens_to_compute": to_compute,
                 "prefill_tokens_per_second": None if speed is None else round(speed, 1),
                 "predicted_seconds": None if speed is None else round(to_compute / speed, 3)},
    })


def _namespace(request: web.Request, gateway: Gateway) -> tuple[str, bool]:
    """The namespace asked about, from the key asking (the admin API's paths skip the key
    middleware: the admin key is no tenant's), and whether the admin key asks."""
    x_api_key = request.headers.get("x-api-key")
    authorization = request.headers.get("Authorization") or (
        f"Bearer {x_api_key}" if x_api_key else None)
    admin_key = gateway.config.admin_key
    if admin_key is not None and bearer_matches(authorization, admin_key):
        return _named(gateway, request.query.get("namespace")), True
    keys = gateway.config.keys
    if keys is None:
        return "", False
    identity = keys.identify(authorization)
    if identity is None:
        raise APIError(401, "Explain needs a tenant's API key, or the admin key with "
                            "?namespace=<hash>", code="invalid_api_key")
    request["key"], request["tenant"] = identity
    return keys.namespace(identity[1]), False


def _named(gateway: Gateway, hashed: str | None) -> str:
    keys = gateway.config.keys
    if hashed is None:
        if keys is None:
            return ""
        raise invalid("With the admin key, name the namespace as GET /v1/cache/prefixes lists "
                      "it: ?namespace=<hash>", "namespace")
    known = {""} | ({keys.namespace(t) for t in keys.tenants.values()} if keys else set())
    named = next((n for n in known if namespace_hash(n.encode()) == hashed), None)
    if named is None:  # one no key names now, that a model's pool still holds
        held = (m.engines.pool.index.namespace_named(hashed) for m in gateway.models.all
                if m.engines.pool is not None)
        named = next((n for n in held if n is not None), None)
    if named is None:
        raise APIError(404, f"No namespace {hashed!r}", param="namespace", code="not_found")
    return named


async def _render(request: web.Request, gateway: Gateway
                  ) -> tuple[ServedModel, RenderedPrompt]:
    """The model the body names, and the prompt as the endpoint the body is for renders it."""
    raw = await request.read()
    try:
        fields = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise invalid("We could not parse the JSON body of your request") from None
    if isinstance(fields, dict) and "messages" in fields:
        body = parse_request(ChatCompletionRequest, raw)
        model = requested_model(request, body.model)
        return model, await chat_prompt(model, body)
    if isinstance(fields, dict) and "input" in fields:
        body = parse_request(ResponsesRequest, raw)
        model = requested_model(request, body.model)
        return model, (await response_prompt(gateway, model, body, owner(request))).prompt
    if isinstance(fields, dict) and "prompt" in fields:
        body = parse_request(CompletionRequest, raw)
        model = requested_model(request, body.model)
        return model, await completion_prompt(model, body)
    raise invalid("Explain takes the body of a chat completion (messages), a completion "
                  "(prompt) or a Responses request (input)")


def _find(model: ServedModel, pool: SharedPool, tokens: np.ndarray, namespace: str) -> Found:
    """Blocking: the index's lock, a Redis round trip."""
    report = pool.index.report(tokens, namespace)
    live, other = model.engines.live_match(tokens, namespace)
    following = {"pool": report.following}
    if other is not None:
        following["live"] = other[live: live + FOLLOWING_TOKENS]
    return Found(live, report.n_tokens, pool.redis_held(tokens, namespace),
                 report.pinned_tokens, following)


def _divergence(model: ServedModel, rendered: RenderedPrompt, found: Found, best: int,
                admin: bool) -> dict:
    """Where the longest cached path leaves the prompt: its first token no tier holds, as a
    place in the prompt's text and in its messages, with the prompt's text on both sides, and
    for the admin key the cached text that follows instead."""
    tiers = {"pool": found.pool, "live": found.live, "redis": found.redis or 0}
    source = max(tiers, key=tiers.get) if best else None  # ties: the pool, whose path we see
    pieces = [model.vocab.token_piece(t, special=True) for t in rendered.tokens]
    text = b"".join(pieces).decode(errors="ignore")
    at = len(b"".join(pieces[:best]).decode(errors="ignore"))
    # Redis's values are not fetched; a tenant is never shown text it did not send.
    following = found.following.get(source or "pool") if admin else None
    held = None if following is None else b"".join(
        model.vocab.token_piece(int(t), special=True) for t in following).decode(
        errors="ignore")[:CONTEXT_CHARS]
    where = {"token": best, "source": source, "prompt_offset": at,
             "before": text[max(0, at - CONTEXT_CHARS): at],
             "prompt": text[at: at + CONTEXT_CHARS], "cached": held}
    return where | (NO_MESSAGE if rendered.messages is None
                    else _message_at(text, rendered.messages, at))


def _message_at(text: str, messages: list[Message], at: int) -> dict:
    """The message whose content is the last to start at or before `at` in the rendered text
    (each found in order), and `at` as an offset into that content: past its length when the
    divergence is in what the template adds after it (tools, the next turn's header)."""
    starts, cursor = [], 0
    for i, message in enumerate(messages):
        content = message.text()
        found = text.find(content, cursor) if content else -1
        if found >= 0:
            starts.append((i, found, len(content)))
            cursor = found + len(content)
    if not starts:  # no content found as sent: the template rewrote every message
        return NO_MESSAGE
    before = [s for s in starts if s[1] <= at]
    if not before:  # in the template's opening, before any message's content
        index = starts[0][0]
        return {"message": index, "role": messages[index].role, "offset": None,
                "in_content": False}
    index, start, length = before[-1]
    return {"message": index, "role": messages[index].role, "offset": at - start,
            "in_content": at - start <= length}
