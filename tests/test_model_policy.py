"""Which models gateway/core/models.py `Models` keeps loaded, on fake models (their engines
start and stop at once): the real loads are tests/test_model_loading.py's."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Coroutine
from types import SimpleNamespace

import pytest

from gateway.config import ModelConfig
from gateway.core.models import HOLD_FLOOR, LoadPolicy, Models
from gateway.edge.errors import APIError
from gateway.workers.supervisor import Overloaded


def run(test):
    """An async test, run on its own event loop."""
    @functools.wraps(test)
    def sync() -> None:
        asyncio.run(test())
    return sync


class FakeEngines:
    n_in_flight = 0

    def stop(self) -> None:
        pass


class FakeModel:
    """What Models reads and calls of a ServedModel."""

    def __init__(self, name: str, memory_mb: int = 10) -> None:
        self.name = name
        self.config = ModelConfig(name, SimpleNamespace(model_path=f"{name}.gguf"))  # type: ignore[arg-type]
        self.memory_bytes = memory_mb << 20
        self.state, self.load_error = "unloaded", None
        self.in_use = self.waiting = self.loads = self.unloads = 0
        self.last_used = self.load_seconds = 0.0
        self.engines = FakeEngines()
        self._own_engines = True

    @property
    def ready(self) -> bool:
        return self.state == "loaded"

    def open(self) -> None:
        pass

    def start(self, loop) -> None:
        self.loads += 1

    def stop(self) -> None:
        self.engines.stop()

    def close(self) -> None:
        pass


def catalogue(policy: LoadPolicy, *models: FakeModel) -> Models:
    models_ = Models(list(models), policy)  # type: ignore[arg-type]
    models_._opened.set()
    models_._loop = asyncio.get_running_loop()
    return models_


async def use(models: Models, model: FakeModel) -> None:
    async with models.serving(model, timeout=30):  # type: ignore[arg-type]
        await asyncio.sleep(0)


async def use_until(models: Models, model: FakeModel, release: asyncio.Event) -> None:
    """A request for `model` that runs until `release` is set."""
    async with models.serving(model, timeout=30):  # type: ignore[arg-type]
        await release.wait()


def loaded(*models: FakeModel) -> list[str]:
    return [m.name for m in models if m.state == "loaded"]


@run
async def test_the_least_recently_used_idle_model_makes_room():
    a, b, c = FakeModel("a"), FakeModel("b"), FakeModel("c")
    models = catalogue(LoadPolicy(max_loaded=2, swap_grace=0), a, b, c)
    await use(models, a)
    await use(models, b)
    await use(models, a)  # b is now the least recently used
    await use(models, c)
    assert loaded(a, b, c) == ["a", "c"]
    assert (a.loads, b.loads, c.loads) == (1, 1, 1)


@run
async def test_the_memory_budget_holds_and_a_model_past_it_fails_by_name():
    a, b, huge = FakeModel("a", 60), FakeModel("b", 60), FakeModel("huge", 200)
    models = catalogue(LoadPolicy(memory_bytes=100 << 20, swap_grace=0), a, b, huge)
    await use(models, a)
    await use(models, b)
    assert loaded(a, b, huge) == ["b"]
    with pytest.raises(APIError, match="`huge` failed to load: it needs about 200 MiB, past "
                                       "--models-memory-mb 100"):
        await use(models, huge)
    assert loaded(a, b, huge) == ["b"]


@run
async def test_a_model_in_use_is_never_unloaded_for_another():
    a, b = FakeModel("a"), FakeModel("b")
    models = catalogue(LoadPolicy(max_loaded=1, swap_grace=0), a, b)
    holding = asyncio.Event()
    release = asyncio.Event()

    async def hold_a() -> None:
        async with models.serving(a, timeout=30):  # type: ignore[arg-type]
            holding.set()
            await release.wait()
            assert a.state == "loaded"  # b waited all along

    holder = asyncio.create_task(hold_a())
    await holding.wait()
    waiting = asyncio.create_task(use(models, b))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not waiting.done() and loaded(a, b) == ["a"] and b.waiting == 1
    release.set()
    await asyncio.gather(holder, waiting)
    assert loaded(a, b) == ["b"]


@run
async def test_waiting_for_a_load_is_bounded_by_the_queue_and_the_timeout():
    a, b = FakeModel("a"), FakeModel("b")
    models = catalogue(LoadPolicy(max_loaded=1, max_waiting=2, swap_grace=0), a, b)
    holding, release = asyncio.Event(), asyncio.Event()

    async def hold_a() -> None:
        async with models.serving(a, timeout=30):  # type: ignore[arg-type]
            holding.set()
            await release.wait()

    holder = asyncio.create_task(hold_a())
    await holding.wait()
    waiters = [asyncio.create_task(use(models, b))]
    await asyncio.sleep(0)
    with pytest.raises(APIError) as late:  # a second waiter, while a holds the only room
        async with models.serving(b, timeout=0.05):  # type: ignore[arg-type]
            pass
    assert late.value.status == 504 and b.waiting == 1
    waiters.append(asyncio.create_task(use(models, b)))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded, match="2 requests wait for the model `b` to load"):
        await use(models, b)  # a third, past max_waiting: the 429 of a full queue
    release.set()
    await asyncio.gather(holder, *waiters)
    assert loaded(a, b) == ["b"]


async def ticks(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


class Clock:
    """Models' clock, moved by the test (asyncio's own runs as ever)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def advance(models: Models, clock: Clock, seconds: float) -> None:
    """Moves the clock and lets the waiting loads look again."""
    clock.now += seconds
    models._notify()
    await ticks()


@run
async def test_a_model_just_used_is_held_as_long_as_its_next_turns_take_to_come():
    """A session's next turn comes a moment after its answer: the model is held for
    HOLD_FACTOR times the usual gap between its requests (its own requests served meanwhile,
    one load), not unloaded for another's waiting request, then unloaded for it."""
    a, b = FakeModel("a"), FakeModel("b")
    clock = Clock()
    models = catalogue(LoadPolicy(max_loaded=1, swap_grace=10, swap_wait=3600), a, b)
    models.clock = clock  # type: ignore[method-assign]
    for _ in range(3):  # each next turn 0.5 s after the answer
        await use(models, a)
        clock.now += 0.5
    await use(models, a)
    waiting = asyncio.create_task(use(models, b))
    await advance(models, clock, 1.5)
    await use(models, a)  # its next turn
    await advance(models, clock, 1.9)  # 4 x 0.5 s: still held
    assert loaded(a, b) == ["a"] and (a.loads, b.loads) == (1, 0) and b.waiting == 1
    await advance(models, clock, 0.2)
    await asyncio.wait_for(waiting, 30)
    assert loaded(a, b) == ["b"]


@run
async def test_a_client_that_moved_on_to_another_model_waits_only_the_floor():
    """No next turns seen (a client asking one model, then another): the hold is
    HOLD_FLOOR, not --models-swap-grace."""
    a, b = FakeModel("a"), FakeModel("b")
    clock = Clock()
    models = catalogue(LoadPolicy(max_loaded=1, swap_grace=10, swap_wait=3600), a, b)
    models.clock = clock  # type: ignore[method-assign]
    await use(models, a)
    clock.now += 0.01
    waiting = asyncio.create_task(use(models, b))
    await ticks()
    assert loaded(a, b) == ["a"]
    await advance(models, clock, HOLD_FLOOR + 0.001)
    await served(waiting)
    assert loaded(a, b) == ["b"] and (a.loads, b.loads) == (1, 1)


async def served(use_: Coroutine | asyncio.Task) -> None:
    """Waits for a request that needs no more of the clock (which stands still meanwhile)."""
    task = asyncio.ensure_future(use_)
    done, _ = await asyncio.wait({task}, timeout=10)
    assert done, "still waiting"
    task.result()


@run
async def test_a_model_kept_busy_cannot_starve_another_past_the_swap_wait():
    """Requests for a loaded model keep being admitted while another's wait, until one has
    waited --models-swap-wait: then the busy model drains (its new requests wait in turn), the
    other loads, and after the same bound the first comes back."""
    a, b = FakeModel("a"), FakeModel("b")
    models = catalogue(LoadPolicy(max_loaded=1, swap_grace=3600, swap_wait=0.2), a, b)
    stop = asyncio.Event()
    served_a = 0

    async def one_a(entered: asyncio.Event, leave: asyncio.Event) -> None:
        async with models.serving(a, timeout=30):  # type: ignore[arg-type]
            entered.set()
            await leave.wait()

    async def relay() -> None:  # a never idle: each request begins before the last ends
        nonlocal served_a
        held: tuple[asyncio.Task, asyncio.Event] | None = None
        while not stop.is_set():
            entered, leave = asyncio.Event(), asyncio.Event()
            task = asyncio.create_task(one_a(entered, leave))
            if held is not None:
                held[1].set()
                await held[0]
                served_a += 1
            await entered.wait()
            await asyncio.sleep(0.01)
            held = task, leave
        if held is not None:
            held[1].set()
            await held[0]

    relaying = asyncio.create_task(relay())
    await asyncio.sleep(0.05)
    async with models.serving(b, timeout=30):  # type: ignore[arg-type]
        assert loaded(a, b) == ["b"] and a.unloads == 1
    while a.loads < 2:  # a's requests waited in turn, and took the room back
        await asyncio.sleep(0.01)
    stop.set()
    await relaying
    assert served_a > 2 and (a.loads, b.loads) == (2, 1)


@run
async def test_the_model_with_the_most_requests_waiting_loads_first():
    a, b, c = FakeModel("a"), FakeModel("b"), FakeModel("c")
    models = catalogue(LoadPolicy(max_loaded=1, swap_grace=0, swap_wait=3600), a, b, c)
    order: list[str] = []
    for m in (a, b, c):
        m.start = lambda loop, m=m: order.append(m.name)  # type: ignore[method-assign]
    release = asyncio.Event()
    holder = asyncio.create_task(use_until(models, a, release))
    await ticks()
    first = asyncio.create_task(use(models, b))  # b waited first, c has more waiting
    await ticks()
    more = [asyncio.create_task(use(models, c)) for _ in range(2)]
    await ticks()
    release.set()
    await asyncio.gather(holder, first, *more)
    assert order == ["a", "c", "b"]


@run
async def test_a_client_alternating_between_two_models_is_not_taken_for_a_session():
    """a, b, a, b, ... one after the other, each 0.5 s after the last answer: a's requests
    come back 1 s after its last ended, but only because b's ran meanwhile. That is no next
    turn a hold would catch, and no swap waits (each waited 4 x 1 s once a's gaps were
    learned from it)."""
    a, b = FakeModel("a"), FakeModel("b")
    clock = Clock()
    models = catalogue(LoadPolicy(max_loaded=1, swap_grace=10, swap_wait=3600), a, b)
    models.clock = clock  # type: ignore[method-assign]
    for turn in range(6):
        model = (b, a)[turn % 2]
        clock.now += 0.5
        waiting = asyncio.create_task(use(models, model))
        await ticks()
        await advance(models, clock, HOLD_FLOOR + 0.001)  # a swap waits that long
        await served(waiting)
        assert loaded(a, b) == [model.name]
    assert (a.loads, b.loads) == (3, 3)


@run
async def test_a_sessions_next_turn_after_a_swap_still_teaches_its_hold():
    """b's request waited through a's: a was held HOLD_FLOOR, then unloaded for it; a's
    session came back 0.3 s after its answer. That was a next turn (b's request came before
    it, from someone else), so a is held 4 x 0.3 s from then on."""
    a, b = FakeModel("a"), FakeModel("b")
    clock = Clock()
    models = catalogue(LoadPolicy(max_loaded=1, swap_grace=10, swap_wait=3600), a, b)
    models.clock = clock  # type: ignore[method-assign]
    release = asyncio.Event()
    holder = asyncio.create_task(use_until(models, a, release))
    await ticks()
    clock.now += 0.01
    waiting = asyncio.create_task(use(models, b))
    await advance(models, clock, 0.5)
    release.set()
    await holder
    await advance(models, clock, HOLD_FLOOR + 0.001)
    await served(waiting)
    clock.now += 0.3 - HOLD_FLOOR  # a's session's next turn, 0.3 s after its answer
    waiting = asyncio.create_task(use(models, a))
    await ticks()
    await advance(models, clock, HOLD_FLOOR + 0.001)
    await served(waiting)
    assert loaded(a, b) == ["a"] and (a.loads, b.loads) == (2, 1)
    clock.now += 0.01
    waiting = asyncio.create_task(use(models, b))
    await advance(models, clock, 1.1)
    assert loaded(a, b) == ["a"]
    await advance(models, clock, 0.2)
    await served(waiting)
    assert loaded(a, b) == ["b"]


@run
async def test_requests_arriving_together_for_two_models_are_not_split_by_the_first():
    """a loaded and idle long past its hold; a request for b, then one for a a moment later
    (sessions of both starting at once): a's is served on a, and b loads after it, one load.
    (Before, b's took the room the instant it came, and a's then waited for a second load.)"""
    a, b = FakeModel("a"), FakeModel("b")
    clock = Clock()
    models = catalogue(LoadPolicy(max_loaded=1, swap_grace=10, swap_wait=3600), a, b)
    models.clock = clock  # type: ignore[method-assign]
    await use(models, a)
    clock.now += 11  # past --models-swap-grace: no next turn
    for_b = asyncio.create_task(use(models, b))
    await ticks()
    assert loaded(a, b) == ["a"]
    clock.now += 0.01
    await served(use(models, a))
    assert loaded(a, b) == ["a"] and (a.loads, b.loads) == (1, 0)
    await advance(models, clock, HOLD_FLOOR + 0.001)
    await served(for_b)
    assert loaded(a, b) == ["b"] and (a.loads, b.loads) == (1, 1)
