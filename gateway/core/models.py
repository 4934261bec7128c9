"""The models a gateway serves, each by its name, and which of them are loaded.

A model's vocabulary (prompts are rendered and tokenized in the HTTP process) is read at start
for every model: it is small, and counting tokens or rendering a template never waits for
weights. Its engines (the worker processes that hold its weights, its contexts and its own block
pool) are loaded on first use and unloaded when idle or to make room, as llama-server's router
and Ollama do:

- `--models-max` models loaded at once at most, and their estimated memory (weights, each
  worker's KV cells, their part of the pool) within `--models-memory-mb`: loading one past
  either unloads the least recently used model that no request holds; while every loaded model
  is in use, the load waits for one to come free.
- Swaps are batched by model, as llama-server's router and Ollama do, with two bounds of ours.
  A model whose last request just ended is held a moment before it is unloaded for another: a
  session's next turn arrives moments after its answer, and without the hold it would find its
  model gone and swap it back. How long: the gaps it has seen between its requests ending and
  its next arriving tell (`HOLD_FACTOR` times their median, at least `HOLD_FLOOR`; gaps past
  the bound are a client gone, not a next turn, and gaps in which a later request for another
  model ran are a client alternating between models), within `--models-swap-grace`. So an
  agent between tool calls keeps its model for seconds, and a client that moved on to another
  model waits `HOLD_FLOOR`. And a swap waits until its request has waited `HOLD_FLOOR`, so
  that requests arriving together for two models (sessions starting at once) are not split
  by whichever came a millisecond first: the loaded model's are served on it.
  Requests for a loaded model keep being admitted while another model's wait; but once a
  request has waited `--models-swap-wait` for its model, it takes the room even from a busy
  one (which drains, its new requests waiting in turn), so no model starves behind a busy one.
  Several models waiting for the room: the one whose request passed that bound first, else the
  one with the most requests waiting, else the one waited for longest, loads first.
- `--idle-unload-seconds`: a model no request has used for that long is unloaded.
- A model is never unloaded under a request: a request holds its model from the moment it is
  admitted to its last output (`Models.serving`); an unload lets those finish (up to
  `--drain-seconds`) before it stops the workers. Requests that arrive meanwhile wait for the
  model to load again.
- A request for a model that is not loaded waits for it (up to the request timeout, a 504, as
  any wait; more than --max-queue waiting, a 429); one that failed to load is a 503 naming the
  model and the cause (POST /models/load tries again), and the other models serve on.

State changes happen on the event loop; the blocking parts (starting and stopping workers) run
on threads."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from cache.fingerprint import gguf_fingerprint
from engine.llama import Model, model_shape
from gateway.config import ModelConfig
from gateway.core.engines import Engines
from gateway.edge.errors import APIError
from gateway.formats.prompts import PromptBuilder
from gateway.workers.shared_pool import SharedPool
from gateway.workers.supervisor import Overloaded, Workers

log = logging.getLogger(__name__)

IDLE_CHECK_SECONDS = 1.0
HOLD_FACTOR = 4.0  # a just-used model is held this many times its requests' usual gap
HOLD_FLOOR = 0.05  # seconds: at least this (requests arriving together, a client's next turn)
GAPS_KEPT = 8


@dataclass(frozen=True)
class LoadPolicy:
    max_loaded: int | None = None  # models loaded at once; None: no bound
    memory_bytes: int | None = None  # their estimated memory together; None: no bound
    idle_seconds: float | None = None  # unloaded after this long unused; None: never
    drain_seconds: float = 30.0  # how long an unload lets the requests in flight finish
    max_waiting: int = 128  # requests waiting for one model to load
    swap_grace: float = 2.0  # the longest a just-used model is held from another's requests
    swap_wait: float = 30.0  # a request waiting this long takes the room even from a busy model


class ServedModel:
    def __init__(self, config: ModelConfig, engines: Engines | None = None) -> None:
        """`engines`: who runs its requests (a Dynamo front's nodes, always there); engine
        workers of its own, started at each load, by default."""
        self.config = config
        self.name = config.name
        self.vocab: Model | None = None  # vocabulary only: the weights live in the workers
        self.prompts: PromptBuilder | None = None
        self._own_engines = engines is None
        self.engines: Engines = engines or Workers(config.workers)
        self._saving: threading.Thread | None = None  # its pool closing after an unload
        self.fingerprint = ""  # its GGUF's: what its token ids mean
        self.memory_bytes = 0  # estimated, loaded: weights, its workers' KV, its pool
        self.state = "unloaded"  # loading | loaded | unloading | failed
        self.load_error: str | None = None
        self.in_use = 0  # requests holding it
        self.waiting = 0  # requests waiting for it to load
        self.last_used = 0.0  # monotonic
        self.loads = self.unloads = 0
        self.load_seconds = 0.0  # all its loads' together

    @property
    def ready(self) -> bool:
        return self.state == "loaded"

    def open(self) -> None:
        """Blocking: its vocabulary, template and fingerprint, and what loading it will take."""
        path, engine = self.config.workers.model_path, self.config.workers.engine
        self.vocab = Model(path, vocab_only=True)
        self.prompts = PromptBuilder(self.vocab, self.config.chat_template)
        self.fingerprint = gguf_fingerprint(path)
        shape = model_shape(path, engine.ctx_size, engine.kv_type or "f16")
        kv = shape.n_layer * shape.kv_bytes_per_layer * self.config.workers.n_workers
        pool = engine.cache.budget_mb << 20 if engine.cache.enabled else 0
        self.memory_bytes = shape.weight_bytes + kv + pool

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Blocking: its engines, until they serve (or raise why not)."""
        if self.vocab is None:  # it could not be read at start
            self.open()
        if self._own_engines:  # a stopped supervisor does not start again: a new one
            self._saved()  # its last unload's snapshot, read by this load
            self.engines = Workers(self.config.workers)
        self.engines.start(loop)
        self.loads += 1

    def summary(self, cache_mb: int) -> str:
        """What the start-up log says of it: its id, file, state, aliases, workers and share
        of the pools' `cache_mb` together."""
        workers, cache = self.config.workers, self.config.workers.engine.cache
        state = {"loaded": "loaded", "unloaded": "not loaded (loads on first use)",
                 "failed": f"failed to load ({self.load_error})"}.get(self.state, self.state)
        aliases = "aliases " + ", ".join(self.config.aliases) if self.config.aliases \
            else "no aliases"
        pool = f"cache {cache.budget_mb} MiB ({cache.budget_mb / cache_mb:.0%} of {cache_mb} MiB)" \
            if cache.enabled and cache_mb else "no prefix cache"
        return (f"model {self.name!r}: {workers.model_path}, {state}, {aliases}, "
                f"{workers.n_workers} worker(s), {pool}")

    def require_pool(self) -> SharedPool:
        """Its block pool, for the cache's operator APIs (explain, admin)."""
        if self.engines.pool is None:
            raise APIError(404, "This server holds no prefix cache of its own here: it runs "
                           "with --no-prefix-cache, or is a front whose cache is on its Dynamo "
                           "nodes (ask a node), or the model is not loaded now",
                           code="cache_disabled")
        return self.engines.pool

    def stop(self) -> None:
        """Blocking: stops its engines. Its pool is closed (its --cache-dir snapshot written)
        on a thread of its own: another model's load need not wait for that, only its own
        next load does."""
        if not isinstance(self.engines, Workers):
            self.engines.stop()
            return
        pool = self.engines.stop(close_pool=False)
        if pool is not None:
            self._saving = threading.Thread(target=pool.close, name=f"close-pool-{self.name}")
            self._saving.start()

    def _saved(self) -> None:
        if self._saving is not None:
            self._saving.join()
            self._saving = None

    def close(self) -> None:
        if self.state in ("loaded", "unloading"):
            self.engines.stop()
        self._saved()
        if self.vocab is not None:
            self.vocab.close()


class Models:
    """Every served model, and the loading and unloading of their engines (the module's
    docstring has the rules)."""

    # The clock of requests' arrivals and ends, and of the bounds on them. Only the tests put
    # their own here (tests/test_model_policy.py), which they move themselves.
    clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, models: list[ServedModel], policy: LoadPolicy) -> None:
        self.all = models
        self.policy = policy
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed = asyncio.Event()  # replaced at each change: waiters wake and look again
        self._deciding = asyncio.Lock()  # one load's room made at a time
        self._loads: dict[str, asyncio.Task] = {}
        self._waits: dict[str, list[float]] = {}  # per model, when its waiting requests came
        self._gaps: dict[str, deque[float]] = {}  # per model, from a request's end to the next
        self._ended: dict[str, float] = {}  # per model, when its last request ended
        self._admitted: dict[str, float] = {}  # per model, when its last admitted one came
        self._opened = threading.Event()
        self._stopping = False  # draining: nothing loads any more

    def find(self, name: str) -> ServedModel:
        """The model a request names (`named`); a 503 for one that failed to load."""
        model = self.named(name)
        if model.state == "failed":
            raise _failed(model)
        return model

    def named(self, name: str) -> ServedModel:
        """The model `name` names: by its name, else by its closest alias (the first model on
        a tie); a 404 for one not served, a 503 while the gateway starts."""
        if not self._opened.is_set():
            raise APIError(503, "The model is still loading; retry shortly", code="model_loading")
        closeness = [m.config.answers_to(name) for m in self.all]
        model = self.all[closeness.index(max(closeness))] if any(closeness) else None
        if model is None:
            raise APIError(404, f"The model `{name}` does not exist", "model", "model_not_found")
        return model

    # ----- start and stop -------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> list[str]:
        """On a thread, at start: every vocabulary, then the engines of the models that fit, in
        order (none unloaded for another). Returns why each that should have loaded failed."""
        self._loop = loop
        failures = []
        try:
            for model in self.all:
                try:
                    model.open()
                except Exception as exc:  # not a GGUF, say: that model only
                    log.error("reading the model %r (%s) failed: %s", model.name,
                              model.config.workers.model_path, exc)
                    model.state, model.load_error = "failed", str(exc)
                    failures.append(f"{model.name}: {exc}")
            for model in self.all:
                if model.state == "unloaded" and self._fits(model, self._loaded()) \
                        and not self._stopping:
                    model.state = "loading"
                    self._start(model, loop)
                    if model.load_error:
                        failures.append(f"{model.name}: {model.load_error}")
        finally:  # requests are routed from now on (those before were told to retry)
            self._opened.set()
        return failures

    def _start(self, model: ServedModel, loop: asyncio.AbstractEventLoop) -> None:
        """Blocking: loads its engines; its state says how it went."""
        started = time.monotonic()
        try:
            model.start(loop)
        except Exception as exc:
            log.exception("loading the model %r (%s) failed", model.name,
                          model.config.workers.model_path)
            model.engines.stop()  # whatever of it had started
            model.state, model.load_error = "failed", str(exc)
        else:
            model.state, model.load_error, model.last_used = "loaded", None, self.clock()
            model.load_seconds += time.monotonic() - started
            log.info("loaded %r (%s) in %.1f s; %d model(s) loaded", model.name,
                     model.config.workers.model_path, time.monotonic() - started,
                     len(self._loaded()))

    def close(self) -> None:
        for model in self.all:
            model.close()

    def n_in_flight(self) -> int:
        return sum(model.engines.n_in_flight for model in self._loaded())

    async def drain(self, seconds: float) -> None:
        """Refuses new requests and waits up to `seconds` for those in flight. Every model's
        engines hear it, also those still starting (a front waiting for its first node stops
        waiting), and no model loads from now on."""
        self._stopping = True
        await asyncio.gather(*(model.engines.drain(seconds) for model in self.all))

    # ----- requests -------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def serving(self, model: ServedModel, timeout: float | None
                      ) -> AsyncIterator[ServedModel]:
        """Holds `model` loaded for a request's lifetime, loading it first if it is not;
        `timeout`: how long the request may wait for that."""
        came = self.clock()
        if self._next_turn(model, came):  # the holds learn its gaps
            gap = came - self._ended[model.name]
            self._gaps.setdefault(model.name, deque(maxlen=GAPS_KEPT)).append(gap)
        if model.state != "loaded":
            if model.waiting >= self.policy.max_waiting:
                raise Overloaded(f"{model.waiting} requests wait for the model `{model.name}` "
                                 "to load")
            model.waiting += 1
            waits = self._waits.setdefault(model.name, [])
            waits.append(came)
            try:
                await asyncio.wait_for(self._until_loaded(model), timeout)
            except TimeoutError:
                raise APIError(504, f"The model `{model.name}` did not load within "
                               f"{timeout:.0f} s", code="timeout") from None
            finally:
                model.waiting -= 1
                waits.remove(came)
        model.in_use += 1
        model.last_used = self.clock()
        self._admitted[model.name] = came
        try:
            yield model
        finally:
            model.in_use -= 1
            model.last_used = self._ended[model.name] = self.clock()
            self._notify()

    async def ensure_loaded(self, model: ServedModel) -> None:
        """Loads it if it is not (one that failed is tried again); a 503 if it cannot."""
        if model.state == "failed":
            model.state = "unloaded"
        await self._until_loaded(model)

    async def _until_loaded(self, model: ServedModel) -> None:
        while model.state != "loaded":
            if model.state == "failed":
                raise _failed(model)
            if model.state == "unloaded":
                self.load_soon(model)
            await self._change()

    # ----- loading and unloading ------------------------------------------------------------------

    def load_soon(self, model: ServedModel) -> asyncio.Task:
        """Its load, begun once however many ask."""
        task = self._loads.get(model.name)
        if task is None or task.done():
            task = self._loads[model.name] = asyncio.create_task(self.load(model))
        return task

    async def load(self, model: ServedModel) -> None:
        """Makes room for it when its turn comes (`_next_to_load`, `_victim`), then loads it;
        a failure is kept in its state."""
        if model.state in ("loaded", "loading"):
            return
        if model.memory_bytes > (self.policy.memory_bytes or model.memory_bytes):
            model.state = "failed"
            model.load_error = (f"it needs about {model.memory_bytes >> 20} MiB, past "
                                f"--models-memory-mb {self.policy.memory_bytes >> 20}")
            self._notify()
            return
        while not await self._make_room(model):
            # a request ends, a model unloads, or a bound passes
            await self._change(timeout=self._wake_in(model))
        if model.state != "loading":  # loaded by another caller meanwhile, or refused
            return
        try:
            await asyncio.to_thread(self._start, model, self._loop)
        finally:  # whatever happened, its waiters look again (a cancelled load: failed)
            if model.state == "loading":
                model.state, model.load_error = "failed", "its load was interrupted"
            self._notify()

    async def _make_room(self, model: ServedModel) -> bool:
        """True once `model` is `loading` (its room made: idle models unloaded for it) or
        need not load; False while it must wait for its turn or for a model to come free."""
        async with self._deciding:  # one model's room made at a time
            while True:
                if model.state != "unloaded":
                    return True
                if self._stopping:
                    model.state, model.load_error = "failed", "the server is shutting down"
                    self._notify()
                    return True
                first = self._next_to_load(model)
                if self._fits(model, self._loaded()) and (
                        first is model or not self._fits(first, self._loaded())):
                    model.state, model.load_error = "loading", None
                    self._notify()
                    return True
                victim = self._victim(model) if first is model else None
                if victim is None:
                    return False
                log.info("unloading %r to make room for %r", victim.name, model.name)
                await self._unload(victim)

    async def unload(self, model: ServedModel) -> None:
        """Lets the requests holding it finish (up to the drain time), then stops its
        workers; requests arriving meanwhile wait for it to load again."""
        async with self._deciding:
            await self._unload(model)

    async def _unload(self, model: ServedModel) -> None:
        if model.state != "loaded" or not model._own_engines:
            return
        model.state = "unloading"
        self._notify()
        deadline = time.monotonic() + self.policy.drain_seconds
        while model.in_use and time.monotonic() < deadline:
            await self._change(timeout=deadline - time.monotonic())
        await asyncio.to_thread(model.stop)
        model.state = "unloaded"
        model.unloads += 1
        log.info("unloaded %r", model.name)
        self._notify()

    async def unload_idle(self) -> None:
        """Runs for the server's lifetime: unloads what has been idle too long."""
        idle = self.policy.idle_seconds
        while idle:
            await asyncio.sleep(min(IDLE_CHECK_SECONDS, idle))
            now = self.clock()
            for model in self._loaded():
                if not model.in_use and not model.waiting and now - model.last_used > idle:
                    log.info("%r was idle for %.0f s", model.name, now - model.last_used)
                    await self.unload(model)

    # ----- what fits ------------------------------------------------------------------------------

    def _loaded(self) -> list[ServedModel]:
        return [m for m in self.all if m.state in ("loading", "loaded", "unloading")]

    def _fits(self, model: ServedModel, loaded: list[ServedModel]) -> bool:
        others = [m for m in loaded if m is not model]
        policy = self.policy
        return (policy.max_loaded is None or len(others) < policy.max_loaded) and (
            policy.memory_bytes is None
            or sum(m.memory_bytes for m in others) + model.memory_bytes <= policy.memory_bytes)

    def _waited(self, model: ServedModel, now: float) -> float:
        """How long its longest waiting request has waited."""
        return now - min(self._waits.get(model.name) or [now])

    def _next_to_load(self, model: ServedModel) -> ServedModel:
        """Of the models waited for that are not loaded (and `model`), the one whose turn it
        is: a request past --models-swap-wait first (the longest waiting), else the most
        requests waiting, else the longest waiting."""
        now = self.clock()
        bound = self.policy.swap_wait

        def turn(m: ServedModel) -> tuple:
            waited = self._waited(m, now)
            if waited >= bound:
                return (0, -waited, 0.0)
            return (1, -len(self._waits.get(m.name) or ()), -waited)

        pending = [m for m in self.all if m is model
                   or (m.state == "unloaded" and self._waits.get(m.name))]
        return min(pending, key=turn)

    def _next_turn(self, model: ServedModel, came: float) -> bool:
        """Whether a request arriving at `came` is a next turn the hold would catch: it comes
        within --models-swap-grace of the model's last request's end, with none running, and
        no request for another model that came after that end ran meanwhile (a client
        alternating between two models comes back after the other's answer: holding the first
        for that would only delay the second)."""
        ended = self._ended.get(model.name)
        return ended is not None and not model.in_use and \
            came - ended <= self.policy.swap_grace and \
            not any(self._admitted.get(m.name, ended) > ended for m in self.all if m is not model)

    def _hold(self, model: ServedModel) -> float:
        """How long `model` is held after its last request (the module's docstring)."""
        gaps = self._gaps.get(model.name)
        usual = HOLD_FACTOR * statistics.median(gaps) if gaps else 0.0
        return min(self.policy.swap_grace, max(HOLD_FLOOR, usual))

    def _victim(self, model: ServedModel) -> ServedModel | None:
        """The model to unload to make room for `model`: the least recently used one no
        request holds or waits for, unused for its hold (`_hold`); once `model`'s requests
        have waited --models-swap-wait, the least recently used loaded one, busy or not (its
        requests finish first, up to --drain-seconds). None: wait."""
        # A model requests wait for is theirs as soon as it loads: never taken from them
        # before they run (two models would take turns evicting each other, serving none).
        now = self.clock()
        loaded = [m for m in self.all if m.state == "loaded" and m is not model
                  and m._own_engines and not m.waiting]
        idle = [m for m in loaded if not m.in_use and now - m.last_used >= self._hold(m)]
        if self._waits.get(model.name) and self._waited(model, now) < HOLD_FLOOR:
            idle = []  # requests arriving with it may be for a loaded model: let them come
        if not idle and self._waited(model, now) >= self.policy.swap_wait:
            idle = loaded
        return min(idle, key=lambda m: (m.in_use > 0, m.last_used), default=None)

    def _wake_in(self, model: ServedModel) -> float | None:
        """When a bound `_victim` applies next passes: a hold ends, or `model`'s wait
        reaches --models-swap-wait (None: only a change can make room)."""
        now = self.clock()
        ends = [m.last_used + self._hold(m) - now for m in self.all
                if m.state == "loaded" and not m.in_use and not m.waiting]
        if self._waits.get(model.name):
            waited = self._waited(model, now)
            ends += [HOLD_FLOOR - waited, self.policy.swap_wait - waited]
        ends = [end for end in ends if end > 0]
        return min(ends) + 0.001 if ends else None

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _change(self, timeout: float | None = None) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)


def _failed(model: ServedModel) -> APIError:
    return APIError(503, f"The model `{model.name}` failed to load: {model.load_error}", "model",
                    "model_unavailable")
