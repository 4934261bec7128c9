"""How every API reads a request body: strict models (a field we do not know is a 400 naming
it, never ignored), pydantic's complaints turned into the API's own 400, and what every API's
request model answers when it becomes a generation (`Generating`), under the two rules they
share: the sampling it asks for over the server's defaults, and the completion room its prompt
leaves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from engine.messages import GenerationRequest, SamplerSettings
from gateway.config import SamplingDefaults
from gateway.core import bounds
from gateway.edge.errors import APIError, invalid
from gateway.formats.structured import Grammar


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    def check_supported(self) -> None:
        """Raises when the request asks for what this server does not do."""


@dataclass(frozen=True)
class Serving:
    """What the server sets around a request's own asks when it becomes a generation."""

    seq_len: int  # a sequence's tokens: the prompt's and the completion's
    n_vocab: int
    max_tokens: int | None  # --max-tokens
    sampling: SamplingDefaults  # where the request leaves a parameter out
    namespace: str  # the cache namespace of the request's key


class Generating(Strict):
    """A request that generates, as the one generation path plans it
    (gateway/core/generation.py): each API's request model says what it asks for."""

    prompt_param: ClassVar[str]  # what a prompt past the context is named in its 400
    stream: bool = False

    def to_generation(self, prompt_tokens: list[int], serving: Serving,
                      calls: Grammar | None) -> GenerationRequest:
        """`calls`: the grammar of tool calls in the model's syntax
        (gateway/formats/call_grammars.py), None when no tools are offered."""
        raise NotImplementedError

    def n_choices(self) -> int:
        return 1

    def routing_key(self) -> str | None:
        """What routes requests to the worker holding their prefix (prompt_cache_key)."""
        return None

    def keeps_prompt(self) -> bool:
        """Whether the whole prompt is pinned past LRU (OpenAI's 24h retention)."""
        return False

    def predicted_text(self) -> str | None:
        """The answer the client predicted, to draft from (chat's `prediction`)."""
        return None


def sampler_settings(defaults: SamplingDefaults, temperature: float | None,
                     top_p: float | None, top_k: int | None = None, min_p: float | None = None,
                     grammar: Grammar | None = None, **fixed) -> SamplerSettings:
    """What a request asks for, the server's defaults where it leaves a parameter out."""
    if grammar is not None:
        fixed |= {"grammar": grammar.gbnf, "grammar_triggers": grammar.triggers}
    return SamplerSettings(
        temperature=defaults.temperature if temperature is None else temperature,
        top_p=defaults.top_p if top_p is None else top_p,
        top_k=defaults.top_k if top_k is None else top_k,
        min_p=defaults.min_p if min_p is None else min_p, **fixed)


def completion_room(n_prompt: int, seq_len: int, wanted: int | None, cap: int | None,
                    prompt_param: str) -> int:
    """The completion tokens a request gets: what it asks for, within the sequence's room
    after its prompt and the server's --max-tokens (asking past that is an error)."""
    room = seq_len - n_prompt
    if room < 1:
        raise invalid(
            f"This model's maximum context length is {seq_len} tokens. However, your "
            f"prompt is {n_prompt} tokens, leaving no room for a completion.",
            prompt_param, "context_length_exceeded")
    if cap is not None:
        if wanted is not None and wanted > cap:
            raise invalid(f"max_tokens is too large: {wanted}. This server allows at most "
                          f"{cap} completion tokens per request.", "max_tokens")
        room = min(room, cap)
    return room if wanted is None else min(wanted, room)


RequestT = TypeVar("RequestT", bound=Strict)


def parse_request(model: type[RequestT], body: bytes) -> RequestT:
    bounds.refuse_long_lists(model, body)
    try:
        request = model.model_validate_json(body)
    except ValidationError as exc:
        raise _as_api_error(exc) from None
    request.check_supported()
    return request


def _as_api_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    # A list past its bound fails every branch of a union (`str | list`): the bound is the news,
    # and of several branches' bounds the largest (a list of ids is not too long for a list of
    # strings' bound).
    too_long = [e for e in errors if e["type"] == "too_long"]
    error = max(too_long, key=lambda e: e["ctx"]["max_length"]) if too_long else errors[0]
    loc = [str(part) for part in error["loc"]]
    param = _param_name(loc)
    if error["type"] == "json_invalid":
        return invalid(f"We could not parse the JSON body of your request: {error['msg']}")
    if error["type"] == "model_type" and not loc:
        return invalid("The request body must be a JSON object")
    if error["type"] == "missing":
        return invalid(f"Missing required parameter: '{param}'.", param)
    if error["type"] == "extra_forbidden":
        return invalid(f"Unrecognized request argument supplied: {param}", param)
    return invalid(f"Invalid value for '{param}': {error['msg']}", param)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _param_name(loc: list[str]) -> str | None:
    """('messages', '0', 'role') -> 'messages[0].role'; pydantic's union branch tags are dropped."""
    name = ""
    for part in loc:
        if part.isdigit():
            name += f"[{part}]"
        elif part in _TYPE_TAGS or not part.isidentifier():
            continue
        else:
            name += f".{part}" if name else part
    return name or None
