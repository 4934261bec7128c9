"""CORS for browser clients (--cors-allow-origin; off by default): preflights answered before
any key is asked for (browsers send none with them), and every response carrying the origin."""

from __future__ import annotations

from aiohttp import web

ALLOWED_METHODS = "GET, POST, DELETE, OPTIONS"
ALLOWED_HEADERS = "Authorization, Content-Type"
PREFLIGHT_MAX_AGE = 600  # seconds a browser may keep the answer


def allow_origin(app: web.Application, origin: str) -> None:
    """`origin`: one origin (https://app.example) or `*` for any, as llama-server answers."""

    @web.middleware
    async def preflight(request: web.Request, handler) -> web.StreamResponse:
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            return web.Response(status=204, headers={
                "Access-Control-Allow-Methods": ALLOWED_METHODS,
                "Access-Control-Allow-Headers": ALLOWED_HEADERS,
                "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE)})
        return await handler(request)

    async def add_origin(_request: web.Request, response: web.StreamResponse) -> None:
        response.headers["Access-Control-Allow-Origin"] = origin
        if origin != "*":  # the answer depends on the origin: caches must know
            response.headers["Vary"] = "Origin"

    app.middlewares.insert(0, preflight)
    app.on_response_prepare.append(add_origin)
