"""OpenAI's Responses API (/v1/responses), for the openai SDK's `client.responses`, the Agents
SDK and Codex: each request translated into chat messages (gateway/responses_protocol.py),
rendered by the one prompt path and sent down the one generation path; its outputs worded by
gateway/responses_wire.py."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from engine.messages import GenerationRequest
from gateway.errors import invalid
from gateway.generation import Pin, Plan, admit, generate
from gateway.protocol import completion_room, parse_request, sampler_settings
from gateway.responses_protocol import ResponsesRequest
from gateway.responses_wire import ResponsesWire
from gateway.service import Gateway

log = logging.getLogger(__name__)
LOGPROBS = "message.output_text.logprobs"

routes = web.RouteTableDef()
_hosted_logged: set[str] = set()  # each hosted tool type is logged once


@routes.post("/v1/responses")
async def create_response(request: web.Request) -> web.StreamResponse:
    gateway: Gateway = request.app["gateway"]
    body = parse_request(ResponsesRequest, await request.read())
    gateway.require_model(body.model)
    admit(request)
    _leave_out_hosted_tools(gateway, body)
    toolbox = body.toolbox()
    try:
        prompt_tokens = await asyncio.to_thread(gateway.prompts.chat, body.chat_messages(),
                                                toolbox)
    except ValueError as exc:  # the chat template refused the messages (raise_exception)
        raise invalid(f"The chat template rejected the input: {exc}", "input") from None
    logprobs = LOGPROBS in (body.include or []) or body.top_logprobs is not None
    wire = ResponsesWire(_echo(body), toolbox, body.namespaced(), len(prompt_tokens),
                         gateway.model.token_piece if logprobs else None)

    def plan() -> Plan:
        generation = GenerationRequest(
            prompt_tokens=prompt_tokens,
            max_tokens=completion_room(len(prompt_tokens), gateway.workers.seq_len,
                                       body.max_output_tokens, gateway.config.limits.max_tokens,
                                       "input"),
            sampler=sampler_settings(gateway.config.sampling, body.temperature, body.top_p,
                                     grammar=body.output_grammar(toolbox)),
            namespace=request["namespace"],
            logprobs=(body.top_logprobs or 0) if logprobs else None)
        pins = (Pin(len(prompt_tokens), gateway.config.workers.pin_hours * 3600),) \
            if body.prompt_cache_retention == "24h" else ()
        return Plan(generation, stream=body.stream, cache_key=body.prompt_cache_key, pins=pins)

    return await generate(request, prompt_tokens, plan, wire)


def _leave_out_hosted_tools(gateway: Gateway, body: ResponsesRequest) -> None:
    for kind in body.hosted_tools():
        gateway.metrics.hosted_tools_left_out.labels(kind).inc()
        if kind not in _hosted_logged:
            _hosted_logged.add(kind)
            log.warning("/v1/responses: the hosted tool %r cannot run here; it is left out of "
                        "what the model sees (counted in "
                        "prefixgate_responses_hosted_tools_left_out_total)", kind)


def _echo(body: ResponsesRequest) -> dict:
    """What a response object repeats of its request, as OpenAI's does."""
    return {
        "model": body.model, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": True if body.parallel_tool_calls is None
        else body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": body.reasoning or {"effort": None, "summary": None},
        "store": body.store, "temperature": body.temperature, "top_p": body.top_p,
        "top_logprobs": body.top_logprobs,
        "text": body.text.model_dump(exclude_none=True, by_alias=True) if body.text
        else {"format": {"type": "text"}},
        "tool_choice": body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump")
        else body.tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "truncation": body.truncation or "disabled", "user": body.user,
        "metadata": body.metadata or {}, "prompt_cache_key": body.prompt_cache_key,
        "prompt_cache_retention": body.prompt_cache_retention,
        "safety_identifier": body.safety_identifier, "background": False,
        "service_tier": "default",
    }
