"""The supervisor of the engine worker processes: starting them, routing requests to them,
reading what they send, and replacing one that dies. The shared pool's side of their index
calls is gateway/workers/shared_pool.py; the asyncio side of a request, gateway/workers/handles.py.

Each worker gets a `multiprocessing` connection (a Unix socket pair: message framing and pickling
of plain dataclasses from the standard library, no broker; see docs/architecture.md, "Workers"). A
reader thread per worker takes its messages: outputs go to the requests' asyncio queues, index
calls are answered right there under the index's lock (never waiting for the event loop), and end
of file means the worker died: its requests get a 503, everything it held in the pool is released,
and a replacement starts.

Workers are forked from multiprocessing's fork server, which imports the worker's modules
(llama-cpp-python, numpy) once, before any model: a worker then runs llama.cpp ~6 ms after it is
started, where a spawned interpreter took 0.3-0.4 s of a core at every start (every model load
and every restart). The gateway itself is never forked: it is threaded.
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
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from cache.arena import remove_stale_arenas
from cache.tokens import common_prefix
from engine import process as worker_process
from engine.messages import (
    Attach,
    Cancel,
    Channel,
    EngineSnapshot,
    EngineUnavailable,
    GenerationRequest,
    MemoryBuffer,
    Output,
    Outputs,
    Published,
    Ready,
    Shutdown,
    Submit,
)
from gateway.config import WorkersConfig
from gateway.workers.affinity import CacheKeyAffinity
from gateway.workers.handles import GenerationHandle, deliver_soon
from gateway.workers.router import Router, WorkerLoad
from gateway.workers.shared_pool import INDEX_CALLS, SharedPool, TierHits

if TYPE_CHECKING:
    from gateway.formats.prompts import Pin

log = logging.getLogger(__name__)

RESTART_DELAY = 1.0  # seconds before a dead worker's replacement starts


class Overloaded(RuntimeError):
    """Every sequence is busy and the waiting queue is full."""


@dataclass
class _InFlight:
    handle: GenerationHandle
    prompt: np.ndarray
    namespace: str


@dataclass
class WorkerProcess:
    worker_id: int
    process: multiprocessing.process.BaseProcess
    channel: Channel
    state: str = "starting"  # starting | ready | dead
    snapshot: EngineSnapshot = EngineSnapshot()
    requests: dict[int, _InFlight] = field(default_factory=dict)
    routed: Counter = field(default_factory=Counter)  # routing decisions by reason
    restarts: int = 0
    memory: tuple[MemoryBuffer, ...] = ()  # what llama.cpp allocated for it, from its Ready
    # Set by its reader thread once the process is reaped. Only that thread joins it: two
    # threads waiting on one child race, and the loser saw a reaped worker as alive.
    exited: threading.Event = field(default_factory=threading.Event)
    last_heard: float = field(default_factory=time.monotonic)  # its last message, or since busy

    def send(self, message) -> None:
        """From the event loop or a reader thread; a dead worker's reader handles the fallout."""
        with contextlib.suppress(OSError):
            self.channel.send(message)


def worker_context() -> multiprocessing.context.ForkServerContext:
    """Where worker processes come from (the module's docstring). The fork server starts with
    the first worker and exits with the gateway."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([worker_process.__name__])
    return context


class Workers:
    def __init__(self, config: WorkersConfig) -> None:
        self.config = config
        self.pool: SharedPool | None = None  # None: the prefix cache is off
        self.affinity = CacheKeyAffinity()
        self.router = Router(config.routing, config.engine.cache.block_size)
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
        self._mp = worker_context()
        self._prepared: Future[SharedPool | None] | None = None  # the snapshot's, being read

    # ----- lifecycle ----------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop, timeout: float = 300) -> None:
        """Starts every worker and waits until one serves (or all failed)."""
        self._loop = loop
        for path in remove_stale_arenas():
            log.info("removed %s, the arena of a gateway that no longer runs", path)
        self._prepared = self._prepare_pool()
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
        engine = self.config.engine
        log.info("%d worker(s), each %d parallel sequences in %d KV cells (%s), requests of up "
                 "to %d tokens", self.config.n_workers, engine.parallel, engine.ctx_size,
                 "deterministic" if engine.deterministic else "unified", self.seq_len)
        if self.config.step_timeout:
            threading.Thread(target=self._watch, name="worker-watchdog", daemon=True).start()

    def _prepare_pool(self) -> Future[SharedPool | None] | None:
        """The --cache-dir snapshot's pool, read on a thread of its own while the workers load
        the model (`_pool_for` takes it)."""
        config = self.config
        if not (config.engine.cache.enabled and config.cache_dir):
            return None
        prepared: Future[SharedPool | None] = Future()

        def read() -> None:
            try:
                prepared.set_result(SharedPool.from_snapshot(config))
            except Exception:  # read again, and its failure told, once a worker is ready
                log.exception("making the pool from the --cache-dir snapshot failed")
                prepared.set_result(None)

        threading.Thread(target=read, name="pool-from-snapshot", daemon=True).start()
        return prepared

    def _watch(self) -> None:
        """Kills a worker that has requests in flight and has said nothing for step_timeout:
        its reader then sees it exit, its requests get a 503 and a replacement starts."""
        timeout = self.config.step_timeout
        while not self._stopping:
            time.sleep(min(1.0, timeout / 4))
            now = time.monotonic()
            with self._lock:
                stuck = [w for w in self._workers if w.state == "ready" and w.requests
                         and now - w.last_heard > timeout]
            for worker in stuck:
                log.error("worker %d sent nothing for %.0f s with %d requests in flight "
                          "(stuck?); killing it for a replacement", worker.worker_id, timeout,
                          len(worker.requests))
                worker.process.kill()

    def _spawn(self, worker_id: int, restarts: int = 0) -> WorkerProcess:
        args = (worker_id, self.config.model_path, self.config.engine, self.config.log_level)
        ours, theirs = self._mp.Pipe(duplex=True)
        process = self._mp.Process(target=worker_process.run,
                                   name=f"prefixgate-worker-{worker_id}", daemon=True,
                                   args=(theirs, *args))
        process.start()
        theirs.close()
        worker = WorkerProcess(worker_id, process, Channel(ours), restarts=restarts)
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

    def stop(self, timeout: float = 30, close_pool: bool = True) -> SharedPool | None:
        """Stops every worker (what is still in flight gets a 503) and removes the arena
        (writing its --cache-dir snapshot first); with `close_pool` False, returns the pool
        for the caller to close, nothing writing it any more."""
        self._draining = self._stopping = True
        for worker in self._workers:
            worker.send(Shutdown())
        for worker in self._workers:
            if not worker.exited.wait(timeout):
                log.error("worker %d did not stop in %.0f s; killing it", worker.worker_id,
                          timeout)
                worker.process.kill()
                worker.exited.wait(5)
        with self._lock:
            pool, self.pool = self.pool, None
            prepared, self._prepared = self._prepared, None
        if prepared is not None and (unused := prepared.result()) is not None:
            unused.close(save=False)  # no worker became ready: the snapshot stays as it was
        if pool is not None and close_pool:  # the workers are gone: nothing writes the arena
            pool.close()
            return None
        return pool

    # ----- requests -----------------------------------------------------------------------------

    @property
    def n_in_flight(self) -> int:
        with self._lock:
            return sum(len(w.requests) for w in self._workers)

    def submit_group(self, requests: list[GenerationRequest], cache_key: str | None = None,
                     pool_cached: int | None = None, pins: tuple[Pin, ...] = ()
                     ) -> list[GenerationHandle]:
        """Requests on one prompt (a request's n choices), routed together to one worker, so
        that the prompt is computed once and its cells shared. Requests with the same
        `cache_key` go to the same worker while the imbalance guard allows. `pool_cached`:
        the prompt's tokens in the pool, when the caller read it off the event loop (reading
        it here takes the cache index's lock). `pins` are none of this supervisor's business:
        its pool is pinned by the caller, and without a pool nothing is (core/engines.py)."""
        if self._draining:
            raise EngineUnavailable("the server is shutting down")
        request = requests[0]
        prompt = np.asarray(request.prompt_tokens, dtype=np.int32)
        namespace = request.namespace
        if pool_cached is None:
            pool_cached = self.pool.cached_length(request) if self.pool else 0
        with self._lock:
            ready = [w for w in self._workers if w.state == "ready"]
            if not ready:
                raise EngineUnavailable("no engine worker is ready")
            in_flight = sum(len(w.requests) for w in self._workers)
            capacity = len(ready) * self.config.engine.parallel + self.config.max_queue
            if in_flight + len(requests) > capacity:
                raise Overloaded(f"{in_flight} requests in flight, room for {capacity}")
            loads = [WorkerLoad(w.worker_id, [r.prompt for r in w.requests.values()],
                                [r.prompt for r in w.requests.values()
                                 if r.namespace == namespace]) for w in ready]
            chosen, reason = self.router.choose(prompt, loads, pool_cached)
            if cache_key is not None:
                owner_id = self.affinity.owner(namespace, cache_key)
                owner = next((w for w in loads if w.worker_id == owner_id), None)
                if owner is not None and reason != "balance" and len(loads) > 1:
                    chosen, reason = owner, "cache_key"
                self.affinity.record(namespace, cache_key, chosen.worker_id)
            worker = next(w for w in ready if w.worker_id == chosen.worker_id)
            if not worker.requests:  # idle until now: silence so far meant nothing
                worker.last_heard = time.monotonic()
            ids, handles = [next(self._ids) for _ in requests], []
            for request_id in ids:
                handles.append(GenerationHandle(
                    self._loop, on_cancel=functools.partial(self._cancel, worker, request_id)))
                worker.requests[request_id] = _InFlight(handles[-1], prompt, namespace)
            worker.routed[reason] += 1
        for request_id, each in zip(ids, requests, strict=True):
            worker.send(Submit(request_id, each, pool_cached))
        return handles

    def prompts_in_flight(self) -> list[tuple[str, np.ndarray]]:
        """The namespace and prompt of every request in flight: what a request of the same
        namespace beside it shares cells of."""
        with self._lock:
            return [(r.namespace, r.prompt) for w in self._workers for r in w.requests.values()]

    def live_match(self, prompt: np.ndarray, namespace: str) -> tuple[int, np.ndarray | None]:
        """The longest prefix of `prompt` a request in flight of the namespace holds or
        computes (its cells are shared with a request that runs beside it), and that request's
        prompt."""
        shareable = [held for space, held in self.prompts_in_flight() if space == namespace]
        return max(((common_prefix(other, prompt), other) for other in shareable),
                   key=lambda match: match[0], default=(0, None))

    def _cancel(self, worker: WorkerProcess, request_id: int) -> None:
        """The client went away: the worker drops the sequence without another output."""
        with self._lock:
            worker.requests.pop(request_id, None)
        worker.send(Cancel(request_id))

    # ----- one reader thread per worker ---------------------------------------------------------

    def _read(self, worker: WorkerProcess) -> None:
        while True:
            try:
                message = worker.channel.recv()
                worker.last_heard = time.monotonic()
            except (EOFError, OSError):
                break
            except Exception:  # a stream it cannot read: nobody would hear the worker again
                log.exception("reading from worker %d failed; stopping it for a replacement",
                              worker.worker_id)
                worker.process.kill()
                break
            try:
                self._dispatch(worker, message)
            except Exception:  # a bad message must not stop the reader: its worker would hang
                log.exception("handling %s from worker %d failed", type(message).__name__,
                              worker.worker_id)
        self._on_exit(worker)

    def _dispatch(self, worker: WorkerProcess, message) -> None:
        if isinstance(message, Outputs):
            delivered = []
            with self._lock:
                for request_id, output in message.items:
                    in_flight = (worker.requests.pop(request_id, None) if output.last
                                 else worker.requests.get(request_id))
                    if in_flight is not None:
                        delivered.append((in_flight.handle, output))
            deliver_soon(self._loop, delivered)
        elif isinstance(message, Published):
            worker.snapshot = message.snapshot
        elif isinstance(message, INDEX_CALLS):
            self.pool.answer(worker.worker_id, message, worker.send)
        elif isinstance(message, Ready):
            self._on_ready(worker, message)

    def _on_ready(self, worker: WorkerProcess, ready: Ready) -> None:
        """The worker has its context: the first one with a KV layout sets up the pool, and
        each is told where the pool is before it may serve."""
        try:
            pool = self._pool_for(ready)
        except Exception as exc:  # e.g. --shared-memory names a live gateway's arena
            log.exception("creating the block arena failed")
            self.failure = f"creating the block arena failed: {exc}"
            worker.send(Shutdown())
            self._any_ready.set()
            return
        with self._lock:
            self.seq_len = ready.seq_len
            worker.snapshot = EngineSnapshot(cells_total=ready.cells_total)
            worker.memory = ready.memory
        worker.send(Attach(str(pool.arena.path), pool.fingerprint) if pool and ready.layout
                    else Attach(None))
        with self._lock:
            worker.state = "ready"
        self._any_ready.set()
        log.info("engine worker %d (pid %d) ready: %d KV cells", worker.worker_id, ready.pid,
                 ready.cells_total)

    def _pool_for(self, ready: Ready) -> SharedPool | None:
        """The pool, made for the first worker with a KV layout: the --cache-dir snapshot's,
        read meanwhile, if its blocks were made for that layout, else a new one."""
        prepared = self._prepared
        # Outside the lock (a /metrics scrape takes it): the snapshot may still be read.
        ahead = prepared.result() if prepared is not None and ready.layout else None
        with self._lock:
            if ready.layout is not None and self.pool is None:
                if ahead is not None and ahead.fits(ready.layout):
                    self.pool = ahead
                else:
                    if ahead is not None:
                        ahead.close(save=False)
                    self.pool = SharedPool.for_layout(self.config, ready.layout)
                self._prepared = None
            return self.pool

    def _on_exit(self, worker: WorkerProcess) -> None:
        worker.process.join(10)
        worker.exited.set()
        with self._lock:
            worker.state = "dead"
            orphans = list(worker.requests.values())
            worker.requests.clear()
            # Its counters stay (a replacement's start again from zero); it holds nothing now.
            worker.snapshot = dataclasses.replace(worker.snapshot, running=0, waiting=0,
                                                  cells_used=0)
        if self.pool is not None:
            self.pool.index.release_owner(worker.worker_id)
        reason = f"engine worker {worker.worker_id} exited (status {worker.process.exitcode})"
        failed = Output(error=reason, unavailable=True)
        deliver_soon(self._loop, [(in_flight.handle, failed) for in_flight in orphans])
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
        index = self.pool.index if self.pool else None
        found = index.problems(live) if index else []
        if idle:
            found += [f"worker {i} is idle, yet {s.running} running, {s.waiting} waiting and "
                      f"{s.cells_used} cells used" for i, state, s in views
                      if state == "ready" and (s.running or s.waiting or s.cells_used)]
            if index and index.n_leases:
                found.append(f"nothing in flight, yet {index.n_leases} leases or plans")
        return found

    def tier_hits(self) -> TierHits:
        stats = [v.snapshot.cache for v in self.views() if v.snapshot.cache]
        queried, hits = (sum(s.queried_tokens for s in stats), sum(s.hit_tokens for s in stats))
        return self.pool.tier_hits(queried, hits) if self.pool else TierHits(queried, {})

    def states(self) -> list[dict]:
        with self._lock:
            return [{"id": w.worker_id, "pid": w.process.pid, "state": w.state,
                     "restarts": w.restarts} for w in self._workers]

    def views(self) -> list[WorkerView]:
        """Its workers as they last published themselves; none once it is stopped: an
        unloaded model has no workers, not workers that are down."""
        with self._lock:
            if self._stopping:
                return []
            return [WorkerView(w.worker_id, w.state, w.snapshot, dict(w.routed), w.restarts,
                               w.memory) for w in self._workers]


@dataclass(frozen=True)
class WorkerView:
    worker_id: int
    state: str
    snapshot: EngineSnapshot
    routed: dict[str, int]
    restarts: int  # times this worker id was replaced
    memory: tuple[MemoryBuffer, ...]
