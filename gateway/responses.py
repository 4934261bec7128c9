"""OpenAI response objects for the two completion endpoints, whole and streamed."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from gateway.messages import Usage


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
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created,
                "model": self.model, "system_fingerprint": None, "choices": choices}

    def whole(self, text: str, finish_reason: str, usage: Usage) -> dict:
        body = self._envelope(self.object_name, [self._choice(text, finish_reason)])
        body["usage"] = usage_body(usage)
        return body

    def chunk(self, text: str, finish_reason: str | None = None, *, first: bool = False,
              with_usage_field: bool = False) -> dict:
        body = self._envelope(self.chunk_object_name,
                              [self._delta_choice(text, finish_reason, first)])
        if with_usage_field:  # OpenAI sends "usage": null on every chunk when usage is asked for
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> dict:
        body = self._envelope(self.chunk_object_name, [])
        body["usage"] = usage_body(usage)
        return body

    def _choice(self, text: str, finish_reason: str | None) -> dict:
        raise NotImplementedError

    def _delta_choice(self, text: str, finish_reason: str | None, first: bool) -> dict:
        raise NotImplementedError


class ChatWriter(ResponseWriter):
    def __init__(self, model: str) -> None:
        super().__init__(model, "chatcmpl", "chat.completion", "chat.completion.chunk")

    def _choice(self, text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": finish_reason}

    def _delta_choice(self, text: str, finish_reason: str | None, first: bool) -> dict:
        delta = {"role": "assistant", "content": text} if first else \
            ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


class CompletionWriter(ResponseWriter):
    def __init__(self, model: str) -> None:
        super().__init__(model, "cmpl", "text_completion", "text_completion")

    def _choice(self, text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def _delta_choice(self, text: str, finish_reason: str | None, first: bool) -> dict:
        return self._choice(text, finish_reason)
