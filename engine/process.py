"""An engine worker process: one llama.cpp context, fed requests by the gateway.

Started by the gateway (gateway/workers/supervisor.py) with one end of a connection. It loads
the model, reports its KV layout (`Ready`), attaches to the arena the gateway names (`Attach`),
then runs the engine thread while this process's main thread reads the connection. The outputs
of a step leave together, in one message, when the engine publishes its snapshot; the cache
index calls the engine thread makes wait for their replies, which the main thread hands over.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import numpy as np

from cache.arena import BlockArena
from engine.batching import Engine
from engine.config import EngineConfig
from engine.devices import PlacementError, place
from engine.llama import Model, allocated, backends, devices, model_shape, openmp_build
from engine.messages import (
    Attach,
    Cancel,
    Channel,
    CommitStore,
    EngineSnapshot,
    EngineUnavailable,
    IndexReply,
    Lease,
    MatchCall,
    Output,
    Outputs,
    PlanStoreCall,
    Published,
    Ready,
    ReleaseLease,
    Shutdown,
    StorePlan,
    Submit,
)

log = logging.getLogger(__name__)

# How long a worker waits for the gateway to answer an index call before giving up on the cache
# for that load or store (the gateway answers from a reader thread, in well under a second).
INDEX_CALL_TIMEOUT = 30.0
PUBLISH_EVERY = 0.1  # seconds between snapshots of a busy engine


def _worth_publishing(snapshot: EngineSnapshot,
                      last: tuple[float, EngineSnapshot] | None) -> bool:
    """A busy engine's cells and counters change every step; /metrics needs them a few times a
    second, while each message costs both processes CPU the decoding threads would use. Requests
    starting or ending, and every change once idle, go out at once: tests and operators read
    the idle state exactly."""
    if last is None:
        return True
    sent_at, sent = last
    if snapshot == sent:
        return False
    return (not snapshot.running or (snapshot.running, snapshot.waiting)
            != (sent.running, sent.waiting) or time.monotonic() - sent_at >= PUBLISH_EVERY)


@dataclass
class _Link:
    """The worker's end of the connection, and the index calls waiting on it for replies."""

    channel: Channel
    replies: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    call_ids: itertools.count = field(default_factory=itertools.count)

    def send(self, message) -> None:
        self.channel.send(message)

    def call(self, make) -> Lease | StorePlan:
        """Sends an index call and waits for its reply (queue.Empty after the timeout)."""
        call_id = next(self.call_ids)
        self.send(make(call_id))
        while True:
            reply: IndexReply = self.replies.get(timeout=INDEX_CALL_TIMEOUT)
            if reply.call_id == call_id:
                return reply.result
            self._give_back(reply.result)  # a late reply to a call that timed out

    def _give_back(self, result: Lease | StorePlan) -> None:
        if isinstance(result, Lease):
            self.send(ReleaseLease(result.lease_id))
        else:
            self.send(CommitStore(result.plan_id, written=False))


@dataclass(frozen=True)
class RemoteIndex:
    """The gateway's cache index, reached over the connection (see cache.index)."""

    link: _Link

    def match(self, tokens: np.ndarray, namespace: str) -> Lease:
        return self.link.call(lambda call_id: MatchCall(call_id, tokens, namespace))

    def release(self, lease_id: int) -> None:  # one way: nothing to wait for
        self.link.send(ReleaseLease(lease_id))

    def plan_store(self, tokens: np.ndarray, namespace: str, final: bool,
                   hold: bool) -> StorePlan:
        return self.link.call(lambda call_id: PlanStoreCall(call_id, tokens, namespace, final,
                                                            hold))

    def commit_store(self, plan_id: int, written: bool) -> None:
        self.link.send(CommitStore(plan_id, written))


def run(conn: Connection, worker_id: int, model_path: str, config: EngineConfig,
        log_level: str) -> None:
    """The worker process's entry point."""
    # Ctrl-C reaches the whole process group: the gateway stops its workers itself, after
    # draining, rather than have them die under requests in flight.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(),
                        format=f"%(asctime)s %(levelname)s worker-{worker_id} %(name)s: "
                               "%(message)s")
    link = _Link(Channel(conn))
    outbox: list[tuple[int, Output]] = []
    last_sent: list[tuple[float, EngineSnapshot]] = []

    def publish(snapshot: EngineSnapshot) -> None:  # on the engine thread, after every step
        if outbox:
            items = tuple(outbox)
            outbox.clear()
            link.send(Outputs(items))
        if _worth_publishing(snapshot, last_sent[0] if last_sent else None):
            last_sent[:] = [(time.monotonic(), snapshot)]
            link.send(Published(snapshot))

    if openmp_build():
        log.warning("llama.cpp was built with OpenMP: decoding from the engine thread runs ~3x "
                    "slower than from a main thread; rebuild llama-cpp-python with "
                    "CMAKE_ARGS=-DGGML_OPENMP=OFF")
    try:
        model = _load(model_path, config, worker_id)
    except PlacementError as exc:  # the flags name what is not there: nothing to serve
        log.error("%s", exc)
        raise SystemExit(2) from None
    engine = Engine(model, config, on_publish=publish)
    memory = allocated()
    log.info("memory llama.cpp allocated: %s", "; ".join(
        f"{m.buffer} {m.kind} {m.nbytes / 2**20:.1f} MiB" for m in memory))
    link.send(Ready(os.getpid(), engine.seq_len, engine.cells.n_cells, engine.kv_layout, memory))
    attach: Attach = conn.recv()
    arena = (BlockArena.attach(attach.arena_path, attach.fingerprint) if attach.arena_path
             else None)
    if arena is not None:
        engine.use_cache(arena, RemoteIndex(link))
    engine.start()
    failed = False
    try:
        _serve(engine, link, outbox)
    except Exception:
        log.exception("the worker failed")
        failed = True
    engine.stop()
    # Nothing touches llama.cpp any more: the process ends here, and the kernel frees the
    # model, its contexts and the arena's mapping at once (llama.cpp's own frees took 50-70 ms
    # of each unload of Gemma 3 270M, which the next model's load waited for).
    logging.shutdown()
    os._exit(1 if failed or engine.failure else 0)


def _load(model_path: str, config: EngineConfig, worker: int) -> Model:
    """The model, its layers on the devices the flags choose (engine/devices.py)."""
    found = devices()
    shape = config.context_shape()
    # The worker's contexts: the pool's cells, and a fresh prompt's own (prefill_context.py).
    cells = shape.n_ctx + (shape.n_ctx // config.parallel if config.prefill_context else 0)
    placement = place(config.offload, found,
                      lambda: model_shape(model_path, cells, shape.kv_type), worker)
    where = "every layer on the CPU" if not placement.on_device else \
        f"{placement.gpu_layers} layers on {', '.join(d.name for d in placement.devices)}" + \
        ("" if placement.kv_offload else ", their KV in host memory")
    log.info("llama.cpp backends: %s; devices: %s; %s (%s)", ", ".join(backends()),
             "; ".join(d.describe() for d in found), where, placement.why)
    return Model(model_path, placement=placement)


@dataclass
class _RemoteSink:
    """A request's outputs, queued in the worker's outbox until the step ends."""

    request_id: int
    outbox: list[tuple[int, Output]]
    live: dict[int, _RemoteSink]  # the worker's unfinished requests, for Cancel
    cancelled: bool = False

    def deliver(self, output: Output) -> None:  # on the engine thread
        self.outbox.append((self.request_id, output))
        if output.last:
            self.live.pop(self.request_id, None)


def _serve(engine: Engine, link: _Link, outbox: list[tuple[int, Output]]) -> None:
    live: dict[int, _RemoteSink] = {}
    while True:
        # Checked before every message, not only when none comes: under traffic a dead engine
        # would otherwise stay in service, refusing everything routed to it.
        if engine.failure:  # the engine thread died and answered everyone: restart us
            log.error("engine failed (%s); exiting for the gateway to restart this worker",
                      engine.failure)
            return
        if not link.channel.conn.poll(0.5):
            continue
        try:
            message = link.channel.recv()
        except (EOFError, OSError):  # the gateway is gone
            return
        if isinstance(message, Submit):
            sink = live[message.request_id] = _RemoteSink(message.request_id, outbox, live)
            try:
                engine.submit(message.request, sink, message.pool_hint)
            except EngineUnavailable as exc:
                live.pop(message.request_id, None)
                link.send(Outputs(((message.request_id,
                                    Output(error=str(exc), unavailable=True)),)))
        elif isinstance(message, Cancel):
            sink = live.pop(message.request_id, None)
            if sink is not None:
                sink.cancelled = True
                engine.wake()
        elif isinstance(message, IndexReply):
            link.replies.put(message)
        elif isinstance(message, Shutdown):
            return
