"""The HTTP process's application: every API's routes over one generation path, the
middlewares (API keys, each API's error shape), /health and /metrics, and serving with a clean
shutdown.

The data path of a request reads top to bottom: an API's routes (gateway/openai/,
gateway/anthropic/, gateway/responses/) parse it and render the prompt tokens ->
core.generation.generate -> a worker -> the API's wire.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

from aiohttp import web

from gateway.anthropic import routes as anthropic_routes
from gateway.core.generation import metrics_model
from gateway.core.service import HISTORY_STEP, Gateway, ServerConfig
from gateway.dynamo.front import DynamoFront, NodesCollector
from gateway.dynamo.node import DynamoNode, NodeError
from gateway.dynamo.settings import DynamoSettings
from gateway.edge import cors
from gateway.edge.auth import KeyRing, bearer_matches
from gateway.edge.errors import APIError, Shape
from gateway.openai import routes as openai_routes
from gateway.operator import admin, explain, tokens
from gateway.responses import routes as responses_routes

log = logging.getLogger(__name__)

ADMIN_PREFIX = "/v1/cache/"
ANTHROPIC_PREFIX = "/v1/messages"
KEYED_PATHS = ("/tokenize", "/detokenize")  # besides /v1/*: what needs a key when keys exist
# Monitoring's own polls: counted, they would dilute the error rate of the API's answers.
UNCOUNTED_PATHS = ("/health", "/metrics")

_own_routes = web.RouteTableDef()


@_own_routes.get("/health")
async def health(request: web.Request) -> web.Response:
    gateway: Gateway = request.app["gateway"]
    if gateway.load_error:
        return web.json_response({"status": "error", "error": gateway.load_error}, status=500)
    if not gateway.ready:
        return web.json_response({"status": "loading"}, status=503)
    models = gateway.models.all
    workers = [{**worker, "model": model.name} for model in models if model.ready
               for worker in model.engines.states()]
    n_ready = sum(w["state"] == "ready" for w in workers)
    # Degraded: a worker is being replaced, or a model failed to load; the others serve, so the
    # instance stays in rotation. Unavailable: models are loaded but none can serve (a front
    # with no node left, gateway/dynamo/front.py). Models unloaded load on demand: all well.
    whole = n_ready == len(workers) and not any(model.state == "failed" for model in models)
    loaded = any(model.ready for model in models)
    status = "unavailable" if loaded and not n_ready else "ok" if whole else "degraded"
    body = {"status": status, "models": {model.name: model.state for model in models},
            "workers": workers}
    node: DynamoNode | None = request.app["dynamo"]
    if node is not None:  # what a test or an orchestrator waits on before routing through Dynamo
        body["dynamo"] = node.status()
    return web.json_response(body, status=503 if status == "unavailable" else 200)


@_own_routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    _require_metrics_key(request)
    body, content_type = request.app["gateway"].metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": content_type})


def _require_metrics_key(request: web.Request) -> None:
    key = request.app["gateway"].config.metrics_key
    if key is not None and not bearer_matches(request.headers.get("Authorization"), key):
        raise APIError(401, "This endpoint needs the metrics key (--metrics-key)",
                       code="invalid_api_key")


def error_shape(path: str) -> Shape:
    """Anthropic's clients read Anthropic's errors on its paths; everything else is OpenAI's."""
    return "anthropic" if path.startswith(ANTHROPIC_PREFIX) else "openai"


@web.middleware
async def count_responses(request: web.Request, handler) -> web.StreamResponse:
    """Every answer by its status. Outermost: api_errors has made every failure a response."""
    response = await handler(request)
    if request.path not in UNCOUNTED_PATHS:
        request.app["gateway"].metrics.responses.labels(metrics_model(request),
                                                        str(response.status)).inc()
    return response


@web.middleware
async def api_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every failure leaves in its API's error shape, whatever raised it."""
    shape = error_shape(request.path)
    try:
        return await handler(request)
    except APIError as exc:
        return exc.response(shape)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return APIError(exc.status, exc.reason).response(shape)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error serving %s", request.path)
        return APIError(500, "Internal server error").response(shape)


@web.middleware
async def api_keys(request: web.Request, handler) -> web.StreamResponse:
    """/v1/* needs a key when keys are configured; the key's tenant is the cache namespace.
    Anthropic's clients send it as `x-api-key`, which counts as `Authorization: Bearer` does."""
    keys: KeyRing | None = request.app["gateway"].config.keys
    request["key"], request["tenant"], request["namespace"] = None, None, ""
    admin = request.path.startswith(ADMIN_PREFIX)  # the admin key guards it instead
    if keys is not None and not admin and (request.path.startswith("/v1/")
                                           or request.path in KEYED_PATHS):
        x_api_key = request.headers.get("x-api-key")
        identity = keys.identify(request.headers.get("Authorization")
                                 or (f"Bearer {x_api_key}" if x_api_key else None))
        if identity is None:
            raise APIError(401, "Incorrect API key provided. Pass one as `Authorization: "
                                "Bearer <key>` or `x-api-key: <key>`.",
                           code="invalid_api_key")
        request["key"], request["tenant"] = identity
        request["namespace"] = keys.namespace(request["tenant"])
    return await handler(request)


# Every route the gateway answers, each API's from its own module.
routes = [*_own_routes, *openai_routes.routes, *anthropic_routes.routes,
          *responses_routes.routes, *tokens.routes, *admin.routes, *explain.routes]


def build_app(gateway: Gateway, node: DynamoNode | None = None) -> web.Application:
    """`node`: the gateway's Dynamo node, started later (its /health tells when it has joined)."""
    app = web.Application(middlewares=[count_responses, api_errors, api_keys],
                          client_max_size=gateway.config.limits.max_body_bytes)
    app["gateway"] = gateway
    app["dynamo"] = node
    app.add_routes(routes)
    if gateway.config.cors_origin:
        cors.allow_origin(app, gateway.config.cors_origin)
    return app


async def serve(config: ServerConfig, dynamo: DynamoSettings | None = None,
                front: DynamoSettings | None = None) -> None:
    """`dynamo`: also serve as a Dynamo worker (gateway/dynamo/node.py); `front`: serve with no
    engine of its own, in front of the Dynamo nodes there (gateway/dynamo/front.py)."""
    engines = DynamoFront(front, config.models[0].name) if front else None
    gateway = Gateway(config, engines)
    if engines is not None:
        gateway.metrics.registry.register(NodesCollector(engines))
    node = DynamoNode(gateway, dynamo) if dynamo is not None else None
    if config.keys is None:
        log.warning("no API keys configured (--api-keys-file, PREFIXGATE_API_KEYS): anyone who "
                    "can reach %s:%d may use it, and every request shares one cache namespace",
                    config.host, config.port)
    # Cancelling the handler when its client disconnects is what frees an abandoned sequence.
    runner = web.AppRunner(build_app(gateway, node), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    log.info("listening on http://%s:%d", config.host, config.port)
    loop = asyncio.get_running_loop()
    loading = loop.run_in_executor(None, gateway.load, loop)

    async def keep_history() -> None:
        while True:
            await asyncio.sleep(HISTORY_STEP)
            if gateway.ready:
                gateway.sample_history()

    history = asyncio.create_task(keep_history())
    idle = asyncio.create_task(gateway.models.unload_idle())
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # shut down cleanly: the KV arena is unlinked
        loop.add_signal_handler(sig, stopping.set)
    try:
        waiting = asyncio.ensure_future(stopping.wait())
        await asyncio.wait([loading, waiting], return_when=asyncio.FIRST_COMPLETED)
        if gateway.load_error:  # exit, so that a supervisor sees it and the user reads why
            raise SystemExit(f"prefixgate could not start: {gateway.load_error}")
        if node is not None and not stopping.is_set():
            try:
                await node.start()
            except NodeError as exc:
                raise SystemExit(f"prefixgate could not join Dynamo: {exc}") from None
        await waiting
        if node is not None:  # first: the frontend routes nothing more here
            await node.stop(config.drain_seconds)
        log.info("stopping: %d requests in flight get up to %.0f s to finish",
                 gateway.models.n_in_flight(), config.drain_seconds)
        await gateway.models.drain(config.drain_seconds)
    finally:
        await loading
        history.cancel()
        idle.cancel()
        await loop.run_in_executor(None, gateway.close)  # streams still open hear the 503
        await runner.cleanup()
        log.info("stopped after %.0f s", time.monotonic() - gateway.metrics.started)
