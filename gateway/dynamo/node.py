"""A running gateway as a Dynamo worker (`prefixgate --dynamo`): the model registered as token
input for chat and completions, with the pool's block size and blocks, the workers' sequences
and the context length; Dynamo's generate endpoint served on the gateway's one generation path;
the radix tree published as KV events; the load published for the router's cost; deregistered
on shutdown. Discovery, request and event planes come from Dynamo's own environment variables
(DYN_DISCOVERY_BACKEND, ETCD_ENDPOINTS, DYN_REQUEST_PLANE, DYN_EVENT_PLANE, ...)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
from pathlib import Path

from cache.tokens import reusable_prompt
from gateway.core.service import Gateway
from gateway.dynamo.assets import ModelFacts, model_directory
from gateway.dynamo.events import Block, KvEvents, prompt_blocks
from gateway.dynamo.handler import Generate
from gateway.dynamo.settings import DynamoSettings, distributed_runtime

log = logging.getLogger(__name__)

LOAD_SECONDS = 1.0  # how often the load and the live blocks go to the router
# The etcd lease the node's registration lives on (Dynamo's ETCD_LEASE_TTL; its own default is
# 30 s). A node killed without deregistering stays in discovery, and the frontend keeps sending
# it some requests (503s), until its lease runs out: 5 s bounds that. The runtime renews the
# lease from its own threads; busy nodes stayed registered at 5 s through the tests.
LEASE_SECONDS = 5
REJOIN_SECONDS = 5.0  # between attempts to join Dynamo again after losing the registration


class NodeError(RuntimeError):
    """The node cannot join Dynamo (its message says why)."""


class DynamoNode:
    def __init__(self, gateway: Gateway, settings: DynamoSettings) -> None:
        self.gateway = gateway
        self.model = gateway.default_model  # a node serves one model (the command line's)
        self.settings = settings
        self._runtime = None
        self._tasks: list[asyncio.Future] = []  # the endpoint served, the state published
        self._keeper: asyncio.Task | None = None  # `_stay`
        self._events: KvEvents | None = None  # the tree's listener for the runtime there is
        self.instance: int | None = None  # Dynamo's id of this node while it is registered

    def status(self) -> dict:
        """What /health says of the node in Dynamo: registered (the frontend may route here)
        and as which instance, the id Dynamo's router and discovery name it by."""
        if self.instance is None:
            return {"registered": False}
        return {"registered": True, "instance": f"{self.instance:x}"}

    async def start(self) -> None:
        """Registers the model and serves the endpoint; a NodeError when it cannot. Then keeps
        the node in Dynamo (`_stay`)."""
        from gateway.dynamo.vocab import VocabularyError

        model = self.model
        if model.engines.pool is None:
            raise NodeError("--dynamo needs the prefix cache: its KV events are the pool's "
                            "blocks (leave out --no-prefix-cache)")
        facts = ModelFacts.of(model.vocab, model.engines.seq_len, model.config.chat_template)
        try:
            directory = await asyncio.to_thread(model_directory, model.config.workers.model_path,
                                                facts, self.settings.model_dir)
        except VocabularyError as exc:
            raise NodeError(str(exc)) from None
        await self._join(directory)
        self._keeper = asyncio.create_task(self._stay(directory))

    async def _join(self, directory: Path) -> None:
        """A runtime of its own, the endpoint served, the KV events and load published from
        the pool as it is, the model registered: a new Dynamo instance."""
        # Dynamo is imported only by a node: its Rust core is large and slow to load, and the
        # plain gateway never needs it.
        from dynamo.llm import (
            KvEventPublisher,
            ModelInput,
            ModelRuntimeConfig,
            ModelType,
            WorkerMetricsPublisher,
            WorkerType,
            register_model,
        )

        model, workers = self.model, self.model.config.workers
        pool = model.engines.pool
        header = pool.arena.header
        os.environ.setdefault("ETCD_LEASE_TTL", str(LEASE_SECONDS))  # the user's setting wins
        runtime = self._runtime = distributed_runtime(asyncio.get_running_loop())
        endpoint = runtime.endpoint(self.settings.endpoint)
        # The local indexer lets a router that starts later ask this node for its blocks.
        publisher = KvEventPublisher(endpoint, kv_block_size=header.block_size,
                                     enable_local_indexer=True)
        events = self._events = KvEvents(publisher, header.block_size)
        pool.index.watch(events)  # from the tree as it is now, in place of an earlier instance's
        load = WorkerMetricsPublisher()
        await load.create_endpoint(endpoint)
        self._tasks = [
            asyncio.ensure_future(endpoint.serve_endpoint(Generate(self.gateway, model),
                                                          graceful_shutdown=True)),
            asyncio.create_task(self._publish_state(load, events, header.block_size)),
        ]
        runtime_config = ModelRuntimeConfig()
        runtime_config.total_kv_blocks = header.n_slots
        runtime_config.max_num_seqs = workers.n_workers * workers.engine.parallel
        runtime_config.context_length = model.engines.seq_len
        runtime_config.enable_local_indexer = True
        await register_model(ModelInput.Tokens, ModelType.Chat | ModelType.Completions,
                             endpoint, str(directory), model.name,
                             worker_type=WorkerType.Aggregated,
                             kv_cache_block_size=header.block_size,
                             runtime_config=runtime_config)
        self.instance = endpoint.connection_id()
        log.info("serving %r on Dynamo at %s as instance %x: blocks of %d tokens, %d of them",
                 model.name, self.settings.endpoint, self.instance, header.block_size,
                 header.n_slots)

    async def _stay(self, directory: Path) -> None:
        """Dynamo's runtime shuts itself down when it loses its etcd lease (the node was paused
        longer than the lease, or etcd was out of its reach): the frontend has dropped the node,
        and nothing in Dynamo brings it back, while the node would go on believing itself
        registered. So when its endpoint stops without `stop`, the node joins again, as a new
        instance, until it succeeds."""
        while True:
            await asyncio.wait(self._tasks[:1])  # not cancelling the endpoint if cancelled
            log.warning("Dynamo's runtime stopped serving instance %x (its lease was lost); "
                        "joining again", self.instance or 0)
            await self._leave()
            while True:
                try:
                    await self._join(directory)
                    break
                except Exception:
                    log.exception("joining Dynamo again failed; trying again in %.0f s",
                                  REJOIN_SECONDS)
                    await self._leave()
                    await asyncio.sleep(REJOIN_SECONDS)

    async def _leave(self) -> None:
        """Shuts the runtime down and ends the node's tasks on it."""
        self.instance = None
        if self._events is not None:
            self._events.close()
        if self._runtime is not None:
            self._runtime.shutdown()
            self._runtime = None
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []

    async def _publish_state(self, load, events: KvEvents, block_size: int) -> None:
        """What the router adds to a node's cost: the KV blocks its running sequences hold,
        and the pool's blocks in use; and the blocks of the prompts in flight."""
        engines = self.model.engines
        pool = engines.pool
        while True:
            cells = sum(v.snapshot.cells_used for v in engines.views())
            used = (await asyncio.to_thread(pool.index.snapshot)).blocks_used
            load.publish(active_decode_blocks=math.ceil(cells / block_size), kv_used_blocks=used)
            if self._shares_live_cells():
                events.live(await asyncio.to_thread(self._live_blocks, block_size))
            await asyncio.sleep(LOAD_SECONDS)

    def _shares_live_cells(self) -> bool:
        """Whether a request takes a prefix from the cells of one in flight without the pool
        (engine/batching.py `_live_prefix`): in the default mode, for a model whose blocks are
        not stored as they are computed (a sliding window's or a recurrent state's are, so the
        tree has them already)."""
        layout = self.model.engines.pool.layout
        return not (self.model.config.workers.engine.deterministic or layout.window
                    or layout.state_bytes)

    def _live_blocks(self, block_size: int) -> list[Block]:
        """The full blocks of the part of each prompt in flight that another request may
        share (cache.tokens `reusable_prompt`)."""
        index, blocks = self.model.engines.pool.index, []
        for namespace, prompt in self.model.engines.prompts_in_flight():
            shareable = reusable_prompt(prompt)
            shareable = shareable[: len(shareable) // block_size * block_size]
            blocks += prompt_blocks(shareable, index.chain_keys(shareable, namespace),
                                    block_size, namespace)
        return blocks

    async def stop(self, drain_seconds: float) -> None:
        """Deregisters (the frontend stops routing here at once, not at etcd's lease end),
        then lets the requests in flight finish within `drain_seconds`."""
        if self._keeper is not None:  # first: this is no lost registration to restore
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
        self.instance = None
        if self._runtime is not None:
            self._runtime.shutdown()
            self._runtime = None
        if self._tasks:
            await asyncio.wait(self._tasks[:1], timeout=drain_seconds)
        await self._leave()
        log.info("left Dynamo")
