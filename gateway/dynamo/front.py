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
import functools
import json
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
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
# Other nodes a request is sent to, at most, when the one it went to cannot take it (unreachable,
# dead, or at capacity) before any of its output reached the client: each node once.
MAX_RETRIES = 3


@dataclass(eq=False)
class _Choice:
    """One of a request's choices, on the node its group is on."""

    generation: GenerationRequest
    handle: GenerationHandle | None = None
    task: asyncio.Task | None = None  # its stream from the node it is on now


def _cancel(choice: _Choice) -> None:
    """The client abandoned the choice: its stream stops, and Dynamo stops it on the node."""
    if choice.task is not None:
        choice.task.cancel()


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
        self.retries: Counter[str] = Counter()  # requests sent to another node, by why
        self._sent: Counter[int] = Counter()  # groups this front sent to each node
        self._serving: set[asyncio.Task] = set()  # `_serve` of each group in flight

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
        once, as a local worker's group does; if they must move (`_serve`), they move together.
        `cache_key` and `pool_cached` are the local router's: Dynamo's routes by the prompt's
        blocks."""
        if self._draining:
            raise EngineUnavailable("the server is shutting down")
        if not self._nodes.instance_ids():
            raise EngineUnavailable("no prefixgate node is registered in Dynamo")
        group = [_Choice(request) for request in requests]
        for choice in group:
            choice.handle = GenerationHandle(self._loop,
                                             on_cancel=functools.partial(_cancel, choice))
        task = self._loop.create_task(self._serve(group, pins))
        self._serving.add(task)  # the loop holds its tasks weakly
        task.add_done_callback(self._serving.discard)
        return [choice.handle for choice in group]

    async def _serve(self, group: list[_Choice], pins: tuple[Pin, ...]) -> None:
        """The group on the node the router picks; if it cannot be reached there, dies there,
        or is refused there at capacity before any of its outputs reached the client, on
        another node not tried yet (at most MAX_RETRIES times); else its clear error."""
        self.n_in_flight += len(group)
        generation, tried = group[0].generation, set()
        try:
            node = await self._best_node(generation)
            while True:
                failure = await self._on_node(group, pins, node)
                if failure is None:
                    return
                tried.add(node)
                moved = await self._other_node(generation, tried) \
                    if len(tried) <= MAX_RETRIES else None
                if moved is None or all(c.handle.cancelled for c in group):
                    for choice in group:
                        choice.handle.put(failure)
                    return
                reason = "refused" if failure.refused else "unreachable"
                self.retries[reason] += 1
                log.warning("%d request(s) %s on node %x (%s), nothing sent yet: trying node %x",
                            len(group), "refused" if failure.refused else "failed", node,
                            failure.error, moved)
                node = moved
        except Exception as exc:  # the router itself failed: no node was tried
            log.warning("routing a request through Dynamo failed: %s", exc)
            for choice in group:
                choice.handle.put(Output(error=str(exc), unavailable=_unreachable(exc)))
        finally:
            self.n_in_flight -= len(group)

    async def _on_node(self, group: list[_Choice], pins: tuple[Pin, ...], node: int
                       ) -> Output | None:
        """The group's choices on `node`, each streaming to its handle. A failure that may
        go elsewhere (nothing of the group was handed to its client yet): the others are
        cancelled there and the failure returned. None: every choice has ended (answered,
        cancelled, or failed where it must not move)."""
        streamed = [False]  # shared by the group's choices
        for choice in group:
            choice.task = self._loop.create_task(
                self._choice_on(choice, pins, node, streamed)) if not choice.handle.cancelled \
                else None
        pending = {c.task for c in group if c.task is not None}
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if not task.cancelled() and (failure := task.result()) is not None:
                        return failure
            return None
        finally:
            tasks = [c.task for c in group if c.task is not None]
            for task in tasks:
                task.cancel()  # Dynamo stops the request's context on the node
            if tasks:
                await asyncio.wait(tasks)

    async def _choice_on(self, choice: _Choice, pins: tuple[Pin, ...], node: int,
                         streamed: list[bool]) -> Output | None:
        """One choice on `node`, its outputs handed to its handle. A failure that may go to
        another node (the node unreachable, dead, refusing or not serving, and nothing of the
        group streamed yet) is returned, not handed; None once the choice has ended."""
        generation = choice.generation
        routing: dict[str, Any] = {"backend_instance_id": node}
        if generation.namespace:
            routing["cache_salt"] = generation.namespace
        request = {
            "model": self.model_name, "token_ids": generation.prompt_tokens,
            # Dynamo's fields are what its router reads (the load a request adds); the node
            # runs the plan in extra_args.
            "stop_conditions": {"max_tokens": generation.max_tokens},
            "sampling_options": {}, "output_options": {}, "eos_token_ids": [],
            "routing": routing, "extra_args": Planned(generation, pins).extra_args(),
        }
        try:
            # Unbuffered: a stream dropped here (cancelled, moved) is dropped in Dynamo at once,
            # which stops the request on the node, even one that has sent nothing yet.
            async for chunk in await self._router.generate_from_request(
                    request, response_buffer_size=0):
                output = codec.decode(Output, chunk["extra_args"][PLANNED])
                if (output.refused or output.unavailable) and not streamed[0]:
                    return output  # refused there at admission: another node may take it
                streamed[0] = True
                choice.handle.put(output)
                if output.last:
                    return None
            failure = Output(error="the node's stream ended before its last output",
                             unavailable=True)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the node failed it, or could not be reached
            log.warning("a request through Dynamo failed on node %x: %s", node, exc)
            failure = Output(error=str(exc), unavailable=_unreachable(exc))
        if failure.unavailable and not streamed[0]:
            return failure
        streamed[0] = True  # the node's own answer, or the client has seen text already
        choice.handle.put(failure)
        return None

    async def _best_node(self, generation: GenerationRequest) -> int:
        node = await self._cheapest(generation, self._nodes.instance_ids())
        if node is None:  # the router cannot weigh the nodes: its own pick
            node, _, _ = await self._router.best_worker(
                generation.prompt_tokens, cache_namespace=generation.namespace or None)
        return node

    async def _other_node(self, generation: GenerationRequest, tried: set[int]) -> int | None:
        """The node `_best_node` would pick among those not in `tried`; None if none is left,
        or the router cannot say (the request's own failure is then its answer)."""
        nodes = [n for n in self._nodes.instance_ids() if n not in tried]
        return await self._cheapest(generation, nodes) if nodes else None

    async def _cheapest(self, generation: GenerationRequest, nodes: list[int]) -> int | None:
        """The node of `nodes` the router's cost prefers (the prompt tokens it would compute,
        in blocks, and the blocks its requests hold); among equals, the one this front has sent
        the fewest groups; None if the router cannot say. The router itself breaks a tie by the
        order of its table: with no request in flight it sent every prompt that no node held
        (a new system prompt, a new tenant) to the same node, whose pool then overflowed while
        the others' stayed empty (loadtest.dynamo_bench)."""
        try:
            loads = await self._router.get_potential_loads(
                generation.prompt_tokens, cache_namespace=generation.namespace or None)
        except Exception as exc:
            log.warning("Dynamo's router could not weigh the nodes: %s", exc)
            return None
        cost = {load["worker_id"]: load["potential_prefill_tokens"] / self.block_size
                + load["potential_decode_blocks"] for load in loads}
        node = min(nodes, key=lambda n: (cost.get(n, math.inf), self._sent[n]))
        self._sent[node] += 1
        return node

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


# The classes of Dynamo's errors that say a node could not be reached or went away, which its
# Python binding raises either as their own exceptions or, for the others (a stream cut by a
# node that died is "Unavailable"), as a ValueError whose message begins with the class.
UNREACHABLE = ("CannotConnect", "ConnectionTimeout", "Disconnected", "EngineShutdown",
               "StreamIncomplete", "Unavailable", "WorkerUnavailable")


def _unreachable(exc: Exception) -> bool:
    """A failure to reach a node (a 503), rather than a node's answer (a 500)."""
    from dynamo.llm import exceptions

    if isinstance(exc, tuple(getattr(exceptions, name) for name in UNREACHABLE
                             if hasattr(exceptions, name))):
        return True
    return isinstance(exc, ValueError) and str(exc).split(":", 1)[0] in UNREACHABLE


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
        retries = CounterMetricFamily(
            "prefixgate_dynamo_retries",
            "Requests sent to another node before any output reached the client: the node "
            "they went to was at capacity (refused) or could not be reached or died "
            "(unreachable)", labels=["reason"])
        for reason in ("refused", "unreachable"):
            retries.add_metric([reason], self._front.retries[reason])
        yield retries
