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
from typing import Annotated, ClassVar, Literal

from pydantic import Field

from engine.messages import GenerationRequest
from gateway.core import bounds
from gateway.core.bounds import at_most
from gateway.core.conversation import (
    Message,
    NamedToolChoice,
    PromptCacheOptions,
    TextPart,
    Tool,
    require_schema_name,
    written_breakpoints,
)
from gateway.core.requests import Generating, Serving, Strict, completion_room, sampler_settings
from gateway.edge.errors import invalid
from gateway.formats.structured import Grammar, grammar_for
from gateway.formats.tools import Toolbox

Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]




class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # no padding is added here












class Prediction(Strict):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat, mostly."""

    type: Literal["content"]
    content: str | Annotated[list[TextPart], Field(min_length=1, max_length=bounds.PARTS)]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else \
            "".join(part.text for part in self.content)




















class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None


class _Sampling(Generating):
    """Fields shared by chat and text completions."""

    prompt_param: ClassVar[str] = "prompt"
    model: str
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

    def n_choices(self) -> int:
        return self.n or 1

    def routing_key(self) -> str | None:
        return self.prompt_cache_key

    def keeps_prompt(self) -> bool:
        return self.prompt_cache_retention == "24h"

    def to_generation(self, prompt_tokens: list[int], serving: Serving,
                      calls: Grammar | None = None) -> GenerationRequest:
        return GenerationRequest(
            prompt_tokens=prompt_tokens,
            max_tokens=completion_room(len(prompt_tokens), serving.seq_len,
                                       self.requested_max_tokens(), serving.max_tokens,
                                       self.prompt_param),
            sampler=sampler_settings(
                serving.sampling, self.temperature, self.top_p,
                None if self.top_k is None else max(self.top_k, 0), self.min_p,
                grammar=self.output_grammar(calls), seed=self.seed,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=self.repetition_penalty or 1.0),
            stop=self.stop_list(),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logit_bias=self._token_biases(serving.n_vocab),
            namespace=serving.namespace,
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






class ChatCompletionRequest(_Sampling):
    prompt_param: ClassVar[str] = "messages"
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
            require_schema_name(self.response_format.json_schema)
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














