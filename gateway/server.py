"""HTTP layer: aiohttp handlers for the OpenAI endpoints, /health and /metrics.

The data path of a request reads top to bottom: parse -> prompt tokens -> engine -> response.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import signal
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import orjson
from aiohttp import web

from engine.llama import Model
from engine.messages import EngineUnavailable, GenerationRequest, Output, Usage
from gateway import cors
from gateway.auth import KeyRing, bearer_matches
from gateway.config import Limits, WorkersConfig
from gateway.errors import APIError, invalid
from gateway.handles import GenerationHandle
from gateway.metrics import Metrics
from gateway.prompts import PromptBuilder
from gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_request,
)
from gateway.ratelimit import RateLimiter, RateLimits
from gateway.responses import ChatWriter, Choice, CompletionWriter, ResponseWriter
from gateway.supervisor import Overloaded, Workers
from gateway.tools import Toolbox

log = logging.getLogger(__name__)

ADMIN_PREFIX = "/v1/cache/"
CACHE_PAGE = Path(__file__).parent / "static" / "cache.html"
HOTTEST_PREFIXES = 50  # rows of GET /v1/cache/prefixes
PREVIEW_CHARS = 80
KEYED_PATHS = ("/tokenize", "/detokenize")  # besides /v1/*: what needs a key when keys exist
HISTORY_STEP, HISTORY_SECONDS = 10.0, 900.0  # the hit-rate history: a sample each, kept
RETRY_AFTER_SECONDS = 1  # a 429's advice: the OpenAI SDK waits that long, then retries
MIN_TOKENIZE_BOUND = 65536  # tokens /tokenize and /detokenize take, if the context is shorter
FINAL_WRITE_SECONDS = 5  # how long a timed-out stream waits for its client to take the error

@dataclass
class ServerConfig:
    model_name: str
    workers: WorkersConfig
    host: str = "127.0.0.1"
    port: int = 8000
    drain_seconds: float = 30.0  # on SIGTERM, how long requests in flight may finish
    keys: KeyRing | None = None  # None: open to anyone who can reach it
    admin_key: str | None = None  # the cache admin API (/v1/cache/*); None: no admin API
    metrics_key: str | None = None  # guards /metrics
    debug_key: str | None = None  # turns /debug/* on, behind it
    cors_origin: str | None = None  # None: no CORS headers, browsers on other origins refused
    limits: Limits = Limits()
    chat_template: str | None = None  # instead of the GGUF's own
    log_prompts: bool = False
    rate_limits: RateLimits = RateLimits()  # per API key


@dataclass(frozen=True)
class HistorySample:
    at: float  # monotonic
    wall: float
    queried: int
    hit: int
    evictions: int
    ttft_seconds: float
    ttft_count: int

    def between(self, previous: HistorySample) -> dict:
        """What happened from `previous` to this sample, per minute where a rate."""
        minutes = (self.at - previous.at) / 60
        queried = self.queried - previous.queried
        first_tokens = self.ttft_count - previous.ttft_count
        return {"time": self.wall,
                "hit_rate": (self.hit - previous.hit) / queried if queried else None,
                "ttft": (self.ttft_seconds - previous.ttft_seconds) / first_tokens
                if first_tokens else None,
                "evictions_per_minute": (self.evictions - previous.evictions) / minutes}


class Gateway:
    """What the handlers share: the vocabulary (for prompts), the engine workers, and the
    metrics. Workers start on a background thread so that /health can answer 503 meanwhile."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.model: Model | None = None  # vocabulary only: the weights live in the workers
        self.prompts: PromptBuilder | None = None
        self.workers = Workers(config.workers)
        self.load_error: str | None = None
        self.metrics = Metrics(self.workers)
        self.rate_limiter = RateLimiter(config.rate_limits) if config.rate_limits.enabled \
            else None
        self.history: deque[HistorySample] = deque()
        self._loaded = threading.Event()

    @property
    def ready(self) -> bool:
        return self._loaded.is_set() and self.load_error is None

    def load(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            model_path = self.config.workers.model_path
            self.model = Model(model_path, vocab_only=True)
            self.prompts = PromptBuilder(self.model, self.config.chat_template)
            self.workers.start(loop)
            engine = self.config.workers.engine
            log.info("serving %s as %r: %d worker(s), each %d parallel sequences in %d KV cells "
                     "(%s), requests of up to %d tokens", model_path, self.config.model_name,
                     self.config.workers.n_workers, engine.parallel, engine.ctx_size,
                     "deterministic" if engine.deterministic else "unified",
                     self.workers.seq_len)
        except Exception as exc:
            log.exception("starting the engine workers failed")
            self.load_error = str(exc)
        finally:
            self._loaded.set()

    def cache_totals(self) -> tuple[int, int]:
        """(prompt tokens looked up, prompt tokens served by the cache) so far."""
        hits = self.workers.tier_hits()
        return hits.queried, hits.served

    def sample_history(self) -> None:
        """Called every HISTORY_STEP seconds: what the figures over the last minutes read."""
        now = time.monotonic()
        pool = self.workers.pool
        index = pool.index.snapshot() if pool else None
        self.history.append(HistorySample(
            now, time.time(), *self.cache_totals(), index.evictions if index else 0,
            self.metrics.ttft_seconds, self.metrics.ttft_count))
        while self.history and self.history[0].at < now - HISTORY_SECONDS:
            self.history.popleft()

    def cache_stats(self) -> dict:
        pool = self.workers.pool
        index, slot_bytes = pool.index.snapshot(), pool.arena.header.slot_bytes
        snaps = [v.snapshot for v in self.workers.views()]
        now, (queried, hit) = time.monotonic(), self.cache_totals()

        def hit_rate(seconds: float) -> float | None:
            past = next((h for h in self.history if h.at >= now - seconds), None)
            if past is None or queried == past.queried:
                return None
            return (hit - past.hit) / (queried - past.queried)

        return {
            "pool": {"blocks_used": index.blocks_used, "blocks_free": index.blocks_free,
                     "blocks_held": index.blocks_held, "bytes_used": index.blocks_used * slot_bytes,
                     "bytes_capacity": (index.blocks_used + index.blocks_free) * slot_bytes},
            "cells": {"used": sum(s.cells_used for s in snaps),
                      "total": sum(s.cells_total for s in snaps)},
            "hit_rate": {"1m": hit_rate(60), "5m": hit_rate(300),
                         "all": hit / queried if queried else None},
            "evictions": index.evictions,
            "pins": {"blocks": index.blocks_pinned, "budget_blocks": index.pin_budget,
                     "fallbacks": index.pin_fallbacks, "hit_tokens": index.pinned_hit_tokens},
            "history": [step.between(previous) for previous, step
                        in itertools.pairwise(self.history)],
        }

    def close(self) -> None:
        self.workers.stop()
        if self.model:
            self.model.close()

    def require_model(self, name: str) -> None:
        if not self.ready:
            raise APIError(503, "The model is still loading; retry shortly", code="model_loading")
        if name != self.config.model_name:
            raise APIError(404, f"The model `{name}` does not exist", "model", "model_not_found")


routes = web.RouteTableDef()


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    gateway: Gateway = request.app["gateway"]
    if gateway.load_error:
        return web.json_response({"status": "error", "error": gateway.load_error}, status=500)
    if not gateway.ready:
        return web.json_response({"status": "loading"}, status=503)
    workers = gateway.workers.states()
    n_ready = sum(w["state"] == "ready" for w in workers)
    # Degraded: a worker is being replaced; the others serve, so the instance stays in rotation.
    status = "ok" if n_ready == len(workers) else "degraded" if n_ready else "unavailable"
    return web.json_response({"status": status, "workers": workers},
                             status=503 if status == "unavailable" else 200)


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    _require_metrics_key(request)
    body, content_type = request.app["gateway"].metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": content_type})


@routes.get("/debug/consistency")
async def consistency(request: web.Request) -> web.Response:
    """Tree, pool, leases and workers against each other (see Workers.problems). It walks the
    whole tree under the index's lock: an operator's tool, off without --debug-key."""
    _require_debug_key(request)
    problems = await asyncio.to_thread(request.app["gateway"].workers.problems)
    return _json({"ok": not problems, "problems": problems})


@routes.post("/tokenize")
async def tokenize(request: web.Request) -> web.Response:
    """Vocabulary-sized work (a ctypes call per token) runs on a thread, within a bound, after
    the key's rate limit: never on the event loop the streams share."""
    gateway: Gateway = request.app["gateway"]
    _admit(request)
    body = await asyncio.to_thread(parse_request, TokenizeRequest, await request.read())
    gateway.require_model(gateway.config.model_name)
    tokens = await asyncio.to_thread(gateway.model.tokenize, body.content,
                                     add_special=body.add_special, parse_special=True)
    _within_token_bound(gateway, len(tokens), "content")
    if body.with_pieces:
        return _json({"tokens": await asyncio.to_thread(_pieces, gateway.model, tokens)})
    return _json({"tokens": tokens})


@routes.post("/detokenize")
async def detokenize(request: web.Request) -> web.Response:
    gateway: Gateway = request.app["gateway"]
    _admit(request)
    raw = await request.read()
    # Validating a huge list holds the GIL, thread or not: refuse it by its size first (an id
    # and its comma take at most 8 bytes with this vocabulary's 6-digit ids and a space).
    _within_token_bound(gateway, len(raw) // 8, "tokens")
    body = await asyncio.to_thread(parse_request, DetokenizeRequest, raw)
    gateway.require_model(gateway.config.model_name)
    _within_token_bound(gateway, len(body.tokens), "tokens")
    content = await asyncio.to_thread(_detokenized, gateway.model, body.tokens)
    return _json({"content": content})


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


def _require_admin(request: web.Request) -> Gateway:
    gateway: Gateway = request.app["gateway"]
    key = gateway.config.admin_key
    if key is None:  # no admin API at all without a key
        raise web.HTTPNotFound()
    if not bearer_matches(request.headers.get("Authorization"), key):
        raise APIError(401, "The cache admin API needs the admin key (--admin-key)",
                       code="invalid_api_key")
    if gateway.workers.pool is None:
        raise APIError(404, "The prefix cache is off", code="cache_disabled")
    return gateway


@routes.get("/cache")
async def cache_page(request: web.Request) -> web.StreamResponse:
    """The live cache page: static, it reads the admin API with the key it is given."""
    if request.app["gateway"].config.admin_key is None:
        raise web.HTTPNotFound()
    return web.FileResponse(CACHE_PAGE)


@routes.get("/v1/cache/prefixes")
async def cached_prefixes(request: web.Request) -> web.Response:
    gateway = _require_admin(request)
    pool = gateway.workers.pool
    index, slot_bytes = pool.index, pool.arena.header.slot_bytes
    rows = await asyncio.to_thread(index.prefixes, HOTTEST_PREFIXES)
    for row in rows:
        tokens = row.pop("tokens")
        row.update(tokens=len(tokens), bytes=row["blocks"] * slot_bytes)
        if gateway.config.log_prompts:  # text only where prompts may be shown at all
            row["preview"] = gateway.model.detokenize(list(tokens))[:PREVIEW_CHARS]
    return _json({"object": "list", "data": rows})


@routes.delete("/v1/cache/prefixes")
async def drop_prefixes(request: web.Request) -> web.Response:
    gateway = _require_admin(request)
    dropped = await asyncio.to_thread(gateway.workers.pool.index.drop,
                                      request.query.get("namespace"))
    return _json({"dropped_blocks": dropped})


@routes.get("/v1/cache/stats")
async def cache_stats(request: web.Request) -> web.Response:
    gateway = _require_admin(request)
    return _json(gateway.cache_stats())


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    gateway: Gateway = request.app["gateway"]
    return _json({"object": "list", "data": [{
        "id": gateway.config.model_name, "object": "model", "created": 0,
        "owned_by": "prefixgate"}]})


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    gateway: Gateway = request.app["gateway"]
    body = parse_request(ChatCompletionRequest, await request.read())
    gateway.require_model(body.model)
    _admit(request)
    # Rendering and tokenizing a long prompt takes milliseconds: off the loop, streams keep going.
    try:
        prompt_tokens = await asyncio.to_thread(gateway.prompts.chat, body.messages,
                                                body.toolbox)
    except ValueError as exc:  # the chat template refused the messages (raise_exception)
        raise invalid(f"The chat template rejected the messages: {exc}", "messages") from None
    return await _generate(request, body, prompt_tokens,
                           ChatWriter(body.model, _token_bytes(gateway, body)))


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    gateway: Gateway = request.app["gateway"]
    body = parse_request(CompletionRequest, await request.read())
    gateway.require_model(body.model)
    _admit(request)
    try:
        prompt_tokens = await asyncio.to_thread(gateway.prompts.completion,
                                                body.single_prompt())
    except ValueError as exc:
        raise invalid(str(exc), "prompt") from None
    return await _generate(request, body, prompt_tokens,
                           CompletionWriter(body.model, _token_bytes(gateway, body)))


def _token_bytes(gateway: Gateway, body: ChatCompletionRequest | CompletionRequest):
    """What a response writer spells tokens with, when the request asked for logprobs."""
    return gateway.model.token_piece if body.logprob_count() is not None else None


async def _generate(request: web.Request, body: ChatCompletionRequest | CompletionRequest,
                    prompt_tokens: list[int], writer: ResponseWriter) -> web.StreamResponse:
    """request -> generation -> (rate limit, Redis tier, pin) -> worker -> answer."""
    gateway: Gateway = request.app["gateway"]
    limits = gateway.config.limits
    _admit_prompt(gateway, request["key"], len(prompt_tokens))  # before building a grammar
    # Building a grammar from a schema takes time: off the event loop the streams share.
    generation = await asyncio.to_thread(
        body.to_generation, prompt_tokens, gateway.workers.seq_len, gateway.model.n_vocab,
        limits.max_tokens, namespace=request["namespace"])
    n = body.n or 1
    if n > limits.max_n:
        raise invalid(f"n is {n}; this server answers at most {limits.max_n} choices "
                      "(--max-n)", "n")
    pool = gateway.workers.pool
    if pool is not None and pool.tier is not None:  # a local miss: another replica's hit?
        await asyncio.to_thread(pool.fetch_from_tier, generation)
    pinning = pool is not None and body.prompt_cache_retention == "24h"
    if pinning:  # what is cached already, now; the rest once it is stored
        pool.pin(generation)
    handles = _submit(gateway, _choices(generation, n), body.prompt_cache_key)
    timer = gateway.metrics.request_timer()
    choices = [Choice() for _ in handles]
    try:
        toolbox = body.toolbox if isinstance(body, ChatCompletionRequest) else None
        if body.stream:
            return await _stream(request, handles, writer, body.include_usage, timer,
                                 limits.request_timeout, choices, toolbox)
        return await _collect(handles, writer, timer, limits.request_timeout, choices, toolbox)
    finally:
        for handle in handles:
            handle.cancel()  # a no-op once finished; frees the sequence if the client left
        _charge_rate(gateway, request["key"], choices)
        if pinning:
            pool.pin(generation)
        if gateway.config.log_prompts:
            log.info("tenant %r prompt %r answers %r", request["tenant"],
                     gateway.model.detokenize(prompt_tokens), [c.text for c in choices])


def _admit(request: web.Request) -> None:
    """The key's rate limit, before any work on the request (rendering, tokenizing, grammars)."""
    gateway: Gateway = request.app["gateway"]
    if gateway.rate_limiter is not None and request["key"] is not None:
        _refuse_for(gateway.rate_limiter.admit(request["key"]))


def _admit_prompt(gateway: Gateway, key: str | None, prompt_tokens: int) -> None:
    if gateway.rate_limiter is not None and key is not None:
        _refuse_for(gateway.rate_limiter.admit_prompt(key, prompt_tokens))


def _refuse_for(wait: int | None) -> None:
    if wait is not None:
        raise APIError(429, "This key's rate limit (--rate-limit-rpm, --rate-limit-tpm) is "
                            f"reached; retry in {wait} s", code="rate_limit_exceeded",
                       headers={"Retry-After": str(wait)})


def _charge_rate(gateway: Gateway, key: str | None, choices: list[Choice]) -> None:
    """What every choice generated, finished, timed out or abandoned alike."""
    if gateway.rate_limiter is not None and key is not None:
        gateway.rate_limiter.charge(key, sum(
            max(c.n_generated, c.usage.completion_tokens if c.usage else 0) for c in choices))


def _choices(generation: GenerationRequest, n: int) -> list[GenerationRequest]:
    """One generation per choice, each sampling with its own seed (seed + i when one is
    given, so results repeat); they share the prompt's cells, computed once."""
    seed = generation.sampler.seed
    return [dataclasses.replace(generation, sampler=dataclasses.replace(
        generation.sampler, seed=None if seed is None else seed + i)) for i in range(n)]


def _submit(gateway: Gateway, generations: list[GenerationRequest],
            cache_key: str | None) -> list[GenerationHandle]:
    try:
        return gateway.workers.submit_group(generations, cache_key)
    except Overloaded as exc:
        raise APIError(429, f"The server is at capacity ({exc}); retry shortly",
                       code="rate_limit_exceeded",
                       headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
    except EngineUnavailable as exc:
        raise APIError(503, f"The engine is not serving: {exc}", code="engine_unavailable"
                       ) from None


def _timed_out(seconds: float) -> APIError:
    return APIError(504, f"The request did not finish within {seconds:g} s (--request-timeout)",
                    code="timeout")


async def _outputs(handles: list[GenerationHandle], choices: list[Choice],
                   timer) -> AsyncIterator[tuple[int, Output]]:
    """Every choice's outputs as they come, with the choice's index, each one timed and added
    to its Choice first (text, logprobs; on the last one why it ended and its usage)."""
    merged: asyncio.Queue[tuple[int, Output]] = asyncio.Queue()

    async def pump(i: int, handle: GenerationHandle) -> None:
        async for output in handle.outputs():
            await merged.put((i, output))

    pumps = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    unfinished = len(handles)
    try:
        while unfinished:
            i, output = await merged.get()
            timer.on_output(output)
            choice = choices[i]
            choice.text += output.text
            choice.logprobs += output.logprobs
            choice.n_generated = max(choice.n_generated, output.n_generated)
            if output.usage:
                choice.finish_reason, choice.usage = output.finish_reason, output.usage
            yield i, output
            unfinished -= output.last
    finally:
        for task in pumps:
            task.cancel()


def _total_usage(choices: list[Choice]) -> Usage:
    """The prompt once, every choice's completion tokens."""
    usages = [c.usage for c in choices if c.usage]
    return Usage(usages[0].prompt_tokens, sum(u.completion_tokens for u in usages),
                 usages[0].cached_tokens)


async def _collect(handles: list[GenerationHandle], writer: ResponseWriter, timer,
                   timeout: float | None, choices: list[Choice],
                   toolbox: Toolbox | None) -> web.Response:
    try:
        async with asyncio.timeout(timeout):
            async for _, output in _outputs(handles, choices, timer):
                if output.error:
                    raise _generation_error(output)
    except TimeoutError:
        raise _timed_out(timeout) from None
    if toolbox is not None:
        for choice in choices:
            choice.tool_call = toolbox.parse(choice.text, choice.finish_reason)
    return _json(writer.whole(choices, _total_usage(choices)))


async def _stream(request: web.Request, handles: list[GenerationHandle],
                  writer: ResponseWriter, include_usage: bool, timer, timeout: float | None,
                  choices: list[Choice], toolbox: Toolbox | None) -> web.StreamResponse:
    """With tools offered, each choice is held back until it is whole: only then is it known
    to be a call (sent as tool_calls deltas) or text."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    if isinstance(writer, ChatWriter):
        for i in range(len(handles)):
            await _event(response, writer.chunk("", first=True, with_usage_field=include_usage,
                                                index=i))
    try:
        async with asyncio.timeout(timeout):
            async for i, output in _outputs(handles, choices, timer):
                if output.error:
                    await _event(response, _generation_error(output).body())
                    break
                if toolbox is not None:
                    if output.last:
                        await _finish_tool_choice(response, writer, toolbox, choices[i], i,
                                                  output, include_usage)
                else:
                    await _text_then_finish(response, writer, output.text, output.finish_reason,
                                            output.logprobs, i, include_usage)
            else:
                if include_usage:
                    await _event(response, writer.usage_chunk(_total_usage(choices)))
    except TimeoutError:
        for handle in handles:  # freed at the deadline, whatever the client's socket does
            handle.cancel()
        await _finish_stream(request, response, _timed_out(timeout).body())
        return response
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _finish_stream(request: web.Request, response: web.StreamResponse,
                         error: dict) -> None:
    """The error event and [DONE], if the client takes them soon; else the connection goes."""
    try:
        async with asyncio.timeout(FINAL_WRITE_SECONDS):
            await _event(response, error)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()


async def _finish_tool_choice(response: web.StreamResponse, writer: ChatWriter,
                              toolbox: Toolbox, choice: Choice, index: int, output: Output,
                              include_usage: bool) -> None:
    call = toolbox.parse(choice.text, output.finish_reason)
    if call is not None:
        for chunk in writer.tool_call_chunks(call, index):
            await _event(response, chunk)
        return
    await _text_then_finish(response, writer, choice.text, output.finish_reason,
                            choice.logprobs, index, include_usage)


async def _text_then_finish(response: web.StreamResponse, writer: ResponseWriter, text: str,
                            finish_reason: str | None, logprobs, index: int,
                            include_usage: bool) -> None:
    """As OpenAI streams: the text, then a chunk of its own with the finish_reason and an empty
    delta (clients that key on that chunk still see every token)."""
    if text:
        await _event(response, writer.chunk(text, with_usage_field=include_usage,
                                            logprobs=logprobs, index=index))
    if finish_reason:
        await _event(response, writer.chunk("", finish_reason, with_usage_field=include_usage,
                                            index=index))


def _generation_error(output: Output) -> APIError:
    if output.unavailable:
        return APIError(503, f"The engine is not serving: {output.error}",
                        code="engine_unavailable")
    return APIError(500, f"Generation failed: {output.error}", code="engine_error")


async def _event(response: web.StreamResponse, payload: dict) -> None:
    await response.write(b"data: " + orjson.dumps(payload) + b"\n\n")


def _json(payload: dict, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status,
                        content_type="application/json")


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every failure leaves in OpenAI's error shape, whatever raised it."""
    try:
        return await handler(request)
    except APIError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return APIError(exc.status, exc.reason).response()
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error serving %s", request.path)
        return APIError(500, "Internal server error").response()


@web.middleware
async def api_keys(request: web.Request, handler) -> web.StreamResponse:
    """/v1/* needs a key when keys are configured; the key's tenant is the cache namespace."""
    keys: KeyRing | None = request.app["gateway"].config.keys
    request["key"], request["tenant"], request["namespace"] = None, None, ""
    admin = request.path.startswith(ADMIN_PREFIX)  # the admin key guards it instead
    if keys is not None and not admin and (request.path.startswith("/v1/")
                                           or request.path in KEYED_PATHS):
        identity = keys.identify(request.headers.get("Authorization"))
        if identity is None:
            raise APIError(401, "Incorrect API key provided. Pass one as `Authorization: "
                                "Bearer <key>`.", code="invalid_api_key")
        request["key"], request["tenant"] = identity
        request["namespace"] = keys.namespace(request["tenant"])
    return await handler(request)


def _require_debug_key(request: web.Request) -> None:
    key = request.app["gateway"].config.debug_key
    if key is None:
        raise web.HTTPNotFound()
    if not bearer_matches(request.headers.get("Authorization"), key):
        raise APIError(401, "This endpoint needs the debug key (--debug-key)",
                       code="invalid_api_key")


def _require_metrics_key(request: web.Request) -> None:
    key = request.app["gateway"].config.metrics_key
    if key is not None and not bearer_matches(request.headers.get("Authorization"), key):
        raise APIError(401, "This endpoint needs the metrics key (--metrics-key)",
                       code="invalid_api_key")


def build_app(gateway: Gateway) -> web.Application:
    app = web.Application(middlewares=[openai_errors, api_keys],
                          client_max_size=gateway.config.limits.max_body_bytes)
    app["gateway"] = gateway
    app.add_routes(routes)
    if gateway.config.cors_origin:
        cors.allow_origin(app, gateway.config.cors_origin)
    return app


async def serve(config: ServerConfig) -> None:
    gateway = Gateway(config)
    if config.keys is None:
        log.warning("no API keys configured (--api-keys-file, PREFIXGATE_API_KEYS): anyone who "
                    "can reach %s:%d may use it, and every request shares one cache namespace",
                    config.host, config.port)
    # Cancelling the handler when its client disconnects is what frees an abandoned sequence.
    runner = web.AppRunner(build_app(gateway), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    log.info("listening on http://%s:%d", config.host, config.port)
    loop = asyncio.get_running_loop()
    loading = loop.run_in_executor(None, gateway.load, loop)

    async def keep_history() -> None:
        while True:
            await asyncio.sleep(HISTORY_STEP)
            if gateway.ready:
                gateway.sample_history()

    history = asyncio.create_task(keep_history())
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # shut down cleanly: the KV arena is unlinked
        loop.add_signal_handler(sig, stopping.set)
    try:
        waiting = asyncio.ensure_future(stopping.wait())
        await asyncio.wait([loading, waiting], return_when=asyncio.FIRST_COMPLETED)
        if gateway.load_error:  # exit, so that a supervisor sees it and the user reads why
            raise SystemExit(f"prefixgate could not start: {gateway.load_error}")
        await waiting
        log.info("stopping: %d requests in flight get up to %.0f s to finish",
                 gateway.workers.n_in_flight, config.drain_seconds)
        await gateway.workers.drain(config.drain_seconds)
    finally:
        await loading
        history.cancel()
        await loop.run_in_executor(None, gateway.close)  # streams still open hear the 503
        await runner.cleanup()
        log.info("stopped after %.0f s", time.monotonic() - gateway.metrics.started)
