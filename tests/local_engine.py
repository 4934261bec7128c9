"""An engine in the test process, wired to a cache index and arena of its own, as a worker
process is wired to the gateway's: for tests that reach into the engine."""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cache.arena import HEADER_BYTES, ArenaHeader, BlockArena, default_arena_path
from cache.index import CacheIndex
from engine.batching import Engine
from engine.config import EngineConfig
from engine.llama import Model
from engine.messages import EngineSnapshot, GenerationRequest
from gateway.workers.handles import GenerationHandle


@dataclass
class LocalEngine:
    engine: Engine
    index: CacheIndex | None
    arena: BlockArena | None

    @classmethod
    def start(cls, model: Model, config: EngineConfig) -> LocalEngine:
        engine = Engine(model, config)
        index = arena = None
        if engine.kv_layout is not None:
            cache = config.cache
            slot_bytes = engine.kv_layout.block_bytes(cache.block_size)
            n_slots = ((cache.budget_mb << 20) - HEADER_BYTES) // slot_bytes
            arena = BlockArena.create(default_arena_path(), ArenaHeader(
                "test", slot_bytes, n_slots, cache.block_size))
            index = CacheIndex(n_slots, cache.block_size)
            engine.use_cache(arena, index.client(0))
        engine.start()
        return cls(engine, index, arena)

    def submit(self, request: GenerationRequest) -> GenerationHandle:
        handle = GenerationHandle(asyncio.get_running_loop(), on_cancel=self.engine.wake)
        prompt = np.asarray(request.prompt_tokens, dtype=np.int32)
        self.engine.submit(request, handle,
                           self.index.cached_length(prompt, request.namespace) if self.index else 0)
        return handle

    def settled(self) -> EngineSnapshot:
        """The snapshot once the engine has published the step that answered the last request:
        the first published after a wake-up (the engine publishes after every step, an idle
        one's too) that shows nothing running or waiting. (It slept 50 ms for the publish
        instead: a busy machine could take longer.)"""
        deadline = time.monotonic() + 120
        while True:
            before = self.engine.snapshot
            self.engine.wake()
            while self.engine.snapshot is before:
                assert time.monotonic() < deadline, "the engine published no step"
                time.sleep(0.01)
            snapshot = self.engine.snapshot
            if not snapshot.running and not snapshot.waiting:
                return snapshot

    def assert_released(self) -> None:
        """No request holds a cell or a block: only the tree references blocks."""
        snap = self.settled()
        assert snap.running == 0 and snap.waiting == 0 and self.engine.cells.used == 0
        if self.index is not None:
            refcounts = self.index.pool.refcounts
            assert (refcounts[refcounts > 0] == 1).all()

    def stop(self) -> None:
        self.engine.stop()
        if self.arena is not None:
            self.arena.close()


def recorded(ctx) -> list[collections.Counter]:
    """Replaces ctx.decode with one that records the rows per sequence id of every call."""
    calls: list[collections.Counter] = []
    decode = ctx.decode

    def recording(batch):
        calls.append(collections.Counter(batch.raw.seq_id[i][0] for i in range(len(batch))))
        decode(batch)

    ctx.decode = recording
    return calls


class Hold:
    """Holds the engine thread right after the first call of `ctx.decode` at which
    `when(calls, rows)` (both counted from here, that call's included) is true, until
    `release()`. What the test does meanwhile, such as submitting a request, lands at that
    same step on any machine, however long the machine took over the steps before."""

    def __init__(self, ctx, when: Callable[[int, int], bool]) -> None:
        self.reached, self._released = threading.Event(), threading.Event()
        counts = [0, 0]
        decode = ctx.decode

        def holding(batch):  # on the engine thread
            decode(batch)
            counts[0] += 1
            counts[1] += len(batch)
            if not self.reached.is_set() and when(*counts):
                self.reached.set()
                assert self._released.wait(60), "the test never released the engine"

        ctx.decode = holding

    async def wait(self) -> None:
        while not self.reached.is_set():
            await asyncio.sleep(0.005)

    def release(self) -> None:
        self._released.set()


def streaming(local: LocalEngine) -> Hold:
    """Holds the engine once a stream alone in the pool was computed in three calls (its
    prompt, two decodes): a request submitted then joins it at the same step on any machine."""
    return Hold(local.engine.ctx, lambda calls, _rows: calls == 3)
