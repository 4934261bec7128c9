"""OpenAI's Responses API (/v1/responses), for the openai SDK's `client.responses`, the Agents
SDK and Codex: each request translated into chat messages (gateway/responses/requests.py),
rendered by the one prompt path and sent down the one generation path; its outputs worded by
gateway/responses/wire.py."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import redis
from aiohttp import web

from gateway.core.conversation import CalledFunction, CalledTool, Message
from gateway.core.generation import Choice, generate, json_response, read_body
from gateway.core.models import ServedModel
from gateway.core.service import Gateway
from gateway.edge.errors import APIError, invalid
from gateway.formats.prompts import RenderedPrompt, breakpoint_pins
from gateway.formats.tools import Toolbox
from gateway.responses.requests import ResponsesRequest, with_instructions
from gateway.responses.shared_store import DELETED
from gateway.responses.store import StoredResponse
from gateway.responses.wire import ResponsesWire

log = logging.getLogger(__name__)

routes = web.RouteTableDef()
_hosted_logged: set[str] = set()  # each hosted tool type is logged once


@routes.post("/v1/responses")
async def create_response(request: web.Request) -> web.StreamResponse:
    gateway: Gateway = request.app["gateway"]
    body, model = await read_body(request, ResponsesRequest)
    _leave_out_hosted_tools(gateway, model, body)
    context = await response_prompt(gateway, model, body, owner(request), with_pins=True)
    prompt = context.prompt
    body.check_compaction(len(prompt.tokens))

    def store(done: dict, choice: Choice) -> None:
        if body.store:
            entry = StoredResponse.make(
                done["id"], owner(request), done, body.input_items(),
                [*context.turns, _answer(choice)], body.instructions, context.tools_text,
                prompt.text + choice.text, prompt.tokens + list(choice.generated),
                context.parent, fingerprint=model.fingerprint)
            gateway.responses.put(entry)
            if gateway.shared_responses is not None:
                gateway.shared_responses.put(entry)

    token_bytes = model.vocab.token_piece if body.logprob_count() is not None else None
    wire = ResponsesWire(_echo(body), prompt.parser, body.namespaced(), len(prompt.tokens),
                         token_bytes, store)
    return await generate(request, model, body, prompt, wire)


@dataclass(frozen=True)
class ResponsePrompt:
    """A Responses request's prompt, and what storing its response keeps beside it."""

    prompt: RenderedPrompt  # its messages with the instructions
    turns: list[Message]  # the conversation, without instructions
    tools_text: str
    parent: StoredResponse | None  # the stored response whose conversation this one extends


async def response_prompt(gateway: Gateway, model: ServedModel, body: ResponsesRequest,
                          owner: str, with_pins: bool = False) -> ResponsePrompt:
    """The prompt of a Responses request, continuing the owner's stored response it names
    (POST /v1/responses and /v1/cache/explain)."""
    previous = None
    if body.previous_response_id is not None:
        previous = await _lookup(gateway, body.previous_response_id, owner)
        if previous is None:
            raise invalid(f"Previous response with id '{body.previous_response_id}' not found.",
                          "previous_response_id", "previous_response_not_found")
    return await asyncio.to_thread(_render, model, body, body.toolbox(), previous, with_pins)


def _render(model: ServedModel, body: ResponsesRequest, toolbox: Toolbox | None,
            previous: StoredResponse | None, with_pins: bool = False) -> ResponsePrompt:
    """The prompt. A continuation of a stored response on the same model, with the same
    instructions and tools, starts from that response's own tokens (its prompt's and its
    generated ones), followed by the new input as the template renders the next turn: its
    history is never tokenized again, so all of it loads from the cache, and it is stored as
    that response's child (what it adds). Anything else (another model's tokens mean nothing
    here) is rendered afresh from the conversation, and stored whole."""
    history = previous.conversation() if previous else None
    turns = body.turns(history)
    messages = with_instructions(turns, body.instructions)
    tools_text = toolbox.system_text() if toolbox is not None else ""
    text = model.prompts.render_chat(messages, toolbox, body.reasoning_settings(), "input")
    continued = previous is not None and previous.fingerprint == model.fingerprint \
        and previous.instructions == body.instructions and previous.tools_text == tools_text
    extended = previous if continued else None
    tokens = _tokens(model, text, extended)
    parent = None
    # Its history as it was (the input may add a call to the last assistant turn).
    if continued and text.startswith(previous.all_text()) \
            and all(kept is same for kept, same in zip(history, turns, strict=False)):
        parent = previous

    def cut_tokens(cut: tuple[int, int]) -> list[int]:
        cut_turns = with_instructions(body.cut(*cut).turns(history), body.instructions)
        return _tokens(model, model.prompts.render_chat(
            cut_turns, toolbox, body.reasoning_settings(), "input"), extended)

    pins = breakpoint_pins(
        tokens, [((i, p), seconds) for i, p, seconds in body.cache_breakpoints()],
        cut_tokens, model.config.workers.pin_hours * 3600) if with_pins else ()
    prompt = RenderedPrompt(text, tokens, model.prompts.parser(toolbox, text), messages, pins)
    return ResponsePrompt(prompt, turns, tools_text, parent)


def _tokens(model: ServedModel, text: str, previous: StoredResponse | None) -> list[int]:
    """A rendered prompt's tokens: a continuation whose text extends the stored response's
    starts from that response's own tokens."""
    previous_text = previous.all_text() if previous else ""
    if previous is not None and text.startswith(previous_text):
        return previous.all_tokens() + model.prompts.tokenize_rendered(
            text[len(previous_text):])
    return model.prompts.tokenize_rendered(text)


def _answer(choice: Choice) -> Message:
    """A response's answer as the next turn's history holds it."""
    calls = [CalledTool(id=call.id, type="function", function=CalledFunction(
        name=call.name, arguments=call.text)) for call in choice.calls()]
    return Message(role="assistant", content=choice.answer(), tool_calls=calls or None,
                   reasoning_content=choice.reasoning() or None)


@routes.get("/v1/responses/{response_id}")
async def retrieve_response(request: web.Request) -> web.Response:
    return web.Response(body=(await _stored(request)).body, content_type="application/json")


@routes.delete("/v1/responses/{response_id}")
async def delete_response(request: web.Request) -> web.Response:
    gateway: Gateway = request.app["gateway"]
    response_id = (await _stored(request)).id
    gateway.responses.delete(response_id, owner(request))
    if gateway.shared_responses is not None:
        try:
            await asyncio.to_thread(gateway.shared_responses.delete, response_id)
        except redis.RedisError as exc:
            raise APIError(503, f"The response store (Redis) is not answering: {exc}",
                           code="store_unavailable") from None
    return json_response({"id": response_id, "object": "response", "deleted": True})


@routes.get("/v1/responses/{response_id}/input_items")
async def input_items(request: web.Request) -> web.Response:
    """A page of the response's input items, as OpenAI lists them: `limit` (1-100, 20),
    `order` (`desc` by default, or `asc`), `after` an item id."""
    items = (await _stored(request)).listed_items()
    query = request.query
    try:
        limit = int(query.get("limit", 20))
    except ValueError:
        raise invalid("limit must be an integer", "limit") from None
    if not 1 <= limit <= 100:
        raise invalid("limit must be between 1 and 100", "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order must be 'asc' or 'desc'", "order")
    ordered = items if order == "asc" else items[::-1]
    if "after" in query:
        ids = [item["id"] for item in ordered]
        if query["after"] not in ids:
            raise invalid(f"No input item with id '{query['after']}'", "after")
        ordered = ordered[ids.index(query["after"]) + 1:]
    page = ordered[:limit]
    return json_response({"object": "list", "data": page,
                          "first_id": page[0]["id"] if page else None,
                          "last_id": page[-1]["id"] if page else None,
                          "has_more": len(ordered) > limit})


async def _stored(request: web.Request) -> StoredResponse:
    """The tenant's stored response, else a 404 (another tenant's is as good as absent)."""
    gateway: Gateway = request.app["gateway"]
    response_id = request.match_info["response_id"]
    stored = await _lookup(gateway, response_id, owner(request))
    if stored is None:
        raise _not_found(response_id)
    return stored


def owner(request: web.Request) -> str:
    """Whose stored responses a request sees: its key's tenant, never its cache namespace
    (the tenants of --shared-prefix-tenants share one). Without keys, one anonymous owner."""
    return request.get("tenant") or ""


async def _lookup(gateway: Gateway, response_id: str, owner: str
                  ) -> StoredResponse | None:
    """The tenant's stored response: Redis's word first when there is a Redis (a tombstone
    means deleted through some replica), then this replica's own copy (a turn continuing it
    is kept as its child), else Redis's."""
    shared = gateway.shared_responses
    found = None
    if shared is not None:
        try:
            found = await asyncio.to_thread(shared.get, response_id)
        except redis.RedisError as exc:
            log.warning("the response store in Redis is not answering: %s", exc)
        if found is DELETED:
            gateway.responses.delete(response_id, owner)
            return None
    own = gateway.responses.get(response_id, owner)
    if own is None and isinstance(found, StoredResponse) and found.owner == owner:
        return found
    return own


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", code="not_found")


def _leave_out_hosted_tools(gateway: Gateway, model: ServedModel, body: ResponsesRequest
                            ) -> None:
    for kind in body.hosted_tools():
        gateway.metrics.hosted_tools_left_out.labels(model.name, kind).inc()
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
