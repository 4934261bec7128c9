"""OpenAI's words for the two completion endpoints' outputs, whole and streamed."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.messages import Output, TokenLogprob, Usage
from gateway.errors import APIError
from gateway.generation import Choice, Event, Wire
from gateway.tools import Toolbox, ToolCall

TokenBytes = Callable[[int], bytes]


def usage_body(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


@dataclass
class OpenAIWire(Wire):
    """Words one request's responses: one id and creation time for all of its chunks."""

    model: str
    id_prefix: str
    object_name: str
    chunk_object_name: str
    token_bytes: TokenBytes | None = None  # set when the request asked for logprobs
    include_usage: bool = False  # stream_options.include_usage
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created,
                "model": self.model, "system_fingerprint": None, "choices": choices}

    def whole(self, choices: list[Choice], usage: Usage) -> dict:
        body = self._envelope(self.object_name, [
            {**self._choice(c.text, c.finish_reason, i), "logprobs": self._logprobs(c.logprobs, i),
             **self._call(c.tool_call)} for i, c in enumerate(choices)])
        body["usage"] = usage_body(usage)
        return body

    def chunk(self, text: str, finish_reason: str | None = None, *, first: bool = False,
              with_usage_field: bool = False, logprobs: list[TokenLogprob] = (),
              index: int = 0) -> dict:
        choice = self._delta_choice(text, finish_reason, first, index)
        choice["logprobs"] = self._logprobs(logprobs, index)
        body = self._envelope(self.chunk_object_name, [choice])
        if with_usage_field:  # OpenAI sends "usage": null on every chunk when usage is asked for
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> dict:
        body = self._envelope(self.chunk_object_name, [])
        body["usage"] = usage_body(usage)
        return body

    terminator = b"data: [DONE]\n\n"

    def on_output(self, index: int, output: Output, choice: Choice) -> list[Event]:
        return self._text_then_finish(output.text, output.logprobs, output.finish_reason, index)

    def _text_then_finish(self, text: str, logprobs: list[TokenLogprob],
                          finish_reason: str | None, index: int) -> list[Event]:
        """As OpenAI streams: the text, then a chunk of its own with the finish_reason and an
        empty delta (clients that key on that chunk still see every token)."""
        events = []
        if text:
            events.append(Event(self.chunk(text, with_usage_field=self.include_usage,
                                           logprobs=logprobs, index=index)))
        if finish_reason:
            events.append(Event(self.chunk("", finish_reason,
                                           with_usage_field=self.include_usage, index=index)))
        return events

    def closing(self, choices: list[Choice], usage: Usage) -> list[Event]:
        return [Event(self.usage_chunk(usage))] if self.include_usage else []

    def failure(self, error: APIError) -> list[Event]:
        return [Event(error.body())]

    def _choice(self, text: str, finish_reason: str | None, index: int) -> dict:
        raise NotImplementedError

    def _delta_choice(self, text: str, finish_reason: str | None, first: bool,
                      index: int) -> dict:
        raise NotImplementedError

    def _logprobs(self, entries: list[TokenLogprob], index: int) -> dict | None:
        raise NotImplementedError

    def _call(self, call: ToolCall | None) -> dict:
        """What a choice that is a tool call replaces of its message."""
        return {}

    def _piece(self, token: int) -> tuple[str, bytes]:
        data = self.token_bytes(token)
        return data.decode(errors="replace"), data


class ChatWire(OpenAIWire):
    def __init__(self, model: str, token_bytes: TokenBytes | None = None,
                 include_usage: bool = False, toolbox: Toolbox | None = None) -> None:
        super().__init__(model, "chatcmpl", "chat.completion", "chat.completion.chunk",
                         token_bytes, include_usage)
        self.toolbox = toolbox

    def opening(self, n_choices: int) -> list[Event]:
        return [Event(self.chunk("", first=True, with_usage_field=self.include_usage, index=i))
                for i in range(n_choices)]

    def on_output(self, index: int, output: Output, choice: Choice) -> list[Event]:
        """With tools offered, a choice is held back while it may be a call; whole, a call is
        sent as tool_calls deltas."""
        streamable = choice.streamable(output, self.toolbox)
        if streamable is not None:
            return self._text_then_finish(*streamable, output.finish_reason, index)
        if not output.last:
            return []
        choice.tool_call = self.toolbox.parse(choice.text, output.finish_reason)
        if choice.tool_call is not None:
            return [Event(chunk) for chunk in self.tool_call_chunks(choice.tool_call, index)]
        return self._text_then_finish(choice.text, choice.logprobs, output.finish_reason, index)

    def whole(self, choices: list[Choice], usage: Usage) -> dict:
        if self.toolbox is not None:
            for choice in choices:
                choice.tool_call = self.toolbox.parse(choice.text, choice.finish_reason)
        return super().whole(choices, usage)

    def _choice(self, text: str, finish_reason: str | None, index: int) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": finish_reason}

    def _delta_choice(self, text: str, finish_reason: str | None, first: bool,
                      index: int) -> dict:
        delta = {"role": "assistant", "content": text} if first else \
            ({"content": text} if text else {})
        return {"index": index, "delta": delta, "logprobs": None,
                "finish_reason": finish_reason}

    def _call(self, call: ToolCall | None) -> dict:
        if call is None:
            return {}
        return {"message": {"role": "assistant", "content": None,
                            "tool_calls": [call.body()]}, "finish_reason": call.finish_reason}

    def tool_call_chunks(self, call: ToolCall, index: int) -> list[dict]:
        """A call streamed as the SDK's accumulator expects it: id, type and name first, then
        the arguments, then the finish."""
        head = {"index": 0, "id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": ""}}
        # The role came with the stream's first chunk: once, as OpenAI sends it.
        deltas = [{"content": None, "tool_calls": [head]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": call.arguments}}]},
                  {}]
        return [self._envelope(self.chunk_object_name, [{
            "index": index, "delta": delta, "logprobs": None,
            "finish_reason": call.finish_reason if not delta else None}]) for delta in deltas]

    def _logprobs(self, entries: list[TokenLogprob], index: int) -> dict | None:
        """OpenAI's chat shape: content[] of token, logprob, bytes and top_logprobs."""
        if self.token_bytes is None:
            return None

        def described(token: int, logprob: float) -> dict:
            text, data = self._piece(token)
            return {"token": text, "logprob": logprob, "bytes": list(data)}

        return {"content": [{**described(e.token, e.logprob),
                             "top_logprobs": [described(t, lp) for t, lp in e.top]}
                            for e in entries]}


class CompletionWire(OpenAIWire):
    def __init__(self, model: str, token_bytes: TokenBytes | None = None,
                 include_usage: bool = False) -> None:
        super().__init__(model, "cmpl", "text_completion", "text_completion", token_bytes,
                         include_usage)
        self._offsets: dict[int, int] = {}  # per choice: characters before its next token

    def _choice(self, text: str, finish_reason: str | None, index: int) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def _delta_choice(self, text: str, finish_reason: str | None, first: bool,
                      index: int) -> dict:
        return self._choice(text, finish_reason, index)

    def _logprobs(self, entries: list[TokenLogprob], index: int) -> dict | None:
        """The legacy completions shape: parallel lists, top alternatives as {token: logprob},
        and each token's character offset in the text."""
        if self.token_bytes is None:
            return None
        tokens, offsets, offset = [], [], self._offsets.get(index, 0)
        for entry in entries:
            text = self._piece(entry.token)[0]
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self._piece(t)[0]: lp for t, lp in e.top} for e in entries],
                "text_offset": offsets}
