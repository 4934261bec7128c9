"""Request -> prompt tokens, exactly as llama-cpp-python's `Llama.create_chat_completion` and
`create_completion` build them, so both give the same tokens for the same input; and the parser
of the answer, in the model's own format (gateway/formats/chat_formats.py).

Every API and /v1/cache/explain build the same `RenderedPrompt`; a template that cannot render
a request is a 400 in one place (`render_chat`), on every API."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from llama_cpp import llama_chat_format

from cache.tokens import common_prefix
from engine.llama import Model
from gateway.core.conversation import Message
from gateway.edge.errors import APIError, invalid
from gateway.formats.builtin_templates import BuiltinTemplate
from gateway.formats.chat_formats import (
    TEMPLATE_DEFAULT,
    ChatFormat,
    OutputParser,
    Reasoning,
    detect,
)
from gateway.formats.tools import Toolbox

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pin:
    """Keep the prompt's first `n_tokens` cached for `seconds`, past LRU (within the tenant's
    share of the pin budget)."""

    n_tokens: int
    seconds: float


@dataclass(frozen=True)
class RenderedPrompt:
    """A request's prompt, as every API and /v1/cache/explain build it."""

    text: str  # as rendered; a completion's prompt as sent ("" when sent as token ids)
    tokens: list[int]
    parser: OutputParser | None = None  # reads the answer's reasoning and calls; None: plain
    messages: list[Message] | None = None  # the conversation rendered; None: a completion's
    pins: tuple[Pin, ...] = ()  # one per cache breakpoint the request marks


Cut = TypeVar("Cut")


def breakpoint_pins(tokens: list[int], marks: Iterable[tuple[Cut, float]],
                    cut_tokens: Callable[[Cut], list[int]], longest: float) -> tuple[Pin, ...]:
    """A pin per cache breakpoint, for its TTL (at most `longest`: --pin-hours), as far into
    the prompt as the request cut after the marked part renders the same tokens (whatever the
    template writes around the parts). A cut the template cannot render pins nothing."""
    whole, pins = np.asarray(tokens), []
    for cut, seconds in marks:
        try:
            reach = common_prefix(whole, np.asarray(cut_tokens(cut)))
        except APIError:
            continue
        pins.append(Pin(reach, min(seconds, longest)))
    return tuple(pins)


class PromptBuilder:
    def __init__(self, model: Model, template: str | None = None) -> None:
        self.model = model
        template = template or model.metadata.get("tokenizer.chat_template")
        builtin = None if template else BuiltinTemplate.for_model(model)
        if builtin:
            log.warning("the model has no chat template in its metadata; using llama.cpp's "
                        "built-in %r template for its architecture", builtin.name)
            template = ""  # renders neither tools nor calls, in no format of its own
        elif template is None:
            log.warning("the model has no chat template in its metadata, and llama.cpp has "
                        "none built in for its architecture; using ChatML")
            template = llama_chat_format.CHATML_CHAT_TEMPLATE
        self.takes_tools = "tools" in template  # renders the tools' definitions
        self.renders_calls = "tool_calls" in template  # and earlier calls, in its own format
        self.format: ChatFormat = detect(template, self.takes_tools)
        self.shown_tokens = frozenset(self._special_tokens(self.format.markers))
        self._formatter = builtin or llama_chat_format.Jinja2ChatFormatter(
            template=template,
            eos_token=model.token_text(model.eos_token),
            bos_token=model.token_text(model.bos_token),
            stop_token_ids=[model.eos_token],
        )
        self.takes_system = self._takes_system()

    def chat(self, messages: list[Message], toolbox: Toolbox | None = None,
             reasoning: Reasoning = TEMPLATE_DEFAULT) -> RenderedPrompt:
        """A 400 when the template cannot render the messages (render_chat)."""
        text = self.render_chat(messages, toolbox, reasoning)
        return RenderedPrompt(text, self.tokenize_rendered(text), self.parser(toolbox, text),
                              messages)

    def parser(self, toolbox: Toolbox | None, prompt_text: str) -> OutputParser | None:
        return self.format.parser(toolbox, prompt_text)

    def _special_tokens(self, markers: tuple[str, ...]) -> list[int]:
        """The markers that are special tokens of this model (rendered as nothing unless
        asked for): each is one token whose plain piece is empty."""
        tokens = [self.tokenize_rendered(marker) for marker in markers]
        return [t[0] for t in tokens if len(t) == 1 and not self.model.token_piece(t[0])]

    def tokenize_rendered(self, text: str) -> list[int]:
        """Tokens of rendered text: the template writes any BOS itself, and its special tokens
        must parse as such."""
        return self.model.tokenize(text, add_special=False, parse_special=True)

    def render_chat(self, messages: list[Message], toolbox: Toolbox | None = None,
                    reasoning: Reasoning = TEMPLATE_DEFAULT, param: str = "messages") -> str:
        """The prompt's text, or a 400 naming `param` (the request's conversation) when the
        template cannot render it: its own raise_exception, or any error its code meets on the
        request's values (a filter given a list where it takes a mapping, say). The template
        runs on what the client sent, so whatever fails there is the request's to fix, on
        every API.
        """
        try:
            return self._render(messages, toolbox, reasoning)
        except Exception as exc:
            raise invalid(f"The chat template could not render the {param}: "
                          f"{type(exc).__name__}: {exc}", param) from None

    def _render(self, messages: list[Message], toolbox: Toolbox | None,
                reasoning: Reasoning) -> str:
        """The prompt's text.

        Tools are rendered by the template when it takes them, else described in the system
        message (gateway/formats/tools.py); earlier calls and results by the template when it
        renders them, else as plain turns. A template without a system role (Gemma's) gets the
        system message at the head of the first user turn."""
        turns = [self._native(m) if self.renders_calls else _plain(m) for m in messages]
        options = reasoning.template_options()
        if toolbox is not None and self.takes_tools:
            options["tools"] = [{"type": "function", "function": f}
                                for f in toolbox.functions.values()]
        elif toolbox is not None:
            described = toolbox.system_text(self.format.name == "json")
            if turns and turns[0]["role"] == "system":
                turns[0] = {**turns[0], "content": f"{turns[0]['content']}\n\n{described}"}
            else:
                turns.insert(0, {"role": "system", "content": described})
        if not self.takes_system and len(turns) > 1 and turns[0]["role"] == "system" \
                and turns[1]["role"] == "user":
            system, first = turns.pop(0), turns[0]
            turns[0] = {**first, "content": f"{system['content']}\n\n{first['content']}"}
        rendered = self._formatter(messages=turns, **options)
        # A named call's head follows, as the start of the answer.
        return rendered.prompt + self.format.answer_head(toolbox)

    def _takes_system(self) -> bool:
        try:
            self._formatter(messages=[{"role": "system", "content": "s"},
                                      {"role": "user", "content": "u"}])
        except ValueError:  # its raise_exception: "System role not supported"
            return False
        return True

    def _native(self, message: Message) -> dict:
        """A message for a template that renders tools, tool calls and reasoning itself."""
        turn = {"role": _role(message), "content": message.text()}
        if message.reasoning_content:  # Qwen3 and GLM read the one, gpt-oss the other
            turn |= {"reasoning_content": message.reasoning_content,
                     "thinking": message.reasoning_content}
        if message.tool_calls:
            turn["tool_calls"] = [{"id": self.format.call_id(c.id), "type": "function",
                                   "function": {"name": c.function.name,
                                                "arguments": c.function.value()}}
                                  for c in message.tool_calls]
        if message.tool_call_id:
            turn["tool_call_id"] = self.format.call_id(message.tool_call_id)
        return turn

    def completion(self, prompt: str | list[int]) -> RenderedPrompt:
        """A completion's prompt: its token ids as sent, or its text tokenized; a 400 naming
        `prompt` when it cannot be run."""
        if isinstance(prompt, list):
            if any(not 0 <= t < self.model.n_vocab for t in prompt):
                raise invalid("prompt holds a token id outside the vocabulary", "prompt")
            return RenderedPrompt("", prompt)
        if prompt == "":
            if self.model.bos_token < 0:  # nothing to condition on: llama_decode would refuse
                raise invalid("prompt is empty, and this model has no BOS token to start from",
                              "prompt")
            return RenderedPrompt("", [self.model.bos_token])
        return RenderedPrompt(prompt, self.model.tokenize(prompt, add_special=True,
                                                          parse_special=True))


def _role(message: Message) -> str:
    # OpenAI's newer "developer" role is a system message to every chat template we serve.
    return "system" if message.role == "developer" else message.role


def _plain(message: Message) -> dict:
    """A message for a template without tools: a call is its JSON, a result a user turn."""
    if message.tool_calls:
        calls = [{"name": c.function.name, "arguments": c.function.value()}
                 for c in message.tool_calls]
        return {"role": "assistant", "content": json.dumps(calls[0] if len(calls) == 1
                                                           else calls)}
    if message.role == "tool":
        return {"role": "user", "content": f"Result of tool call {message.tool_call_id}: "
                                           f"{message.text()}"}
    return {"role": _role(message), "content": message.text()}
