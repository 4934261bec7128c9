"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson
from aiohttp import web

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}


@dataclass
class APIError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict:
        return {"error": {
            "message": self.message,
            "type": _TYPE_BY_STATUS.get(self.status, "server_error"),
            "param": self.param,
            "code": self.code,
        }}

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=orjson.dumps(self.body()),
                            content_type="application/json", headers=self.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)
