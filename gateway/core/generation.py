"""The one generation path every API shares. An API handler parses its body (a `Generating`
request model) and renders its prompt (a `RenderedPrompt`); from there the path is the same for
all of them:

    rate limit (the prompt's tokens) -> the plan (the request's asks over the server's bounds;
    its grammar: built on a thread) -> the Redis tier on a local miss -> a worker (or a 429)
    -> pins -> outputs -> the Wire

A Wire is all that differs: how one API words the outputs, whole or as a stream of events. One
streaming loop (`_stream`) serves every API, with its deadline, its mid-stream errors and the
freeing of everything the request held, whatever the client does.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import orjson
from aiohttp import web

from engine.messages import EngineUnavailable, GenerationRequest, Output, TokenLogprob, Usage
from gateway.core.cache_sources import HEADER, Held, header_value, held_for
from gateway.core.models import ServedModel
from gateway.core.requests import Generating, RequestT, Serving, parse_request
from gateway.core.service import Gateway
from gateway.edge.errors import APIError, invalid
from gateway.edge.metrics import NO_MODEL
from gateway.formats.chat_formats import OutputParser, Part, call_grammar_of
from gateway.formats.prompts import Pin, RenderedPrompt
from gateway.workers.handles import GenerationHandle
from gateway.workers.shared_pool import SharedPool
from gateway.workers.supervisor import Overloaded

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1  # a 429's advice: the OpenAI SDK waits that long, then retries
FINAL_WRITE_SECONDS = 5  # how long a timed-out stream waits for its client to take the error
HISTORY_TOKENS = 1024  # most of an earlier answer to the same prompt a request drafts from

# A test-only hook, set by the tests' own entry point (tests/replay_gateway.py) and by nothing a
# production server runs (no flag, no environment variable): given a prompt's text, a completion
# to replay through the engine instead of sampling one, or None. Called on a thread (it reads a
# file).
replay: Callable[[str], str | None] | None = None


@dataclass(frozen=True)
class Plan:
    """What a request asks of the path."""

    generation: GenerationRequest
    n: int = 1  # choices, sharing the prompt's cells
    stream: bool = False
    cache_key: str | None = None  # routing affinity (OpenAI's prompt_cache_key)
    pins: tuple[Pin, ...] = ()


@dataclass(frozen=True)
class Growth:
    """What one output added to one part of a choice: `delta` is its new text (reasoning,
    answer, or a call's arguments); `new` when the part began with this output."""

    index: int  # the part's place among the choice's parts
    part: Part
    delta: str
    new: bool
    call_index: int = 0  # a call's place among the choice's calls (OpenAI's tool_calls index)


@dataclass
class Choice:
    """One of a request's n answers, as it grows: its raw text, and that text read as parts
    (reasoning, text, calls) in the model's own format."""

    text: str = ""
    finish_reason: str | None = None
    stop_sequence: str | None = None  # the stop string that ended it
    logprobs: list[TokenLogprob] = field(default_factory=list)
    usage: Usage | None = None  # on its last output
    cached: int | None = None  # prompt tokens a cache served: on its first output, or its last
    generated: tuple[int, ...] = ()  # its token ids, once it has ended
    n_generated: int = 0  # completion tokens so far, also when it never finishes
    parts: list[Part] = field(default_factory=list)
    logprobs_sent: int = 0  # how many of its logprobs went out with text
    reader: OutputParser | None = None  # the parser's reader of this choice's text

    def grow(self, parser: OutputParser | None, final: bool) -> list[Growth]:
        """Read the text so far into parts; what each part gained since the last read. The
        choice's own reader reads it: a token costs the same however long the answer is."""
        if parser is None:
            parts = [Part("text", self.text)]
        else:
            self.reader = self.reader or parser.reader()
            parts = self.reader.read(self.text, final)
        growth, calls = [], 0
        for i, part in enumerate(parts):
            if i < len(self.parts):
                old = self.parts[i]
                part.id = old.id
                delta, new = part.text[len(old.text):], False
            else:
                if part.kind == "call" and part.id is None:
                    part.id = f"call_{uuid.uuid4().hex[:24]}"
                delta, new = part.text, True
            if new or delta or (part.kind == "call" and part.done != self.parts[i].done):
                growth.append(Growth(i, part, delta, new, calls))
            calls += part.kind == "call"
        self.parts = parts
        return growth

    def new_logprobs(self) -> list[TokenLogprob]:
        """The logprobs not yet sent (they go out with the text they belong to)."""
        sent, self.logprobs_sent = self.logprobs_sent, len(self.logprobs)
        return self.logprobs[sent:]

    def answer(self) -> str:
        return "".join(p.text for p in self.parts if p.kind == "text")

    def reasoning(self) -> str:
        return "".join(p.text for p in self.parts if p.kind == "reasoning")

    def calls(self) -> list[Part]:
        return [p for p in self.parts if p.kind == "call"]

    def reason(self) -> str | None:
        """Why it ended, as OpenAI says it: `tool_calls` when it ended by itself on calls."""
        if self.finish_reason == "stop" and self.calls():
            return "tool_calls"
        return self.finish_reason


@dataclass(frozen=True)
class Event:
    """One server-sent event: OpenAI's are bare `data:` lines, Anthropic's are named."""

    data: dict
    name: str | None = None

    def encode(self) -> bytes:
        head = b"event: " + self.name.encode() + b"\n" if self.name else b""
        return head + b"data: " + orjson.dumps(self.data) + b"\n\n"


class Wire:
    """How one API words a request's outputs."""

    terminator = b""  # written after the last event (OpenAI's `data: [DONE]`)
    parser: OutputParser | None = None  # reads answers in the model's format; None: plain

    def whole(self, choices: list[Choice], usage: Usage) -> dict:
        raise NotImplementedError

    def opening(self, n_choices: int) -> list[Event]:
        return []

    def on_output(self, index: int, output: Output, choice: Choice,
                  growth: list[Growth]) -> list[Event]:
        """Events for one output of choice `index` (already added to `choice`), which grew
        its parts by `growth`."""
        raise NotImplementedError

    def closing(self, choices: list[Choice], usage: Usage) -> list[Event]:
        """Events after every choice has finished."""
        return []

    def failure(self, error: APIError) -> list[Event]:
        """A failure after the stream's 200 was sent."""
        raise NotImplementedError


async def generate(request: web.Request, model: ServedModel, body: Generating,
                   prompt: RenderedPrompt, wire: Wire) -> web.StreamResponse:
    """prompt -> (rate limit, plan, Redis tier, pins) -> worker -> the wire's answer."""
    gateway: Gateway = request.app["gateway"]
    limits = gateway.config.limits
    prompt_tokens = prompt.tokens
    admit_prompt(gateway, model, request["key"], len(prompt_tokens))  # before building a grammar
    # The model loaded first, if it is not (the request waits, as in a queue: its plan reads
    # the model's context), and never unloaded while the request holds it.
    try:
        async with gateway.models.serving(model, limits.request_timeout):
            return await _generate(request, model, body, prompt, wire)
    except Overloaded as exc:  # too many wait for the model to load (the workers' are _submit's)
        gateway.metrics.refused.labels(model.name, "capacity").inc()
        raise _at_capacity(str(exc)) from None


async def _generate(request: web.Request, model: ServedModel, body: Generating,
                    prompt: RenderedPrompt, wire: Wire) -> web.StreamResponse:
    gateway: Gateway = request.app["gateway"]
    limits = gateway.config.limits
    prompt_tokens = prompt.tokens
    # Building a grammar from a schema takes time: off the event loop the streams share.
    planned = await asyncio.to_thread(_plan, request, model, body, prompt)
    generation = _in_format(model, planned.generation, wire)
    if replay is not None:
        generation = await asyncio.to_thread(_replayed, model, generation, prompt_tokens)
    if planned.n > limits.max_n:
        raise invalid(f"n is {planned.n}; this server answers at most {limits.max_n} choices "
                      "(--max-n)", "n")
    async with running(gateway, model, dataclasses.replace(planned, generation=generation),
                       request["key"]) as (handles, choices, held):
        timer = gateway.metrics.request_timer(model.name, len(prompt_tokens))

        def cache_header() -> dict[str, str]:
            """What the first choice got from the cache (its usage's cached tokens)."""
            return {HEADER: header_value(choices[0].cached or 0, len(prompt_tokens), held)}

        try:
            if planned.stream:
                return await _stream(request, handles, wire, timer, limits.request_timeout,
                                     choices, cache_header)
            return await _collect(handles, wire, timer, limits.request_timeout, choices,
                                  cache_header)
        finally:
            if gateway.config.log_prompts:
                log.info("tenant %r model %r prompt %r answers %r", request["tenant"],
                         model.name, model.vocab.detokenize(prompt_tokens),
                         [c.text for c in choices])


@contextlib.asynccontextmanager
async def running(gateway: Gateway, model: ServedModel, plan: Plan, key: str | None
                  ) -> AsyncIterator[tuple[list[GenerationHandle], list[Choice], Held]]:
    """A planned request in flight on the model's workers (loaded: Models.serving), whatever
    API it came by: the Redis tier, drafts and routing read first, its pins set, and on the way
    out its sequences freed (whether or not its client stayed), its tokens charged to `key`'s
    rate and its pins set again for what it stored. Yields its handles, a Choice for each, and
    what the cache held for it."""
    pool = model.engines.pool
    # The index's lock is taken by the workers' reader threads too: the event loop never waits
    # for it (nor for Redis), every call to the index is made on a thread.
    generation, held, in_pool = await asyncio.to_thread(_routing, model, plan.generation)
    # Pins go with the request to engines whose pool is elsewhere (a Dynamo node's); this
    # process's pool is pinned here.
    pins = plan.pins if pool is not None else ()
    handles = _submit(gateway, model, _choices(generation, plan.n), plan.cache_key, in_pool,
                      plan.pins if pool is None else ())
    choices = [Choice() for _ in handles]
    try:
        # Pins once admitted (a request refused with a 429 pins nothing): what is cached
        # already, now; the rest once it is stored.
        if pins:
            await asyncio.to_thread(_pin, pool, generation, pins)
        yield handles, choices, held
    finally:
        for handle in handles:
            handle.cancel()  # a no-op once finished; frees the sequence if the client left
        _charge_rate(gateway, key, choices)
        if pins:  # before a whole answer goes out: the next request finds them pinned
            await asyncio.to_thread(_pin, pool, generation, pins)


def _plan(request: web.Request, model: ServedModel, body: Generating,
          prompt: RenderedPrompt) -> Plan:
    """The request's asks over the server's bounds and the model's defaults, the grammar of
    calls in the model's format, the tokens it predicted, and its pins: the breakpoints' and,
    with 24h retention, the whole prompt's."""
    gateway: Gateway = request.app["gateway"]
    generation = body.to_generation(prompt.tokens, serving(gateway, model, request["namespace"]),
                                    call_grammar_of(prompt.parser))
    if predicted := body.predicted_text():
        generation = dataclasses.replace(generation, prediction=tuple(
            model.vocab.tokenize(predicted, add_special=False, parse_special=False)))
    pins = prompt.pins
    if body.keeps_prompt():
        pins = (Pin(len(prompt.tokens), model.config.workers.pin_hours * 3600), *pins)
    return Plan(generation, body.n_choices(), body.stream, body.routing_key(), pins)


def serving(gateway: Gateway, model: ServedModel, namespace: str) -> Serving:
    """What a request's asks are read over: the model's context and defaults, the server's
    bounds."""
    return Serving(model.engines.seq_len, model.vocab.n_vocab, gateway.config.limits.max_tokens,
                   model.config.sampling, namespace)


def _routing(model: ServedModel, generation: GenerationRequest
             ) -> tuple[GenerationRequest, Held, int]:
    """What routing a request reads of the cache, on a thread: the Redis tier on a local miss
    (another replica's hit?), an earlier answer to the same prompt to draft from, what each
    tier holds (before the request is in flight itself) and what the pool holds."""
    engines = model.engines
    pool = engines.pool
    if pool is None:
        return generation, held_for(engines, generation, 0, 0), 0
    adopted = pool.fetch_from_tier(generation) if pool.tier is not None else 0
    if model.config.workers.engine.speculation is not False:  # None: the worker decides
        generation = dataclasses.replace(generation, history=pool.history(
            generation, min(generation.max_tokens, HISTORY_TOKENS)))
    in_pool = pool.cached_length(generation)
    return generation, held_for(engines, generation, adopted, in_pool), in_pool


def _pin(pool: SharedPool, generation: GenerationRequest, pins: tuple[Pin, ...]) -> None:
    for pin in pins:
        pool.pin(generation, pin.n_tokens, pin.seconds)


def _in_format(model: ServedModel, generation: GenerationRequest, wire: Wire
               ) -> GenerationRequest:
    """What the model's chat format adds to a generation: its markers kept in the output
    text for the parser."""
    if wire.parser is not None:
        generation = dataclasses.replace(generation, shown_tokens=model.prompts.shown_tokens)
    return generation


def _replayed(model: ServedModel, generation: GenerationRequest, prompt_tokens: list[int]
              ) -> GenerationRequest:
    """In tests, a scripted completion for the prompt (the `replay` hook), if it has one."""
    output = replay(model.vocab.detokenize(prompt_tokens))
    if output is None:
        return generation
    script = tuple(model.prompts.tokenize_rendered(output))
    return dataclasses.replace(generation, sampler=dataclasses.replace(
        generation.sampler, script=script))


async def read_body(request: web.Request, kind: type[RequestT]
                    ) -> tuple[RequestT, ServedModel]:
    """A request's body, parsed as `kind`, and the served model it names, within its key's
    rate limit: before any work on it."""
    body = parse_request(kind, await request.read())
    model = requested_model(request, body.model)
    admit(request)
    return body, model


def requested_model(request: web.Request, name: str) -> ServedModel:
    """The served model `name` names (Gateway.require_model), noted on the request: the
    `model` its metrics are counted under (its id, whatever alias the client wrote)."""
    model = request.app["gateway"].require_model(name)
    request["model"] = model.name
    return model


def metrics_model(request: web.Request) -> str:
    """The `model` label of a request's metrics: its served model's id, once it is known."""
    return request.get("model", NO_MODEL)


def admit(request: web.Request) -> None:
    """The key's rate limit, before any work on the request (rendering, tokenizing, grammars)."""
    gateway: Gateway = request.app["gateway"]
    if gateway.rate_limiter is not None and request["key"] is not None:
        _refuse_for(gateway, metrics_model(request), gateway.rate_limiter.admit(request["key"]))


def admit_prompt(gateway: Gateway, model: ServedModel, key: str | None,
                 prompt_tokens: int) -> None:
    if gateway.rate_limiter is not None and key is not None:
        _refuse_for(gateway, model.name, gateway.rate_limiter.admit_prompt(key, prompt_tokens))


def _refuse_for(gateway: Gateway, model: str, wait: int | None) -> None:
    if wait is not None:
        gateway.metrics.refused.labels(model, "rate_limit").inc()
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


def _submit(gateway: Gateway, model: ServedModel, generations: list[GenerationRequest],
            cache_key: str | None, pool_cached: int, pins: tuple[Pin, ...]
            ) -> list[GenerationHandle]:
    try:
        return model.engines.submit_group(generations, cache_key, pool_cached, pins)
    except Overloaded as exc:
        gateway.metrics.refused.labels(model.name, "capacity").inc()
        raise _at_capacity(str(exc)) from None
    except EngineUnavailable as exc:
        raise APIError(503, f"The engine is not serving: {exc}", code="engine_unavailable"
                       ) from None


def _at_capacity(reason: str) -> APIError:
    return _refusal(f"The server is at capacity ({reason}); retry shortly")


def _refusal(message: str) -> APIError:
    return APIError(429, message, code="rate_limit_exceeded",
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def _timed_out(seconds: float) -> APIError:
    return APIError(504, f"The request did not finish within {seconds:g} s (--request-timeout)",
                    code="timeout")


async def outputs(handles: list[GenerationHandle], choices: list[Choice],
                   timer) -> AsyncIterator[tuple[int, Output]]:
    """Every choice's outputs as they come, with the choice's index, each one timed and added
    to its Choice first (text, logprobs; on the last one why it ended and its usage)."""
    unfinished = len(handles)
    async with contextlib.aclosing(_merged(handles)) as merged:
        async for i, output in merged:
            timer.on_output(output)
            choice = choices[i]
            choice.text += output.text
            choice.logprobs += output.logprobs
            choice.n_generated = max(choice.n_generated, output.n_generated)
            if choice.cached is None:
                choice.cached = output.usage.cached_tokens if output.usage \
                    else output.cached_tokens
            if output.usage:
                choice.finish_reason, choice.usage = output.finish_reason, output.usage
                choice.stop_sequence, choice.generated = output.stop_sequence, output.generated
            yield i, output
            unfinished -= output.last
            if not unfinished:
                return


async def _merged(handles: list[GenerationHandle]) -> AsyncIterator[tuple[int, Output]]:
    """The handles' outputs in arrival order, with the handle's index. A lone request's go
    straight through: a task and a queue in between would cost a wake-up per token."""
    if len(handles) == 1:
        async for output in handles[0].outputs():
            yield 0, output
        return
    merged: asyncio.Queue[tuple[int, Output]] = asyncio.Queue()

    async def pump(i: int, handle: GenerationHandle) -> None:
        async for output in handle.outputs():
            await merged.put((i, output))

    pumps = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        while True:
            yield await merged.get()
    finally:
        for task in pumps:
            task.cancel()


def total_usage(choices: list[Choice]) -> Usage:
    """The prompt once, every choice's completion tokens."""
    usages = [c.usage for c in choices if c.usage]
    return Usage(usages[0].prompt_tokens, sum(u.completion_tokens for u in usages),
                 usages[0].cached_tokens,
                 sum(u.accepted_prediction_tokens for u in usages),
                 sum(u.rejected_prediction_tokens for u in usages))


async def _collect(handles: list[GenerationHandle], wire: Wire, timer, timeout: float | None,
                   choices: list[Choice], cache_header: Callable[[], dict[str, str]]
                   ) -> web.Response:
    try:
        async with asyncio.timeout(timeout):
            async for i, output in outputs(handles, choices, timer):
                if output.error:
                    raise _generation_error(output)
                if output.last:
                    choices[i].grow(wire.parser, final=True)
    except TimeoutError:
        raise _timed_out(timeout) from None
    return json_response(wire.whole(choices, total_usage(choices)), headers=cache_header())


async def _stream(request: web.Request, handles: list[GenerationHandle], wire: Wire, timer,
                  timeout: float | None, choices: list[Choice],
                  cache_header: Callable[[], dict[str, str]]) -> web.StreamResponse:
    """The headers go once the first choice says what the cache gave it (its first output), so
    that they can say it too; the events made until then wait for them, in order."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    held: list[Event] = wire.opening(len(handles))

    async def send(events: list[Event], opened: bool = False) -> None:
        nonlocal held
        if not response.prepared:
            if choices[0].cached is None and not opened:
                held += events
                return
            response.headers.update(cache_header())
            await response.prepare(request)
            events, held = [*held, *events], []
        await _send(response, events)

    try:
        async with asyncio.timeout(timeout):
            async for i, output in outputs(handles, choices, timer):
                if output.error:
                    error = _generation_error(output)
                    if output.refused and not response.prepared:  # as refused at admission
                        raise error
                    await send(wire.failure(error), opened=True)
                    break
                growth = choices[i].grow(wire.parser, final=output.last)
                await send(wire.on_output(i, output, choices[i], growth))
            else:
                await send(wire.closing(choices, total_usage(choices)), opened=True)
    except TimeoutError:
        for handle in handles:  # freed at the deadline, whatever the client's socket does
            handle.cancel()
        await send([], opened=True)
        await _finish_stream(request, response, wire, _timed_out(timeout))
        return response
    await response.write(wire.terminator)
    await response.write_eof()
    return response


async def _finish_stream(request: web.Request, response: web.StreamResponse, wire: Wire,
                         error: APIError) -> None:
    """The error event and the end, if the client takes them soon; else the connection goes."""
    try:
        async with asyncio.timeout(FINAL_WRITE_SECONDS):
            await _send(response, wire.failure(error))
            await response.write(wire.terminator)
            await response.write_eof()
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()


async def _send(response: web.StreamResponse, events: list[Event]) -> None:
    if events:
        await response.write(b"".join(event.encode() for event in events))


def _generation_error(output: Output) -> APIError:
    if output.refused:  # by an engine elsewhere, in its own words (its _at_capacity)
        return _refusal(output.error)
    if output.unavailable:
        return APIError(503, f"The engine is not serving: {output.error}",
                        code="engine_unavailable")
    return APIError(500, f"Generation failed: {output.error}", code="engine_error")


def json_response(payload: dict, status: int = 200,
                  headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status,
                        content_type="application/json", headers=headers)
