"""The OpenAI request bodies we accept, validated strictly: a field we do not know, a value out
of range, or a feature we do not implement is a 400 that names the parameter, never ignored.

Fields of the openai SDK (3.63) that change nothing here are accepted and have no effect: one
service tier (`service_tier`), no verbosity setting for a local model (`verbosity`), no
obfuscation padding in streams (`stream_options.include_obfuscation`), the prompt-cache options
(`prompt_cache_options.mode`: every prefix is cached as it is). A text part's
`prompt_cache_breakpoint` (chat's, and Responses' input_text's) pins the prompt up to that part
for its TTL (the latest four marks, or three beside OpenAI's implicit one), as
`prompt_cache_retention: "24h"` pins a whole prompt. What would change the answer (audio, web
search, moderation) is a 400 naming it."""

from __future__ import annotations

import functools
import re
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.messages import GenerationRequest, SamplerSettings
from gateway import bounds
from gateway.bounds import at_most
from gateway.config import SamplingDefaults
from gateway.edge.errors import APIError, invalid
from gateway.formats.structured import Grammar, grammar_for
from gateway.formats.tools import Toolbox

NO_DEFAULTS = SamplingDefaults()  # the sampling OpenAI's API defines for what is left out
Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    def check_supported(self) -> None:
        """Raises when the request asks for what this server does not do."""


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # no padding is added here


BREAKPOINT_SECONDS = {"30m": 1800.0, "12h": 43200.0}


class PromptCacheBreakpoint(_Strict):
    """The end of a reusable prefix, as OpenAI marks it: chat pins the prompt up to it."""

    mode: Literal["explicit"]
    ttl: Literal["30m", "12h"] | None = None


class PromptCacheOptions(_Strict):
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


class TextPart(_Strict):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None


class Prediction(_Strict):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat, mostly."""

    type: Literal["content"]
    content: str | Annotated[list[TextPart], Field(min_length=1, max_length=bounds.PARTS)]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else \
            "".join(part.text for part in self.content)


class CalledFunction(_Strict):
    name: str
    arguments: str


class CalledTool(_Strict):
    """A tool call of an earlier assistant turn, sent back in the history."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class Message(_Strict):
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


class FunctionSpec(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name


def _require_schema_name(json_schema: dict | None,
                         param: str = "response_format.json_schema.name") -> None:
    name = json_schema.get("name") if isinstance(json_schema, dict) else None
    if not isinstance(name, str) or not SCHEMA_NAME.fullmatch(name):
        raise invalid(f"{param.rpartition('.')[0]} needs a `name` of letters, digits, "
                      "underscores and dashes, at most 64", param)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None


class _Sampling(_Strict):
    """Fields shared by chat and text completions."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Probability | None = None
    seed: int | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    stop: str | Annotated[list[str], at_most(bounds.STOP_STRINGS)] | None = None
    n: Annotated[int, Field(ge=1)] | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
                          at_most(bounds.LOGIT_BIAS)] | None = None
    user: str | None = None
    # OpenAI's prompt-cache words: a routing hint, and "24h" pins the prompt's blocks. Neither
    # they nor safety_identifier/user ever choose a cache namespace: API keys do.
    prompt_cache_key: Annotated[str, Field(max_length=1024)] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    safety_identifier: str | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _unsupported(self) -> dict[str, bool]:
        """Parameter name -> whether the request asks for something we do not implement."""
        return {}

    def check_supported(self) -> None:
        for param, asked in self._unsupported().items():
            if asked:
                raise invalid(f"'{param}' is not supported by this server", param, "unsupported")
        bounds.check_stop_strings(self.stop_list(), "stop")
        if self.stream_options and not self.stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true",
                          "stream_options")

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def output_grammar(self, calls: Grammar | None = None) -> Grammar | None:
        return None

    def logprob_count(self) -> int | None:
        """None: no logprobs; k: the chosen token's and the k likeliest alternatives."""
        return None

    def predicted_text(self) -> str | None:
        """The answer the client predicted, to draft from (chat's `prediction`)."""
        return None

    def to_generation(self, prompt_tokens: list[int], seq_len: int, n_vocab: int,
                      max_tokens_cap: int | None = None, namespace: str = "",
                      defaults: SamplingDefaults = NO_DEFAULTS,
                      calls: Grammar | None = None) -> GenerationRequest:
        """`calls`: the grammar of tool calls in the model's syntax
        (gateway/formats/call_grammars.py)."""
        return GenerationRequest(
            prompt_tokens=prompt_tokens,
            max_tokens=completion_room(
                len(prompt_tokens), seq_len, self.requested_max_tokens(), max_tokens_cap,
                "messages" if isinstance(self, ChatCompletionRequest) else "prompt"),
            sampler=sampler_settings(
                defaults, self.temperature, self.top_p,
                None if self.top_k is None else max(self.top_k, 0), self.min_p,
                grammar=self.output_grammar(calls), seed=self.seed,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=self.repetition_penalty or 1.0),
            stop=self.stop_list(),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logit_bias=self._token_biases(n_vocab),
            namespace=namespace,
            logprobs=self.logprob_count(),
        )

    def _token_biases(self, n_vocab: int) -> dict[int, float]:
        biases = {}
        for key, bias in (self.logit_bias or {}).items():
            # isdigit() alone admits "²" and other digits int() refuses.
            if not (key.isascii() and key.isdigit()) or int(key) >= n_vocab:
                raise invalid(f"logit_bias key {key!r} is not a token id of this model",
                              "logit_bias")
            biases[int(key)] = bias
        return biases


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


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1, max_length=bounds.MESSAGES)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], at_most(bounds.TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: Annotated[list[dict], at_most(bounds.TOOLS)] | None = None
    function_call: str | dict | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    store: bool | None = None
    metadata: Annotated[dict[str, str], at_most(bounds.METADATA)] | None = None
    prediction: Prediction | None = None
    # Accepted, no effect here: one tier; a local model has no verbosity setting.
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    # Refused when asked for: each would change the answer.
    modalities: Annotated[list[Literal["text", "audio"]], at_most(bounds.PARTS)] | None = None
    audio: dict | None = None
    web_search_options: dict | None = None
    moderation: dict | None = None

    def _unsupported(self) -> dict[str, bool]:
        return super()._unsupported() | {
            "functions": bool(self.functions),
            "function_call": self.function_call not in (None, "none"),
            "modalities": "audio" in (self.modalities or []),
            "audio": self.audio is not None,
            "web_search_options": self.web_search_options is not None,
            "moderation": self.moderation is not None,
        }

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("'top_logprobs' needs 'logprobs' to be true", "top_logprobs")

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def predicted_text(self) -> str | None:
        return self.prediction.text() if self.prediction else None

    def cache_breakpoints(self) -> list[tuple[int, int, float]]:
        """The text parts marked with prompt_cache_breakpoint (written_breakpoints)."""
        return written_breakpoints(
            [(m, p, part.prompt_cache_breakpoint) for m, message in enumerate(self.messages)
             if isinstance(message.content, list) for p, part in enumerate(message.content)
             if part.prompt_cache_breakpoint], self.prompt_cache_options)

    def cut(self, m: int, p: int) -> list[Message]:
        """The conversation up to and including part p of message m."""
        last = self.messages[m].model_copy(update={"content": self.messages[m].content[: p + 1]})
        return [*self.messages[:m], last]

    @functools.cached_property
    def toolbox(self) -> Toolbox | None:
        return Toolbox.of(self.tools, self.tool_choice, self.parallel_tool_calls)

    def output_grammar(self, calls: Grammar | None = None) -> Grammar | None:
        """A required call's grammar; else response_format's; else the calls' lazy one."""
        if calls is not None and not calls.triggers:
            return calls
        if self.response_format is None or self.response_format.type == "text":
            return calls
        if self.response_format.type == "json_schema":
            _require_schema_name(self.response_format.json_schema)
        return Grammar(grammar_for(self.response_format.type, self.response_format.json_schema))


class CompletionRequest(_Sampling):
    prompt: (str | Annotated[list[str], Field(min_length=1, max_length=bounds.PARTS)]
             | Annotated[list[int], Field(min_length=1, max_length=bounds.TOKEN_IDS)]
             | Annotated[list[Annotated[list[int], at_most(bounds.TOKEN_IDS)]],
                         Field(min_length=1, max_length=bounds.PARTS)])
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    def _unsupported(self) -> dict[str, bool]:
        batched = isinstance(self.prompt, list) and isinstance(self.prompt[0], str | list)
        return super()._unsupported() | {
            "prompt": batched and len(self.prompt) > 1,
            "echo": self.echo,
            "best_of": (self.best_of or 1) != 1,
            "suffix": self.suffix is not None,
        }

    def logprob_count(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        """The one prompt, as text or token ids (a one-element batch is unwrapped)."""
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], str | list):
            return self.prompt[0]
        return self.prompt


class TokenizeRequest(_Strict):
    """llama-server's /tokenize."""

    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(_Strict):
    """llama-server's /detokenize."""

    tokens: Annotated[list[int], at_most(bounds.TOKEN_IDS)]


RequestT = TypeVar("RequestT", bound=_Strict)


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
