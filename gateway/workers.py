"""The gateway's side of its engine worker processes: starting them, routing requests to them,
answering their cache index calls, and replacing one that dies.

Each worker gets a `multiprocessing` connection (a Unix socket pair: message framing and
pickling of plain dataclasses from the standard library, no broker; see README "Workers").
A reader thread per worker takes its messages: outputs go to the requests' asyncio queues, index
calls are answered right there under the index's lock (never waiting for the event loop), and
end of file means the worker died: its requests get a 503, everything it held in the pool is
released, and a replacement starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import multiprocessing
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import numpy as np

from cache import persistence
from cache.arena import (
    HEADER_BYTES,
    ArenaHeader,
    BlockArena,
    default_arena_path,
    remove_stale_arenas,
)
from cache.index import CacheIndex
from cache.redis_tier import RedisTier, TierStats
from engine import process as worker_process
from engine.messages import (
    Attach,
    Cancel,
    CommitStore,
    EngineSnapshot,
    EngineUnavailable,
    GenerationRequest,
    IndexReply,
    MatchCall,
    Output,
    Outputs,
    PlanStoreCall,
    Published,
    Ready,
    ReleaseLease,
    Shutdown,
    Submit,
)
from gateway.config import WorkersConfig
from gateway.router import Router, WorkerLoad

log = logging.getLogger(__name__)

RESTART_DELAY = 1.0  # seconds before a dead worker's replacement starts
KEY_OWNERS = 10_000  # prompt_cache_keys remembered, least recently used forgotten first


class Overloaded(RuntimeError):
    """Every sequence is busy and the waiting queue is full."""


class GenerationHandle:
    """The asyncio side of one request: iterate `outputs()`, call `cancel()` to abandon it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_cancel: Callable[[], None]) -> None:
        self._loop = loop
        self._on_cancel = on_cancel
        self._queue: asyncio.Queue[Output] = asyncio.Queue()
        self.cancelled = False
        self.finished = False

    def deliver(self, output: Output) -> None:
        """Called from any thread."""
        _deliver_soon(self._loop, [(self, output)])

    def put(self, output: Output) -> None:
        """Called on the event loop."""
        self._queue.put_nowait(output)

    async def outputs(self) -> AsyncIterator[Output]:
        while not self.finished:
            output = await self._queue.get()
            self.finished = output.last
            yield output

    def cancel(self) -> None:
        if not self.finished and not self.cancelled:
            self.cancelled = True
            self._on_cancel()


def _deliver_soon(loop: asyncio.AbstractEventLoop,
                  outputs: list[tuple[GenerationHandle, Output]]) -> None:
    """Hands outputs to their requests' queues on the event loop: one wake-up for them all."""
    def put_all() -> None:
        for handle, output in outputs:
            handle.put(output)

    # A closed loop (RuntimeError) means nobody is listening any more.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(put_all)


@dataclass
class _InFlight:
    handle: GenerationHandle
    prompt: np.ndarray
    namespace: str


@dataclass
class WorkerProcess:
    worker_id: int
    process: multiprocessing.process.BaseProcess
    conn: Connection
    state: str = "starting"  # starting | ready | dead
    snapshot: EngineSnapshot = EngineSnapshot()
    requests: dict[int, _InFlight] = field(default_factory=dict)
    routed: Counter = field(default_factory=Counter)  # routing decisions by reason
    restarts: int = 0
    send_lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, message) -> None:
        """From the event loop or a reader thread; a dead worker's reader handles the fallout."""
        with self.send_lock, contextlib.suppress(OSError):
            self.conn.send(message)


class Workers:
    def __init__(self, config: WorkersConfig) -> None:
        self.config = config
        self.index: CacheIndex | None = None
        self.tier: RedisTier | None = None
        self.cache_key_requests = 0  # a count only: keys are unbounded, never a label
        self._key_owners: OrderedDict[str, int] = OrderedDict()  # prompt_cache_key -> worker
        self.arena: BlockArena | None = None
        self.router: Router | None = None
        self.seq_len = 0
        self._workers: list[WorkerProcess] = []
        self._lock = threading.Lock()  # worker states, their request maps, the arena
        self._ids = itertools.count(1)
        self._any_ready = threading.Event()
        self._started = False  # from then on a worker that exits is replaced
        self.failure: str | None = None  # why starting failed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._stopping = False
        self._mp = multiprocessing.get_context("spawn")  # no fork of a threaded process

    # ----- lifecycle ----------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop, timeout: float = 300) -> None:
        """Starts every worker and waits until one serves (or all failed)."""
        self._loop = loop
        for path in remove_stale_arenas():
            log.info("removed %s, the arena of a gateway that no longer runs", path)
        self._workers = [self._spawn(i) for i in range(self.config.n_workers)]
        deadline = time.monotonic() + timeout
        while not self._any_ready.wait(0.2):
            if all(not w.process.is_alive() for w in self._workers):
                raise RuntimeError("every engine worker exited while starting; see the log")
            if time.monotonic() > deadline:
                raise TimeoutError("no engine worker became ready")
        if self.failure:
            raise RuntimeError(self.failure)
        self._started = True

    def _spawn(self, worker_id: int, restarts: int = 0) -> WorkerProcess:
        ours, theirs = self._mp.Pipe(duplex=True)
        process = self._mp.Process(
            target=worker_process.run, name=f"prefixgate-worker-{worker_id}", daemon=True,
            args=(theirs, worker_id, self.config.model_path, self.config.engine,
                  self.config.log_level))
        process.start()
        theirs.close()
        worker = WorkerProcess(worker_id, process, ours, restarts=restarts)
        threading.Thread(target=self._read, args=(worker,), name=f"worker-{worker_id}-reader",
                         daemon=True).start()
        log.info("started engine worker %d (pid %d)", worker_id, process.pid)
        return worker

    async def drain(self, seconds: float) -> None:
        """Refuses new requests and waits up to `seconds` for those in flight."""
        self._draining = True
        deadline = time.monotonic() + seconds
        while self.n_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    def stop(self, timeout: float = 30) -> None:
        """Stops every worker (what is still in flight gets a 503) and removes the arena."""
        self._draining = self._stopping = True
        for worker in self._workers:
            worker.send(Shutdown())
        for worker in self._workers:
            worker.process.join(timeout)
            if worker.process.is_alive():
                log.error("worker %d did not stop in %.0f s; killing it", worker.worker_id,
                          timeout)
                worker.process.kill()
                worker.process.join(5)
        with self._lock:
            if self.arena is None:
                return
            if self.config.cache_dir is not None:  # the workers are gone: nothing writes now
                try:
                    n = persistence.save(self.config.cache_dir, self.index, self.arena)
                    log.info("saved %d cached blocks to %s", n, self.config.cache_dir)
                except OSError:
                    log.exception("saving the prefix cache to %s failed", self.config.cache_dir)
            if self.tier is not None:
                self.tier.close()
            self.arena.close()
            self.arena = None

    # ----- requests -----------------------------------------------------------------------------

    @property
    def n_in_flight(self) -> int:
        with self._lock:
            return sum(len(w.requests) for w in self._workers)

    def pin(self, request: GenerationRequest) -> None:
        """prompt_cache_retention "24h": the prompt's cached blocks outlive LRU for a while."""
        if self.index is not None:
            self.index.pin(np.asarray(request.prompt_tokens, dtype=np.int32), request.namespace,
                           time.time() + self.config.pin_hours * 3600)

    def submit_group(self, requests: list[GenerationRequest],
                     cache_key: str | None = None) -> list[GenerationHandle]:
        """Requests on one prompt (a request's n choices), routed together to one worker, so
        that the prompt is computed once and its cells shared. Requests with the same
        `cache_key` go to the same worker while the imbalance guard allows."""
        if self._draining:
            raise EngineUnavailable("the server is shutting down")
        request = requests[0]
        prompt = np.asarray(request.prompt_tokens, dtype=np.int32)
        namespace = request.namespace
        pool_cached = self.index.cached_length(prompt, namespace) if self.index else 0
        with self._lock:
            ready = [w for w in self._workers if w.state == "ready"]
            if not ready:
                raise EngineUnavailable("no engine worker is ready")
            in_flight = sum(len(w.requests) for w in self._workers)
            capacity = len(ready) * self.config.engine.parallel + self.config.max_queue
            if in_flight + len(requests) > capacity:
                raise Overloaded(f"{in_flight} requests in flight, room for {capacity}")
            loads = [WorkerLoad(w.worker_id, [r.prompt for r in w.requests.values()
                                              if r.namespace == namespace]) for w in ready]
            chosen, reason = self.router.choose(prompt, loads, pool_cached)
            if cache_key is not None:
                self.cache_key_requests += 1
                owner = next((w for w in loads if w.worker_id == self._key_owners.get(cache_key)),
                             None)
                if owner is not None and reason != "balance" and len(loads) > 1:
                    chosen, reason = owner, "cache_key"
                self._key_owners[cache_key] = chosen.worker_id
                self._key_owners.move_to_end(cache_key)
                if len(self._key_owners) > KEY_OWNERS:
                    self._key_owners.popitem(last=False)
            worker = next(w for w in ready if w.worker_id == chosen.worker_id)
            ids, handles = [next(self._ids) for _ in requests], []
            for request_id in ids:
                handles.append(GenerationHandle(
                    self._loop, on_cancel=functools.partial(self._cancel, worker, request_id)))
                worker.requests[request_id] = _InFlight(handles[-1], prompt, namespace)
            worker.routed[reason] += 1
        for request_id, each in zip(ids, requests, strict=True):
            worker.send(Submit(request_id, each, pool_cached))
        return handles

    # ----- the Redis tier ------------------------------------------------------------------------

    def _to_tier(self, block_key: bytes, tokens: np.ndarray, slot: int) -> None:
        self.tier.put(block_key, tokens, self.arena.block(slot))

    def fetch_from_tier(self, request: GenerationRequest) -> None:
        """On a local miss, adopts the prompt's following blocks from Redis into the pool (one
        round trip, capped by --redis-timeout). Blocking: call it off the event loop. The tier
        only ever saves work: whatever goes wrong here, the request computes instead."""
        if self.tier is None or self.index is None:
            return
        try:
            self._fetch_from_tier(request)
        except Exception:
            log.exception("adopting blocks from Redis failed; computing instead")

    def _fetch_from_tier(self, request: GenerationRequest) -> None:
        # What a request may take from the cache: all but its last two tokens (Engine._reusable).
        prompt = np.asarray(request.prompt_tokens[:-2], dtype=np.int32)
        bs, namespace = self.index.block_size, request.namespace
        have = self.index.cached_length(prompt, namespace)
        first = have // bs
        if len(prompt) - first * bs < bs:  # not a whole block to gain
            return
        keys = self.index.chain_keys(prompt, namespace)[first:]
        chunks = [prompt[i: i + bs] for i in range(first * bs, len(prompt), bs)]
        found = self.tier.fetch(keys, chunks)
        if not found:
            return

        def block_bytes(start: int, _end: int) -> bytes | None:
            i = start // bs - first
            return found[i] if 0 <= i < len(found) else None

        held = self.index.adopt(prompt[: first * bs + sum(len(c) for c in chunks[:len(found)])],
                                namespace, block_bytes, self.arena)
        self.tier.record_hit(max(0, held - have))

    def _cancel(self, worker: WorkerProcess, request_id: int) -> None:
        """The client went away: the worker drops the sequence without another output."""
        with self._lock:
            worker.requests.pop(request_id, None)
        worker.send(Cancel(request_id))

    # ----- one reader thread per worker ---------------------------------------------------------

    def _read(self, worker: WorkerProcess) -> None:
        while True:
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                break
            try:
                self._dispatch(worker, message)
            except Exception:  # a bad message must not stop the reader: its worker would hang
                log.exception("handling %s from worker %d failed", type(message).__name__,
                              worker.worker_id)
        self._on_exit(worker)

    def _dispatch(self, worker: WorkerProcess, message) -> None:
        index = self.index
        if isinstance(message, Outputs):
            delivered = []
            with self._lock:
                for request_id, output in message.items:
                    in_flight = (worker.requests.pop(request_id, None) if output.last
                                 else worker.requests.get(request_id))
                    if in_flight is not None:
                        delivered.append((in_flight.handle, output))
            _deliver_soon(self._loop, delivered)
        elif isinstance(message, Published):
            worker.snapshot = message.snapshot
        elif isinstance(message, MatchCall):
            worker.send(IndexReply(message.call_id, index.match(
                worker.worker_id, message.tokens, message.namespace)))
        elif isinstance(message, PlanStoreCall):
            worker.send(IndexReply(message.call_id, index.plan_store(
                worker.worker_id, message.tokens, message.namespace, message.final,
                message.hold)))
        elif isinstance(message, ReleaseLease):
            index.release(message.lease_id)
        elif isinstance(message, CommitStore):
            index.commit_store(message.plan_id, message.written)
        elif isinstance(message, Ready):
            self._on_ready(worker, message)

    def _on_ready(self, worker: WorkerProcess, ready: Ready) -> None:
        with self._lock:
            if ready.layout is not None and self.arena is None:
                try:
                    self.arena = self._create_arena(ready)
                except Exception as exc:  # e.g. --shared-memory names a live gateway's arena
                    log.exception("creating the block arena failed")
                    self.failure = f"creating the block arena failed: {exc}"
                    worker.send(Shutdown())
                    self._any_ready.set()
                    return
                if self.config.redis is not None:
                    self.tier = RedisTier(self.config.redis, ready.fingerprint,
                                          self.arena.header.slot_bytes)
                header = self.arena.header
                budget = self.config.pin_budget_mb
                self.index = CacheIndex(
                    header.n_slots, header.block_size,
                    on_stored=self._to_tier if self.tier else None,
                    pin_budget=None if budget is None else (budget << 20) // header.slot_bytes)
                if self.config.cache_dir is not None:  # before any request can use the pool
                    persistence.load(self.config.cache_dir, self.index, self.arena)
            if self.router is None:
                block_size = self.config.engine.cache.block_size
                self.router = Router(self.config.routing, block_size)
            self.seq_len = ready.seq_len
            worker.snapshot = EngineSnapshot(cells_total=ready.cells_total)
        worker.send(Attach(str(self.arena.path) if self.arena and ready.layout else None))
        with self._lock:
            worker.state = "ready"
        self._any_ready.set()
        log.info("engine worker %d (pid %d) ready: %d KV cells", worker.worker_id, ready.pid,
                 ready.cells_total)

    def _create_arena(self, ready: Ready) -> BlockArena:
        cache = self.config.engine.cache
        slot_bytes = ready.layout.block_bytes(cache.block_size)
        n_slots = ((cache.budget_mb << 20) - HEADER_BYTES) // slot_bytes
        if n_slots < 1:
            raise ValueError(f"a cache budget of {cache.budget_mb} MiB holds no "
                             f"{slot_bytes}-byte block")
        arena = BlockArena.create(self.config.arena_path or default_arena_path(),
                                  ArenaHeader(ready.fingerprint, slot_bytes, n_slots,
                                              cache.block_size))
        log.info("prefix cache: %d blocks of %d tokens (%.1f MiB each) in %s", n_slots,
                 cache.block_size, slot_bytes / 2**20, arena.path)
        return arena

    def _on_exit(self, worker: WorkerProcess) -> None:
        worker.process.join(10)
        with self._lock:
            worker.state = "dead"
            orphans = list(worker.requests.values())
            worker.requests.clear()
            # Its counters stay (a replacement's start again from zero); it holds nothing now.
            worker.snapshot = dataclasses.replace(worker.snapshot, running=0, waiting=0,
                                                  cells_used=0)
        if self.index is not None:
            self.index.release_owner(worker.worker_id)
        reason = f"engine worker {worker.worker_id} exited (status {worker.process.exitcode})"
        failed = Output(error=reason, unavailable=True)
        _deliver_soon(self._loop, [(in_flight.handle, failed) for in_flight in orphans])
        if self._stopping:
            log.info("engine worker %d stopped", worker.worker_id)
            return
        if not self._started:
            log.error("%s while starting", reason)
            return
        log.error("%s with %d requests in flight; starting a replacement", reason, len(orphans))
        threading.Timer(RESTART_DELAY, self._replace, args=(worker,)).start()

    def _replace(self, dead: WorkerProcess) -> None:
        if self._stopping:
            return
        replacement = self._spawn(dead.worker_id, dead.restarts + 1)
        replacement.routed = dead.routed
        with self._lock:
            self._workers[self._workers.index(dead)] = replacement

    # ----- what /health and /metrics read --------------------------------------------------------

    def problems(self) -> list[str]:
        """The consistency check: the index's own, and with nothing in flight, that no worker
        holds a sequence, a cell, a lease or a plan."""
        with self._lock:
            live = {w.worker_id for w in self._workers if w.state != "dead"}
            idle = not any(w.requests for w in self._workers)
            views = [(w.worker_id, w.state, w.snapshot) for w in self._workers]
        found = self.index.problems(live) if self.index else []
        if idle:
            found += [f"worker {i} is idle, yet {s.running} running, {s.waiting} waiting and "
                      f"{s.cells_used} cells used" for i, state, s in views
                      if state == "ready" and (s.running or s.waiting or s.cells_used)]
            if self.index and self.index.n_leases:
                found.append(f"nothing in flight, yet {self.index.n_leases} leases or plans")
        return found

    def tier_stats(self) -> TierStats:
        return dataclasses.replace(self.tier.stats) if self.tier else TierStats()

    def states(self) -> list[dict]:
        with self._lock:
            return [{"id": w.worker_id, "pid": w.process.pid, "state": w.state,
                     "restarts": w.restarts} for w in self._workers]

    def views(self) -> list[WorkerView]:
        with self._lock:
            return [WorkerView(w.worker_id, w.state, w.snapshot, dict(w.routed))
                    for w in self._workers]


@dataclass(frozen=True)
class WorkerView:
    worker_id: int
    state: str
    snapshot: EngineSnapshot
    routed: dict[str, int]
