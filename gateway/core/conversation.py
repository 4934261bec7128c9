"""The conversation every API translates into: messages of text parts, the tool calls of
earlier turns, the tools offered and the one a request may force, and the prompt-cache
breakpoints OpenAI's clients mark. Chat completions reads it as it is; Anthropic's Messages and
OpenAI's Responses build it from their own shapes (gateway/anthropic/, gateway/responses/), and
the chat template renders it (gateway/formats/prompts.py)."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import Field

from gateway.core import bounds
from gateway.core.bounds import at_most
from gateway.core.requests import Strict
from gateway.edge.errors import invalid

BREAKPOINT_SECONDS = {"30m": 1800.0, "12h": 43200.0}


class PromptCacheBreakpoint(Strict):
    """The end of a reusable prefix, as OpenAI marks it: chat pins the prompt up to it."""

    mode: Literal["explicit"]
    ttl: Literal["30m", "12h"] | None = None


class PromptCacheOptions(Strict):
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m", "12h"] | None = None


def written_breakpoints(marks: list[tuple[int, int, PromptCacheBreakpoint]],
                        options: PromptCacheOptions | None) -> list[tuple[int, int, float]]:
    """Marked parts, (message or item, part, mark) in prompt order, as (message, part, seconds)
    for those OpenAI writes: the latest four with prompt_cache_options.mode `explicit`, else the
    latest three (beside its implicit breakpoint: here, the cache itself). A mark's TTL is its
    own, else the request's prompt_cache_options.ttl, else 30m."""
    default = options.ttl if options is not None and options.ttl else "30m"
    explicit = options is not None and options.mode == "explicit"
    kept = marks[-(bounds.CACHE_BREAKPOINTS - (0 if explicit else 1)):]
    return [(m, p, BREAKPOINT_SECONDS[mark.ttl or default]) for m, p, mark in kept]


class TextPart(Strict):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None


class CalledFunction(Strict):
    name: str
    arguments: str

    def value(self) -> Any:
        return arguments_value(self.arguments)


def arguments_value(arguments: str) -> Any:
    """A call's arguments decoded, as a chat template and Anthropic's tool_use take them. A
    call cut short by max_tokens comes back partial, and clients send our answer back as it
    came: what is not JSON is an empty object, on every API, not a 400 for our own output.
    JSON of another type is the client's, as sent (a template that takes only objects says
    so with a 400)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return {}


class CalledTool(Strict):
    """A tool call of an earlier assistant turn, sent back in the history."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], at_most(bounds.PARTS)] | None = None
    name: str | None = None
    tool_calls: Annotated[list[CalledTool], at_most(bounds.PARTS)] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning_content: str | None = None  # assistant: its reasoning, as llama-server returns it
    refusal: str | None = None  # assistant: a refusal sent back, its text when it has no content

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or self.refusal or ""


class FunctionSpec(Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name


def require_schema_name(json_schema: dict | None,
                         param: str = "response_format.json_schema.name") -> None:
    name = json_schema.get("name") if isinstance(json_schema, dict) else None
    if not isinstance(name, str) or not SCHEMA_NAME.fullmatch(name):
        raise invalid(f"{param.rpartition('.')[0]} needs a `name` of letters, digits, "
                      "underscores and dashes, at most 64", param)
