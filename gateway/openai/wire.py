"""OpenAI's words for the two completion endpoints' outputs, whole and streamed."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.messages import Output, TokenLogprob, Usage
from gateway.core.generation import Choice, Event, Growth, Wire
from gateway.edge.errors import APIError
from gateway.formats.chat_formats import OutputParser, Part

TokenBytes = Callable[[int], bytes]


def tool_call_body(call: Part) -> dict:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.text}}


def usage_body(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {
            "accepted_prediction_tokens": usage.accepted_prediction_tokens,
            "rejected_prediction_tokens": usage.rejected_prediction_tokens},
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
            {**self._choice(c, i), "logprobs": self._logprobs(c.logprobs, i)}
            for i, c in enumerate(choices)])
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

    def on_output(self, index: int, output: Output, choice: Choice,
                  growth: list[Growth]) -> list[Event]:
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

    def _choice(self, choice: Choice, index: int) -> dict:
        raise NotImplementedError

    def _delta_choice(self, text: str, finish_reason: str | None, first: bool,
                      index: int) -> dict:
        raise NotImplementedError

    def _logprobs(self, entries: list[TokenLogprob], index: int) -> dict | None:
        raise NotImplementedError

    def _piece(self, token: int) -> tuple[str, bytes]:
        data = self.token_bytes(token)
        return data.decode(errors="replace"), data


class ChatWire(OpenAIWire):
    """Reasoning as `reasoning_content` (as llama-server and vLLM return it), the answer as
    `content`, calls as `tool_calls`: streamed as each grows."""

    def __init__(self, model: str, token_bytes: TokenBytes | None = None,
                 include_usage: bool = False, parser: OutputParser | None = None) -> None:
        super().__init__(model, "chatcmpl", "chat.completion", "chat.completion.chunk",
                         token_bytes, include_usage)
        self.parser = parser

    def opening(self, n_choices: int) -> list[Event]:
        return [Event(self.chunk("", first=True, with_usage_field=self.include_usage, index=i))
                for i in range(n_choices)]

    def on_output(self, index: int, output: Output, choice: Choice,
                  growth: list[Growth]) -> list[Event]:
        deltas = []
        for g in growth:
            if g.part.kind == "call":
                if g.new or g.delta:
                    deltas.append(({"tool_calls": [self._call_delta(g)]}, []))
            elif g.delta:
                field = "content" if g.part.kind == "text" else "reasoning_content"
                logprobs = choice.new_logprobs() if g.part.kind == "text" else []
                deltas.append(({field: g.delta}, logprobs))
        events = [Event(self._delta_chunk(delta, None, index, logprobs))
                  for delta, logprobs in deltas]
        if output.last:  # as OpenAI ends a choice: a chunk of its own, its delta empty
            events.append(Event(self._delta_chunk({}, choice.reason(), index, [])))
        return events

    def _delta_chunk(self, delta: dict, finish_reason: str | None, index: int,
                     logprobs: list[TokenLogprob]) -> dict:
        body = self._envelope(self.chunk_object_name, [{
            "index": index, "delta": delta, "logprobs": self._logprobs(logprobs, index),
            "finish_reason": finish_reason}])
        if self.include_usage:
            body["usage"] = None
        return body

    @staticmethod
    def _call_delta(g: Growth) -> dict:
        """A call streamed as the SDK's accumulator expects it: its id, type and name with
        its first arguments, then the rest of its arguments as they are written."""
        if not g.new:
            return {"index": g.call_index, "function": {"arguments": g.delta}}
        return {"index": g.call_index, "id": g.part.id, "type": "function",
                "function": {"name": g.part.name, "arguments": g.delta}}

    def _choice(self, choice: Choice, index: int) -> dict:
        calls = choice.calls()
        message = {"role": "assistant",
                   "content": choice.answer() if choice.answer() or not calls else None}
        if choice.reasoning():
            message["reasoning_content"] = choice.reasoning()
        if calls:
            message["tool_calls"] = [tool_call_body(c) for c in calls]
        return {"index": index, "message": message, "logprobs": None,
                "finish_reason": choice.reason()}

    def _delta_choice(self, text: str, finish_reason: str | None, first: bool,
                      index: int) -> dict:
        delta = {"role": "assistant", "content": text} if first else \
            ({"content": text} if text else {})
        return {"index": index, "delta": delta, "logprobs": None,
                "finish_reason": finish_reason}

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

    def _choice(self, choice: Choice, index: int) -> dict:
        return self._delta_choice(choice.text, choice.finish_reason, False, index)

    def _delta_choice(self, text: str, finish_reason: str | None, first: bool,
                      index: int) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

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
