"""Dynamo's generate endpoint on a node: its token-level request becomes the same planned
generation the HTTP APIs make, run on the one path (gateway/core/generation.py `running`: the
Redis tier, drafts, the workers, the freeing of everything it held), and its outputs go back as
Dynamo's token chunks: `{"token_ids": [...], "index": 0}`, the last with `finish_reason` and
`completion_usage` (with the prompt tokens the cache served). A request from prefixgate's front
runs the front's own plan (gateway/dynamo/requests.py `Planned`, its pins included) and gets
each output whole besides, as the engine made it, in the chunk's `extra_args`; a refusal at
admission (at capacity) reaches it as such an output, for its client's 429."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from engine.messages import Output, Usage
from gateway.core.generation import Plan, outputs, running, serving
from gateway.core.models import ServedModel
from gateway.core.service import Gateway
from gateway.dynamo import codec
from gateway.dynamo.requests import PLANNED, DynamoRequest, UnsupportedRequest
from gateway.edge.errors import APIError
from gateway.workers.handles import GenerationHandle

log = logging.getLogger(__name__)


class GenerationFailed(RuntimeError):
    """What the frontend hears when a request fails on the node (its message says why)."""


class Generate:
    """The endpoint's handler: `generate(request, context)`, an async generator of chunks."""

    def __init__(self, gateway: Gateway, model: ServedModel) -> None:
        self.gateway = gateway
        self.model = model
        self.stop_tokens = frozenset(int(t) for t in model.vocab.eog_tokens)

    async def __call__(self, body: dict, context: Any) -> AsyncIterator[dict]:
        gateway = self.gateway
        try:
            request = DynamoRequest.of(body)
            asks = serving(gateway, self.model, request.namespace)
            plan = Plan(request.planned_generation(asks), pins=request.planned_pins(
                self.model.config.workers.pin_hours * 3600)) if request.planned \
                else Plan(request.to_generation(asks, self.stop_tokens))
        except UnsupportedRequest as exc:
            raise GenerationFailed(f"prefixgate refused the request: {exc}") from None
        generation, whole, last = plan.generation, request.planned is not None, None
        try:
            async with running(gateway, self.model, plan, key=None) as (handles, choices, _):
                watcher = asyncio.ensure_future(_on_stop(context, handles))
                try:
                    timer = gateway.metrics.request_timer(self.model.name,
                                                          len(generation.prompt_tokens))
                    async with contextlib.aclosing(outputs(handles, choices, timer)) as stream:
                        async for _, output in stream:
                            if context.is_stopped() or context.is_killed():  # client gone
                                return
                            if output.error and not whole:
                                raise GenerationFailed(f"generation failed on the node: "
                                                       f"{output.error}")
                            if output.last:
                                last = chunk(output, whole)
                            else:
                                yield chunk(output, whole)
                finally:
                    watcher.cancel()
            # The last chunk once the request has let go of what it held and its pins are set
            # for what it stored: the next request finds them, as on the HTTP APIs. A front
            # reads a failure whole: an engine that died (unavailable) is a 503 there, and a
            # request that has streamed nothing yet may go to another node.
            yield last
        except APIError as exc:  # refused at admission: at capacity, or no engine serving
            if not whole:
                raise GenerationFailed(f"prefixgate refused the request ({exc.status}): "
                                       f"{exc.message}") from None
            # A front reads why, and answers its client as a single gateway would (a 429).
            yield chunk(Output(error=exc.message, refused=exc.status == 429,
                               unavailable=exc.status == 503), whole)
        except asyncio.CancelledError:
            log.info("a Dynamo request was cancelled")
            raise


async def _on_stop(context: Any, handles: list[GenerationHandle]) -> None:
    """The frontend stopped the request (its client went away, or a front moved it to another
    node) before its end, maybe before its first output (waiting for a sequence): its
    sequences are freed now, and the stream wakes to end."""
    await context.async_killed_or_stopped()
    for handle in handles:
        handle.cancel()  # before the wake-up, which would leave it finished, never cancelled
        handle.put(Output(error="stopped by Dynamo"))


def chunk(output: Output, whole: bool = False) -> dict:
    """One output as Dynamo's LLMEngineOutput; `whole`: the engine's Output too, for a front."""
    out: dict = {"token_ids": list(output.token_ids), "index": 0}
    if whole:
        out["extra_args"] = {PLANNED: codec.encode(output)}
    if output.logprobs:
        out["log_probs"] = [p.logprob for p in output.logprobs]
        out["top_logprobs"] = [[{"rank": rank, "token_id": token, "logprob": logprob}
                                for rank, (token, logprob) in enumerate(p.top, 1)]
                               for p in output.logprobs]
    if output.usage is not None:
        out["finish_reason"] = output.finish_reason
        out["completion_usage"] = usage(output.usage)
    return out


def usage(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}
