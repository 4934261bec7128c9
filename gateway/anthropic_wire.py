"""Anthropic's words for a generation's outputs: a whole `message`, or the stream of events the
anthropic SDK's `messages.stream()` and Claude Code read:

    message_start, ping, (content_block_start, content_block_delta..., content_block_stop)...,
    message_delta (stop_reason, usage), message_stop

Usage as Anthropic defines it: `cache_read_input_tokens` came from the cache,
`cache_creation_input_tokens` were written to it up to the request's last cache_control
breakpoint, `input_tokens` are the rest; the three add up to the prompt.
"""

from __future__ import annotations

import json
import uuid

from engine.messages import Output, Usage
from gateway.errors import APIError
from gateway.generation import Choice, Event, Wire
from gateway.tools import Toolbox, ToolCall

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


class AnthropicWire(Wire):
    def __init__(self, model: str, toolbox: Toolbox | None, prompt_tokens: int,
                 breakpoint_tokens: int) -> None:
        self.model = model
        self.toolbox = toolbox
        self.prompt_tokens = prompt_tokens
        self.breakpoint_tokens = breakpoint_tokens  # the prompt up to its last breakpoint
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self._started = False
        self._open_block: str | None = None  # the type of the content block being streamed
        self._n_blocks = 0

    def usage(self, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
        written = max(0, min(self.breakpoint_tokens, prompt_tokens) - cached_tokens)
        return {"input_tokens": prompt_tokens - cached_tokens - written,
                "cache_creation_input_tokens": written,
                "cache_read_input_tokens": cached_tokens,
                "output_tokens": output_tokens}

    def whole(self, choices: list[Choice], usage: Usage) -> dict:
        choice = choices[0]
        call = self._call(choice)
        content = [{"type": "text", "text": choice.text}] if call is None and choice.text \
            else []
        if call is not None:
            content.append(_tool_use(call) | {"input": _arguments(call)})
        return {**self._message(content), **self._stop(choice, call),
                "usage": self.usage(usage.prompt_tokens, usage.cached_tokens,
                                    usage.completion_tokens)}

    def on_output(self, index: int, output: Output, choice: Choice) -> list[Event]:
        events = [] if self._started else self._start(output)
        streamable = choice.streamable(output, self.toolbox)
        if streamable is not None:
            if streamable[0]:
                events += self._text(streamable[0])
        elif output.last:  # held back while it may be a call: whole, it is known
            call = self._call(choice)
            if call is None:
                events += self._text(choice.text)
            else:
                events += self._tool_use(call)
        if output.last:
            events += self._end(choice)
        return events

    def failure(self, error: APIError) -> list[Event]:
        return [Event(error.body("anthropic"), "error")]

    def _message(self, content: list[dict]) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content}

    def _call(self, choice: Choice) -> ToolCall | None:
        if self.toolbox is not None and choice.tool_call is None and not choice.texting:
            choice.tool_call = self.toolbox.parse(choice.text, choice.finish_reason)
        return choice.tool_call

    def _stop(self, choice: Choice, call: ToolCall | None) -> dict:
        if call is not None and call.complete:
            reason = "tool_use"
        elif choice.stop_sequence is not None:
            reason = "stop_sequence"
        else:
            reason = STOP_REASONS.get(choice.finish_reason or "stop", "end_turn")
        return {"stop_reason": reason, "stop_sequence": choice.stop_sequence}

    def _start(self, output: Output) -> list[Event]:
        """message_start once the prompt is in: only then is its cached share known."""
        self._started = True
        cached = output.usage.cached_tokens if output.usage else output.cached_tokens or 0
        message = {**self._message([]), "stop_reason": None, "stop_sequence": None,
                   "usage": self.usage(self.prompt_tokens, cached, 0)}
        return [Event({"type": "message_start", "message": message}, "message_start"),
                Event({"type": "ping"}, "ping")]

    def _text(self, text: str) -> list[Event]:
        events = [] if self._open_block == "text" else \
            self._open({"type": "text", "text": ""})
        if text:
            events.append(self._delta({"type": "text_delta", "text": text}))
        return events

    def _tool_use(self, call: ToolCall) -> list[Event]:
        return [*self._open(_tool_use(call) | {"input": {}}),
                self._delta({"type": "input_json_delta", "partial_json": call.arguments})]

    def _open(self, block: dict) -> list[Event]:
        events = self._close()
        self._open_block = block["type"]
        events.append(Event({"type": "content_block_start", "index": self._n_blocks,
                             "content_block": block}, "content_block_start"))
        return events

    def _delta(self, delta: dict) -> Event:
        return Event({"type": "content_block_delta", "index": self._n_blocks, "delta": delta},
                     "content_block_delta")

    def _close(self) -> list[Event]:
        if self._open_block is None:
            return []
        event = Event({"type": "content_block_stop", "index": self._n_blocks},
                      "content_block_stop")
        self._open_block = None
        self._n_blocks += 1
        return [event]

    def _end(self, choice: Choice) -> list[Event]:
        usage = choice.usage
        return [*self._close(),
                Event({"type": "message_delta", "delta": self._stop(choice, choice.tool_call),
                       "usage": self.usage(usage.prompt_tokens, usage.cached_tokens,
                                           usage.completion_tokens)}, "message_delta"),
                Event({"type": "message_stop"}, "message_stop")]


def _tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"),
            "name": call.name}


def _arguments(call: ToolCall) -> dict:
    """A call's input; one cut short by max_tokens keeps what parses (nothing, usually)."""
    try:
        value = json.loads(call.arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
