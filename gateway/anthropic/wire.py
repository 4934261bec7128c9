"""Anthropic's words for a generation's outputs: a whole `message`, or the stream of events the
anthropic SDK's `messages.stream()` and Claude Code read:

    message_start, ping, (content_block_start, content_block_delta..., content_block_stop)...,
    message_delta (stop_reason, usage), message_stop

Usage as Anthropic defines it: `cache_read_input_tokens` came from the cache,
`cache_creation_input_tokens` were written to it up to the request's last cache_control
breakpoint, `input_tokens` are the rest; the three add up to the prompt.
"""

from __future__ import annotations

import uuid

from engine.messages import Output, Usage
from gateway.core.conversation import arguments_value
from gateway.core.generation import Choice, Event, Growth, Wire
from gateway.edge.errors import APIError
from gateway.formats.chat_formats import OutputParser, Part

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


class AnthropicWire(Wire):
    """The answer's parts as content blocks: reasoning as `thinking`, text as `text`, calls as
    `tool_use` (streamed with input_json_delta as the arguments are written)."""

    def __init__(self, model: str, parser: OutputParser | None, prompt_tokens: int,
                 breakpoint_tokens: int) -> None:
        self.model = model
        self.parser = parser
        self.prompt_tokens = prompt_tokens
        self.breakpoint_tokens = breakpoint_tokens  # the prompt up to its last breakpoint
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self._started = False
        self._open_block = False  # a content block is being streamed
        self._n_blocks = 0

    def usage(self, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
        written = max(0, min(self.breakpoint_tokens, prompt_tokens) - cached_tokens)
        return {"input_tokens": prompt_tokens - cached_tokens - written,
                "cache_creation_input_tokens": written,
                "cache_read_input_tokens": cached_tokens,
                "output_tokens": output_tokens}

    def whole(self, choices: list[Choice], usage: Usage) -> dict:
        choice = choices[0]
        content = [_block(part) | _filled(part) for part in choice.parts if part.text
                   or part.kind == "call"]
        return {**self._message(content), **_stop(choice),
                "usage": self.usage(usage.prompt_tokens, usage.cached_tokens,
                                    usage.completion_tokens)}

    def on_output(self, index: int, output: Output, choice: Choice,
                  growth: list[Growth]) -> list[Event]:
        events = [] if self._started else self._start(output)
        for g in growth:
            if g.new:
                events += self._open(_block(g.part))
            if g.delta:
                events.append(self._delta(_delta(g.part.kind, g.delta)))
        if output.last:
            events += self._end(choice)
        return events

    def failure(self, error: APIError) -> list[Event]:
        return [Event(error.body("anthropic"), "error")]

    def _message(self, content: list[dict]) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content}

    def _start(self, output: Output) -> list[Event]:
        """message_start once the prompt is in: only then is its cached share known."""
        self._started = True
        cached = output.usage.cached_tokens if output.usage else output.cached_tokens or 0
        message = {**self._message([]), "stop_reason": None, "stop_sequence": None,
                   "usage": self.usage(self.prompt_tokens, cached, 0)}
        return [Event({"type": "message_start", "message": message}, "message_start"),
                Event({"type": "ping"}, "ping")]

    def _open(self, block: dict) -> list[Event]:
        events = self._close()
        self._open_block = True
        events.append(Event({"type": "content_block_start", "index": self._n_blocks,
                             "content_block": block}, "content_block_start"))
        return events

    def _delta(self, delta: dict) -> Event:
        return Event({"type": "content_block_delta", "index": self._n_blocks, "delta": delta},
                     "content_block_delta")

    def _close(self) -> list[Event]:
        if not self._open_block:
            return []
        event = Event({"type": "content_block_stop", "index": self._n_blocks},
                      "content_block_stop")
        self._open_block = False
        self._n_blocks += 1
        return [event]

    def _end(self, choice: Choice) -> list[Event]:
        usage = choice.usage
        return [*self._close(),
                Event({"type": "message_delta", "delta": _stop(choice),
                       "usage": self.usage(usage.prompt_tokens, usage.cached_tokens,
                                           usage.completion_tokens)}, "message_delta"),
                Event({"type": "message_stop"}, "message_stop")]


def _stop(choice: Choice) -> dict:
    reason = choice.reason()
    if reason == "tool_calls":
        reason = "tool_use"
    elif choice.stop_sequence is not None:
        reason = "stop_sequence"
    else:
        reason = STOP_REASONS.get(reason or "stop", "end_turn")
    return {"stop_reason": reason, "stop_sequence": choice.stop_sequence}


def _block(part: Part) -> dict:
    """A content block as it opens (empty)."""
    if part.kind == "call":
        return {"type": "tool_use", "id": "toolu_" + part.id.removeprefix("call_"),
                "name": part.name, "input": {}}
    if part.kind == "reasoning":
        return {"type": "thinking", "thinking": "", "signature": ""}
    return {"type": "text", "text": ""}


def _filled(part: Part) -> dict:
    """What a whole content block holds."""
    if part.kind == "call":
        value = arguments_value(part.text)  # an object, unless max_tokens cut the call
        return {"input": value if isinstance(value, dict) else {}}
    return {"thinking" if part.kind == "reasoning" else "text": part.text}


def _delta(kind: str, text: str) -> dict:
    if kind == "call":
        return {"type": "input_json_delta", "partial_json": text}
    if kind == "reasoning":
        return {"type": "thinking_delta", "thinking": text}
    return {"type": "text_delta", "text": text}
