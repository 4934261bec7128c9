"""OpenAI response objects for the two completion endpoints, whole and streamed."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.messages import TokenLogprob, Usage
from gateway.tools import ToolCall

TokenBytes = Callable[[int], bytes]


@dataclass
class Choice:
    """One of a request's n answers, whole."""

    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    tool_call: ToolCall | None = None  # the answer was this call (finish_reason tool_calls)
    usage: Usage | None = None  # on its last output
    n_generated: int = 0  # completion tokens so far, also when it never finishes


def usage_body(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


@dataclass
class ResponseWriter:
    """Words one request's responses: one id and creation time for all of its chunks."""

    model: str
    id_prefix: str
    object_name: str
    chunk_object_name: str
    token_bytes: TokenBytes | None = None  # set when the request asked for logprobs
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


class ChatWriter(ResponseWriter):
    def __init__(self, model: str, token_bytes: TokenBytes | None = None) -> None:
        super().__init__(model, "chatcmpl", "chat.completion", "chat.completion.chunk",
                         token_bytes)

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


class CompletionWriter(ResponseWriter):
    def __init__(self, model: str, token_bytes: TokenBytes | None = None) -> None:
        super().__init__(model, "cmpl", "text_completion", "text_completion", token_bytes)
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
