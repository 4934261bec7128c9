"""The operator's side: the cache admin API (/v1/cache/*, behind --admin-key), the live cache
page that reads it, and /debug/consistency (behind --debug-key)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web

from gateway.core.generation import json_response, requested_model
from gateway.core.models import ServedModel
from gateway.core.requests import Strict, parse_request
from gateway.core.service import Gateway
from gateway.edge.auth import bearer_matches
from gateway.edge.errors import APIError
from gateway.workers.shared_pool import SharedPool

CACHE_PAGE = Path(__file__).parent / "static" / "cache.html"
HOTTEST_PREFIXES = 50  # rows of GET /v1/cache/prefixes
PREVIEW_CHARS = 80

routes = web.RouteTableDef()


@routes.get("/debug/consistency")
async def consistency(request: web.Request) -> web.Response:
    """Tree, pool, leases and workers against each other (see Workers.problems). It walks the
    whole tree under the index's lock: an operator's tool, off without --debug-key."""
    _require_debug_key(request)
    gateway: Gateway = request.app["gateway"]
    problems = await asyncio.to_thread(
        lambda: [problem for model in gateway.models.all for problem in model.engines.problems()])
    return json_response({"ok": not problems, "problems": problems})


def _require_admin_key(request: web.Request) -> Gateway:
    gateway: Gateway = request.app["gateway"]
    key = gateway.config.admin_key
    if key is None:  # no admin API at all without a key
        raise web.HTTPNotFound()
    if not bearer_matches(request.headers.get("Authorization"), key):
        raise APIError(401, "The admin API needs the admin key (--admin-key)",
                       code="invalid_api_key")
    return gateway


def _require_admin(request: web.Request) -> tuple[Gateway, ServedModel, SharedPool]:
    """The admin key's request, for the model `?model=` names (the first served without)."""
    gateway = _require_admin_key(request)
    model = requested_model(request, request.query.get("model", gateway.default_model.name))
    return gateway, model, model.require_pool()


@routes.post("/models/load")
async def load_model(request: web.Request) -> web.Response:
    """llama-server's router's: loads the model (making room as a request would), and answers
    once it serves, or why it could not."""
    gateway, model = await _admin_model(request)
    await gateway.models.ensure_loaded(model)
    return json_response({"success": True, "model": model.name, "status": model.state})


@routes.post("/models/unload")
async def unload_model(request: web.Request) -> web.Response:
    """Lets the requests holding the model finish (--drain-seconds), then unloads it."""
    gateway, model = await _admin_model(request)
    await gateway.models.unload(model)
    return json_response({"success": True, "model": model.name, "status": model.state})


async def _admin_model(request: web.Request) -> tuple[Gateway, ServedModel]:
    gateway = _require_admin_key(request)
    model = gateway.models.named(parse_request(ModelName, await request.read()).model)
    request["model"] = model.name
    return gateway, model


class ModelName(Strict):
    model: str


@routes.get("/cache")
async def cache_page(request: web.Request) -> web.StreamResponse:
    """The live cache page: static, it reads the admin API with the key it is given."""
    if request.app["gateway"].config.admin_key is None:
        raise web.HTTPNotFound()
    return web.FileResponse(CACHE_PAGE)


@routes.get("/v1/cache/prefixes")
async def cached_prefixes(request: web.Request) -> web.Response:
    gateway, model, pool = _require_admin(request)
    index, slot_bytes = pool.index, pool.arena.header.slot_bytes
    rows = await asyncio.to_thread(index.prefixes, HOTTEST_PREFIXES)
    for row in rows:
        tokens = row.pop("tokens")
        row.update(tokens=len(tokens), bytes=row["blocks"] * slot_bytes)
        if gateway.config.log_prompts:  # text only where prompts may be shown at all
            row["preview"] = model.vocab.detokenize(list(tokens))[:PREVIEW_CHARS]
    return json_response({"object": "list", "data": rows})


@routes.delete("/v1/cache/prefixes")
async def drop_prefixes(request: web.Request) -> web.Response:
    _, _, pool = _require_admin(request)
    dropped = await asyncio.to_thread(pool.index.drop, request.query.get("namespace"))
    return json_response({"dropped_blocks": dropped})


@routes.get("/v1/cache/stats")
async def cache_stats(request: web.Request) -> web.Response:
    gateway, model, _ = _require_admin(request)
    return json_response(gateway.cache_stats(model))


def _require_debug_key(request: web.Request) -> None:
    key = request.app["gateway"].config.debug_key
    if key is None:
        raise web.HTTPNotFound()
    if not bearer_matches(request.headers.get("Authorization"), key):
        raise APIError(401, "This endpoint needs the debug key (--debug-key)",
                       code="invalid_api_key")
