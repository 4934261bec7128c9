"""prefixgate's front over a Dynamo deployment (`prefixgate --dynamo-front`): the engines of a
gateway that has none of its own (gateway/core/engines.py). The gateway authenticates, renders,
tokenizes and plans each request as it always does; then, instead of a local worker, Dynamo's
KV router picks the prefixgate node that holds most of the prompt under the tenant's namespace
(the cache salt the nodes publish their blocks with), the plan goes there whole
(requests.py `Planned`) and the node's outputs come back as the engine's own `Output`s, which
the API modules answer from as they do from a local worker.

The nodes are found through Dynamo's discovery (its environment variables, as a node's): the
front serves once one node has registered, with that node's block size (the router hashes
blocks of it) and context length (the tokens one request may hold)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.messages import EngineUnavailable, GenerationRequest, Output
from gateway.dynamo import codec
from gateway.dynamo.requests import PLANNED, Planned
from gateway.dynamo.settings import DynamoSettings, distributed_runtime
from gateway.formats.prompts import Pin
from gateway.workers.handles import GenerationHandle
from gateway.workers.shared_pool import TierHits

if TYPE_CHECKING:
    from gateway.workers.supervisor import WorkerView

log = logging.getLogger(__name__)

CARD_POLL_SECONDS = 0.2  # how often a front waiting for its first node looks again


class DynamoFront:
    """Engines that are Dynamo's prefixgate nodes, reached through its KV router."""

    pool = None  # the nodes' pools are theirs: pins travel with the requests

    def __init__(self, settings: DynamoSettings, model_name: str) -> None:
        self.settings = settings
        self.model_name = model_name
        self.seq_len = 0
        self.block_size = 0
        self.n_in_flight = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runtime: Any = None
        self._router: Any = None
        self._nodes: Any = None  # Dynamo's client of the nodes' endpoint: who is registered
        self._draining = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        asyncio.run_coroutine_threadsafe(self._connect(), loop).result()

    async def _connect(self) -> None:
        from dynamo.llm import FpmEventSubscriber, KvRouter, KvRouterConfig

        self._runtime = distributed_runtime(asyncio.get_running_loop())
        endpoint = self._runtime.endpoint(self.settings.endpoint)
        self._nodes = await endpoint.client()
        cards = FpmEventSubscriber(endpoint)
        cards.start_tracking()
        log.info("waiting for a prefixgate node at %s in Dynamo", self.settings.endpoint)
        while not (found := cards.get_model_cards()):
            if self._draining:  # stopped while waiting: the server's shutdown waits for this
                cards.shutdown()
                raise EngineUnavailable("stopped before a prefixgate node registered")
            await asyncio.sleep(CARD_POLL_SECONDS)
        cards.shutdown()
        card = json.loads(next(iter(found.values())))
        self.block_size = card["kv_cache_block_size"]
        self.seq_len = card["context_length"]
        self._router = KvRouter(endpoint, self.block_size, KvRouterConfig())
        log.info("front over Dynamo at %s: blocks of %d tokens, requests of up to %d tokens",
                 self.settings.endpoint, self.block_size, self.seq_len)

    # ----- requests -----------------------------------------------------------------------------

    def submit_group(self, requests: list[GenerationRequest], cache_key: str | None = None,
                     pool_cached: int | None = None, pins: tuple[Pin, ...] = ()
                     ) -> list[GenerationHandle]:
        """Each choice is a request of its own. A request's choices all go to the node the
        router picks for the first, where they run beside each other and compute their prompt
        once, as a local worker's group does. `cache_key` and `pool_cached` are the local
        router's: Dynamo's routes by the prompt's blocks."""
        if self._draining:
            raise EngineUnavailable("the server is shutting down")
        if not self._nodes.instance_ids():
            raise EngineUnavailable("no prefixgate node is registered in Dynamo")
        node = self._loop.create_task(self._best_node(requests[0])) if len(requests) > 1 \
            else None
        return [self._submit(request, pins, node) for request in requests]

    async def _best_node(self, generation: GenerationRequest) -> int:
        node, _, _ = await self._router.best_worker(
            generation.prompt_tokens, cache_namespace=generation.namespace or None)
        return node

    def _submit(self, generation: GenerationRequest, pins: tuple[Pin, ...],
                node: asyncio.Task | None) -> GenerationHandle:
        task: asyncio.Task | None = None
        # Cancelling the stream drops the request on the node (Dynamo stops its context).
        handle = GenerationHandle(self._loop, on_cancel=lambda: task.cancel())
        task = self._loop.create_task(self._stream(handle, generation, pins, node))
        return handle

    async def _stream(self, handle: GenerationHandle, generation: GenerationRequest,
                      pins: tuple[Pin, ...], node: asyncio.Task | None) -> None:
        """`node`: the node the request must go to (its group's), once known; None: the
        router picks."""
        self.n_in_flight += 1
        try:
            routing: dict[str, Any] = {"cache_salt": generation.namespace} \
                if generation.namespace else {}
            if node is not None:  # shielded: one choice cancelled must not cancel its group's
                routing["backend_instance_id"] = await asyncio.shield(node)
            request = {
                "model": self.model_name, "token_ids": generation.prompt_tokens,
                # Dynamo's fields are what its router reads (the load a request adds); the
                # node runs the plan in extra_args.
                "stop_conditions": {"max_tokens": generation.max_tokens},
                "sampling_options": {}, "output_options": {}, "eos_token_ids": [],
                "routing": routing, "extra_args": Planned(generation, pins).extra_args(),
            }
            async for chunk in await self._router.generate_from_request(request):
                output = codec.decode(Output, chunk["extra_args"][PLANNED])
                handle.put(output)
                if output.last:
                    return
            handle.put(Output(error="the node's stream ended before its last output",
                              unavailable=True))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the node refused or failed it, or none could be reached
            log.warning("a request through Dynamo failed: %s", exc)
            handle.put(Output(error=str(exc), unavailable=_unreachable(exc)))
        finally:
            self.n_in_flight -= 1

    def live_match(self, prompt: np.ndarray, namespace: str) -> tuple[int, np.ndarray | None]:
        return 0, None  # the live sequences are the nodes'

    # ----- lifecycle ----------------------------------------------------------------------------

    async def drain(self, seconds: float) -> None:
        self._draining = True
        deadline = time.monotonic() + seconds
        while self.n_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    def stop(self) -> None:
        self._draining = True
        if self._runtime is not None:
            self._runtime.shutdown()

    # ----- what /health and /metrics read --------------------------------------------------------

    def states(self) -> list[dict]:
        """The nodes registered in Dynamo's discovery."""
        ids = self._nodes.instance_ids() if self._nodes is not None else []
        return [{"node": f"{node:x}", "state": "ready"} for node in ids]

    def views(self) -> list[WorkerView]:
        return []  # no engine here: each node's /metrics has its own

    def tier_hits(self) -> TierHits:
        return TierHits(0, {})

    def problems(self) -> list[str]:
        return []


def _unreachable(exc: Exception) -> bool:
    """A failure to reach a node (a 503), rather than a node's answer (a 500)."""
    from dynamo.llm.exceptions import (
        CannotConnect,
        ConnectionTimeout,
        Disconnected,
        EngineShutdown,
        StreamIncomplete,
        WorkerUnavailable,
    )

    return isinstance(exc, (CannotConnect, ConnectionTimeout, Disconnected, EngineShutdown,
                            StreamIncomplete, WorkerUnavailable))


class NodesCollector(Collector):
    """A front's /metrics: the nodes Dynamo's discovery holds, and its requests in flight."""

    def __init__(self, front: DynamoFront) -> None:
        self._front = front

    def collect(self):
        yield GaugeMetricFamily("prefixgate_dynamo_nodes",
                                "prefixgate nodes registered in Dynamo's discovery",
                                value=len(self._front.states()))
        yield GaugeMetricFamily("prefixgate_dynamo_requests_in_flight",
                                "Requests this front has on the nodes",
                                value=self._front.n_in_flight)
