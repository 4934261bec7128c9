"""Failures inside the engine: what was in flight is answered, every cache reference and KV cell
is released, and the engine serves on (or, dead, says so instead of hanging)."""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import threading
import time
from types import SimpleNamespace

import pytest

from engine.config import CacheConfig, EngineConfig
from engine.llama import DecodeError
from engine.messages import Cancel, Channel, EngineUnavailable, GenerationRequest, SamplerSettings
from engine.process import _Link, _serve
from gateway.config import WorkersConfig
from gateway.workers.supervisor import WorkerProcess, Workers
from tests.local_engine import LocalEngine

GREEDY = SamplerSettings(temperature=0.0)


@pytest.fixture
def local(local_model):
    local = LocalEngine.start(local_model, EngineConfig(
        parallel=2, ctx_size=1024, batch_tokens=64, threads=2,
        cache=CacheConfig(budget_mb=32, block_size=16)))
    yield local
    local.stop()


@pytest.fixture
def prompt(local_model) -> list[int]:
    return local_model.tokenize("A long shared introduction about rivers and lakes. " * 6,
                                add_special=False, parse_special=False)


async def _collect(local: LocalEngine, tokens: list[int], max_tokens: int = 8):
    handle = local.submit(GenerationRequest(tokens, max_tokens=max_tokens, sampler=GREEDY))
    return [output async for output in handle.outputs()]


def run(local: LocalEngine, tokens: list[int], max_tokens: int = 8):
    return asyncio.run(_collect(local, tokens, max_tokens))


def _text(outputs) -> str:
    return "".join(o.text for o in outputs)


def test_failed_decode_releases_every_reference(local, prompt):
    engine = local.engine
    healthy_decode = engine.ctx.decode
    calls = 0

    def decode_failing_on_second_call(batch):
        nonlocal calls
        calls += 1
        if calls == 2:
            raise DecodeError("injected failure")
        healthy_decode(batch)

    first = run(local, prompt)
    assert first[-1].finish_reason == "length"
    engine.ctx.decode = decode_failing_on_second_call
    failed = run(local, prompt + prompt[:20])  # loaded cached blocks before it fails
    assert failed[-1].error and failed[-1].usage.cached_tokens > 0
    engine.ctx.decode = healthy_decode
    assert _text(run(local, prompt)) == _text(first)
    assert local.index.pool.n_used > 0
    local.assert_released()


def test_failed_store_only_skips_caching(local, prompt):
    def failing_write(*_args):
        raise OSError("injected store failure")

    local.engine.cache._serialise = failing_write
    outputs = run(local, prompt)
    assert outputs[-1].finish_reason == "length" and outputs[-1].error is None
    local.assert_released()
    assert local.engine.snapshot.cache.store_failures == 1
    assert local.index.pool.n_used == 0  # the plan's slots went back
    assert local.engine.alive


def test_a_refused_load_computes_the_prompt_and_is_counted(local, prompt):
    """llama.cpp refusing cached KV (no free cells) costs the prefill, not the answer."""
    first = run(local, prompt)
    ctx = local.engine.ctx

    def refuse(seq_id, blob):
        raise DecodeError(f"injected: no cells for sequence {seq_id}")

    ctx.load_sequence_state = refuse
    again = run(local, prompt)
    assert _text(again) == _text(first) and again[-1].usage.cached_tokens == 0
    assert local.engine.snapshot.cache.load_failures == 1
    local.assert_released()


def test_admission_failure_answers_only_that_request(local, prompt):
    """An exception while admitting one request fails it alone; requests waiting behind it (some
    deferred for an in-flight prefix) are all answered."""
    engine = local.engine
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
        return await asyncio.gather(*(_collect(local, prompt + [100 + i]) for i in range(5)))

    results = asyncio.run(burst())
    assert sum(1 for r in results if r[-1].error) == 1
    assert sum(1 for r in results if r[-1].finish_reason == "length") == 4
    local.assert_released()


def test_dead_engine_answers_everyone_and_refuses_new_requests(local, prompt):
    engine = local.engine

    def finish_raising(*_args):
        raise SystemExit("injected death")  # escapes the step's handler: the thread dies

    async def scenario():
        first = local.submit(GenerationRequest(prompt, max_tokens=50, sampler=GREEDY))
        await asyncio.sleep(0.05)
        engine._sample = finish_raising
        outputs = [o async for o in first.outputs()]
        with pytest.raises(EngineUnavailable):
            local.submit(GenerationRequest(prompt, max_tokens=4, sampler=GREEDY))
        return outputs

    outputs = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert outputs[-1].error and outputs[-1].unavailable
    assert not engine.alive and "injected death" in engine.failure


def test_stop_answers_running_and_queued_requests(local_model, prompt):
    local = LocalEngine.start(local_model, EngineConfig(
        parallel=1, ctx_size=1024, batch_tokens=64, threads=2, cache=CacheConfig(enabled=False)))

    async def scenario():
        handles = [local.submit(GenerationRequest(prompt, max_tokens=200, sampler=GREEDY))
                   for _ in range(3)]
        await asyncio.sleep(0.3)
        stopping = asyncio.get_running_loop().run_in_executor(None, local.stop)
        outputs = []
        for handle in handles:
            outputs.append([o async for o in handle.outputs()])
        await stopping
        return outputs

    outputs = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert all(o[-1].error and o[-1].unavailable for o in outputs)
    assert local.engine.ctx.ptr is None  # freed only after the thread left llama.cpp


def test_loaded_blocks_are_not_held_while_the_request_runs(local, prompt):
    """Once copied into the context a request's cached blocks are the tree's alone again: a
    long generation must not pin them against eviction."""
    run(local, prompt)

    async def while_running():
        handle = local.submit(GenerationRequest(prompt + [200, 201], max_tokens=40,
                                                sampler=GREEDY))
        outputs = handle.outputs()
        await outputs.__anext__()  # generating now, after loading the cached prompt
        held = local.index.snapshot().blocks_held
        return held, [o async for o in outputs][-1]

    held, last = asyncio.run(while_running())
    assert last.usage.cached_tokens > 0 and held == 0


def test_an_uncached_request_is_counted_once(local_model, prompt):
    # A pool of one block cannot hold a prompt of several: the request runs uncached.
    local = LocalEngine.start(local_model, EngineConfig(
        parallel=1, ctx_size=1024, batch_tokens=64,
        cache=CacheConfig(budget_mb=1, block_size=16)))
    try:
        run(local, prompt)
        local.settled()
        assert local.index.snapshot().uncached_requests == 1
    finally:
        local.stop()


def test_waiting_counts_requests_not_wake_up_markers(local, prompt):
    async def scenario():
        handle = local.submit(GenerationRequest(prompt, max_tokens=30, sampler=GREEDY))
        outputs = handle.outputs()
        await outputs.__anext__()
        for _ in range(5):
            local.engine.wake()
        await asyncio.sleep(0.2)
        waiting = local.engine.snapshot.waiting
        [o async for o in outputs]
        return waiting

    assert asyncio.run(scenario()) == 0


def test_a_worker_whose_engine_died_exits_under_traffic():
    """Its main thread leaves at once though messages keep coming, so that the gateway replaces
    it. (Before, it looked for the failure only after 0.5 s without a message.)"""
    ours, theirs = multiprocessing.Pipe()
    engine = SimpleNamespace(failure=None, wake=lambda: None)
    done = threading.Event()

    def traffic() -> None:
        while not done.is_set():
            ours.send(Cancel(0))
            time.sleep(0.05)

    sender = threading.Thread(target=traffic, daemon=True)
    sender.start()
    serving = threading.Thread(target=_serve, args=(engine, _Link(Channel(theirs)), []))
    serving.start()
    time.sleep(0.3)
    engine.failure = "injected death"
    serving.join(timeout=60)  # before, never: the traffic never let it look
    done.set()
    assert not serving.is_alive()


def test_a_reader_that_cannot_read_its_worker_takes_it_down():
    """Anything but the end of the stream, too: the worker is killed and handled as dead (so
    replaced). (Before, the reader thread died and the worker stayed in service, unheard.)"""
    workers = Workers(WorkersConfig(model_path="unused.gguf", engine=EngineConfig()))
    workers._loop = asyncio.new_event_loop()
    killed = []
    process = SimpleNamespace(kill=lambda: killed.append(True), join=lambda timeout=None: None,
                              exitcode=-9, pid=1, is_alive=lambda: False)

    class Garbled:
        def recv(self):
            raise pickle.UnpicklingError("not a message")

        def send(self, message) -> None:
            pass

    worker = WorkerProcess(0, process, Garbled(), state="ready")
    workers._workers = [worker]
    workers._read(worker)
    assert killed and worker.state == "dead"
    workers._loop.close()
