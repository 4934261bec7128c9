"""Errors in each API's own shape: OpenAI's {"error": {"message", "type", "param", "code"}},
Anthropic's {"type": "error", "error": {"type", "message"}}."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import orjson
from aiohttp import web

Shape = Literal["openai", "anthropic"]

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}
# Anthropic's documented error types by status (its 529 overloaded_error is our 503).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


@dataclass
class APIError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self, shape: Shape = "openai") -> dict:
        if shape == "anthropic":
            return {"type": "error", "error": {
                "type": _ANTHROPIC_TYPES.get(self.status, "api_error"),
                "message": self.message}}
        return {"error": {
            "message": self.message,
            "type": _OPENAI_TYPES.get(self.status, "server_error"),
            "param": self.param,
            "code": self.code,
        }}

    def response(self, shape: Shape = "openai") -> web.Response:
        return web.Response(status=self.status, body=orjson.dumps(self.body(shape)),
                            content_type="application/json", headers=self.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)
