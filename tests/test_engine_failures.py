"""Failures inside the engine: what was in flight is answered, every cache reference and KV cell
is released, and the engine serves on (or, dead, says so instead of hanging)."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.engine import Engine, EngineConfig, EngineUnavailable, GenerationRequest
from gateway.llama import DecodeError, SamplerSettings
from gateway.prefix_cache import CacheConfig

GREEDY = SamplerSettings(temperature=0.0)


@pytest.fixture
def engine(local_model):
    engine = Engine(local_model, EngineConfig(parallel=2, ctx_size=1024, batch_tokens=64,
                                              threads=2,
                                              cache=CacheConfig(budget_mb=32, block_size=16)))
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture
def prompt(local_model) -> list[int]:
    return local_model.tokenize("A long shared introduction about rivers and lakes. " * 6,
                                add_special=False, parse_special=False)


async def _collect(engine: Engine, tokens: list[int], max_tokens: int = 8):
    handle = engine.submit(GenerationRequest(tokens, max_tokens=max_tokens, sampler=GREEDY))
    return [output async for output in handle.outputs()]


def run(engine: Engine, tokens: list[int], max_tokens: int = 8):
    return asyncio.run(_collect(engine, tokens, max_tokens))


def _text(outputs) -> str:
    return "".join(o.text for o in outputs)


def settled(engine: Engine):
    """The snapshot once the engine has published the step that answered the last request."""
    deadline = time.monotonic() + 10
    while (engine.snapshot.running or engine.snapshot.waiting) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    return engine.snapshot


def _assert_released(engine: Engine) -> None:
    pool = engine.cache.pool
    snap = settled(engine)
    assert snap.running == 0 and snap.waiting == 0 and engine.cells.used == 0
    assert (pool.refcounts[pool.refcounts > 0] == 1).all()  # only the tree's references


def test_failed_decode_releases_every_reference(engine, prompt):
    healthy_decode = engine.ctx.decode
    calls = 0

    def decode_failing_on_second_call(batch):
        nonlocal calls
        calls += 1
        if calls == 2:
            raise DecodeError("injected failure")
        healthy_decode(batch)

    first = run(engine, prompt)
    assert first[-1].finish_reason == "length"
    engine.ctx.decode = decode_failing_on_second_call
    failed = run(engine, prompt + prompt[:20])  # loaded cached blocks before it fails
    assert failed[-1].error and failed[-1].usage.cached_tokens > 0
    engine.ctx.decode = healthy_decode
    assert _text(run(engine, prompt)) == _text(first)
    assert engine.cache.pool.n_used > 0
    _assert_released(engine)


def test_failed_store_only_skips_caching(engine, prompt):
    def failing_write(*_args):
        raise OSError("injected store failure")

    engine.cache._serialise = failing_write
    outputs = run(engine, prompt)
    assert outputs[-1].finish_reason == "length" and outputs[-1].error is None
    _assert_released(engine)
    assert engine.snapshot.cache.store_failures == 1
    assert engine.alive


def test_admission_failure_answers_only_that_request(engine, prompt):
    """An exception while admitting one request fails it alone; requests waiting behind it (some
    deferred for an in-flight prefix) are all answered."""
    real_start = engine._start
    failed_once = False

    def start_failing_once(seq, donor, live):
        nonlocal failed_once
        if not failed_once:
            failed_once = True
            raise RuntimeError("injected admission failure")
        real_start(seq, donor, live)

    engine._start = start_failing_once

    async def burst():
        return await asyncio.gather(*(_collect(engine, prompt + [100 + i]) for i in range(5)))

    results = asyncio.run(burst())
    assert sum(1 for r in results if r[-1].error) == 1
    assert sum(1 for r in results if r[-1].finish_reason == "length") == 4
    _assert_released(engine)


def test_dead_engine_answers_everyone_and_refuses_new_requests(engine, prompt):
    def finish_raising(*_args):
        raise SystemExit("injected death")  # escapes the step's handler: the thread dies

    async def scenario():
        first = engine.submit(GenerationRequest(prompt, max_tokens=50, sampler=GREEDY))
        await asyncio.sleep(0.05)
        engine._sample = finish_raising
        outputs = [o async for o in first.outputs()]
        with pytest.raises(EngineUnavailable):
            engine.submit(GenerationRequest(prompt, max_tokens=4, sampler=GREEDY))
        return outputs

    outputs = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert outputs[-1].error and outputs[-1].unavailable
    assert not engine.alive and "injected death" in engine.failure


def test_stop_answers_running_and_queued_requests(local_model, prompt):
    engine = Engine(local_model, EngineConfig(parallel=1, ctx_size=1024, batch_tokens=64,
                                              threads=2, cache=CacheConfig(enabled=False)))
    engine.start()

    async def scenario():
        handles = [engine.submit(GenerationRequest(prompt, max_tokens=200, sampler=GREEDY))
                   for _ in range(3)]
        await asyncio.sleep(0.3)
        stopping = asyncio.get_running_loop().run_in_executor(None, engine.stop)
        outputs = []
        for handle in handles:
            outputs.append([o async for o in handle.outputs()])
        await stopping
        return outputs

    outputs = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert all(o[-1].error and o[-1].unavailable for o in outputs)
    assert engine.ctx.ptr is None  # freed only after the thread left llama.cpp


def test_loaded_blocks_are_not_held_while_the_request_runs(engine, prompt):
    """Once copied into the context a request's cached blocks are the tree's alone again: a
    long generation must not pin them against eviction."""
    run(engine, prompt)

    async def while_running():
        handle = engine.submit(GenerationRequest(prompt + [200, 201], max_tokens=40,
                                                 sampler=GREEDY))
        outputs = handle.outputs()
        await outputs.__anext__()  # generating now, after loading the cached prompt
        held = engine.snapshot.pool_blocks_held
        return held, [o async for o in outputs][-1]

    held, last = asyncio.run(while_running())
    assert last.usage.cached_tokens > 0 and held == 0


def test_an_uncached_request_is_counted_once(local_model, prompt):
    # A pool of one block cannot hold a prompt of several: the request runs uncached.
    engine = Engine(local_model, EngineConfig(parallel=1, ctx_size=1024, batch_tokens=64,
                                              cache=CacheConfig(budget_mb=1, block_size=16)))
    engine.start()
    try:
        run(engine, prompt)
        assert settled(engine).cache.uncached_requests == 1
    finally:
        engine.stop()


def test_waiting_counts_requests_not_wake_up_markers(engine, prompt):
    async def scenario():
        handle = engine.submit(GenerationRequest(prompt, max_tokens=30, sampler=GREEDY))
        outputs = handle.outputs()
        await outputs.__anext__()
        for _ in range(5):
            engine.wake()
        await asyncio.sleep(0.2)
        waiting = engine.snapshot.waiting
        [o async for o in outputs]
        return waiting

    assert asyncio.run(scenario()) == 0
