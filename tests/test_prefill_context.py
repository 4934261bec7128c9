"""A fresh prompt computed in the prefill context, away from the pool's other sequences' cells
(engine/prefill_context.py), on the real model: where its rows go, that every request keeps the
tokens it gets when the prompt is computed in the pool, that a request sharing its prefix waits
for its cells to reach the pool, and that nothing stays held."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

from engine.config import CacheConfig, EngineConfig
from engine.messages import GenerationRequest, SamplerSettings
from tests.local_engine import LocalEngine, recorded

# No cache: the same prompt is computed each time; no drafts: a pool call's rows are decodes.
# A small target: a prompt of 126 tokens takes several steps beside a stream.
CONFIG = EngineConfig(parallel=4, ctx_size=2048, target_tpot_ms=150, speculation=False,
                      cache=CacheConfig(enabled=False))


def greedy(model, text: str, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(model.tokenize(text, add_special=True, parse_special=False),
                             max_tokens=max_tokens, ignore_eos=True,
                             sampler=SamplerSettings(temperature=0.0))


async def generated(local: LocalEngine, request: GenerationRequest,
                    started: asyncio.Event | None = None) -> tuple[int, ...]:
    """The request's tokens; `started` is set once its third output arrived."""
    outputs = []
    async for output in local.submit(request).outputs():
        assert output.error is None, output.error
        outputs.append(output)
        if started and len(outputs) == 3:
            started.set()
    return outputs[-1].generated


class Pause:
    """Holds the engine thread after the prefill context's first call that brings the rows it
    computed into `rows`, until `resume()`; `reached` is set then."""

    def __init__(self, local: LocalEngine, rows: range) -> None:
        self.reached, self._resumed = threading.Event(), threading.Event()
        computed = [0]
        decode = local.engine.prefill.ctx.decode

        def holding(batch):  # on the engine thread
            decode(batch)
            computed[0] += len(batch)
            if computed[0] in rows and not self.reached.is_set():
                self.reached.set()
                assert self._resumed.wait(30)

        local.engine.prefill.ctx.decode = holding

    async def wait(self) -> None:
        while not self.reached.is_set():
            await asyncio.sleep(0.005)

    def resume(self) -> None:
        self._resumed.set()


def test_a_fresh_prompt_is_computed_apart_and_changes_no_token(local_model):
    """Alone, the prompt gets the tokens it gets in the pool (one chunk either way: chunks of
    other sizes round differently). Beside a stream, it is computed apart in chunks, and the
    stream gets the tokens it gets alone."""
    stream = greedy(local_model, "Count from one to fifty:", 40)
    # 126 tokens: the pool's cells stay below 256, where a lone decode row is computed in one
    # pass (from a span of 512, in two halves added up after: docs/scheduler.md).
    prompt = greedy(local_model, "Tell me about rivers. " * 25, 8)

    async def beside_a_stream(local: LocalEngine):
        started = asyncio.Event()
        stream_task = asyncio.create_task(generated(local, stream, started))
        await started.wait()
        return await asyncio.gather(stream_task, generated(local, prompt))

    in_pool = LocalEngine.start(local_model, dataclasses.replace(CONFIG, prefill_context=False))
    try:
        stream_alone = asyncio.run(generated(in_pool, stream))
        prompt_alone = asyncio.run(generated(in_pool, prompt))
    finally:
        in_pool.stop()
    local = LocalEngine.start(local_model, CONFIG)
    try:
        pool_calls = recorded(local.engine.ctx)
        apart_calls = recorded(local.engine.prefill.ctx)
        assert asyncio.run(generated(local, prompt)) == prompt_alone
        assert sum(call.total() for call in apart_calls) == len(prompt.prompt_tokens)
        pool_calls.clear()
        apart_calls.clear()
        streamed, _ = asyncio.run(beside_a_stream(local))
        assert streamed == stream_alone
        # The whole prompt was computed apart; in the pool it only decoded.
        assert sum(call.total() for call in apart_calls) == len(prompt.prompt_tokens)
        assert len(apart_calls) > 1  # in chunks, beside the stream's decodes
        stream_slot = max(pool_calls[0])  # the stream ran alone in its first calls
        assert all(n == 1 for call in pool_calls for seq, n in call.items()
                   if seq != stream_slot), pool_calls
        local.assert_released()
        assert not local.engine.prefill.busy
    finally:
        local.stop()


def test_a_request_sharing_a_prefix_computed_apart_waits_for_it_in_the_pool(local_model):
    """B's prompt begins with part of A's. B arrives while A's prompt is computed apart, past
    that part: B must not take the cells A does not yet have in the pool. It waits, then shares
    them, and gets the tokens it gets alone."""
    stream = greedy(local_model, "Count from one to fifty:", 60)
    long_text = "Tell me about rivers and the towns along them. " * 40
    a = greedy(local_model, long_text, 4)
    b_tokens = a.prompt_tokens[:200] + local_model.tokenize(
        " Now name three seas.", add_special=False, parse_special=False)
    b = GenerationRequest(b_tokens, max_tokens=8, ignore_eos=True,
                          sampler=SamplerSettings(temperature=0.0))
    # A small target: A's prompt takes several steps beside the stream.
    local = LocalEngine.start(local_model, EngineConfig(parallel=4, ctx_size=4096,
                                                        target_tpot_ms=150))
    past_b_prefix = Pause(local, range(220, len(a.prompt_tokens)))  # A still apart

    async def run():
        started = asyncio.Event()
        stream_task = asyncio.create_task(generated(local, stream, started))
        await started.wait()
        a_task = asyncio.create_task(generated(local, a))
        await past_b_prefix.wait()
        b_task = asyncio.create_task(generated(local, b))
        await asyncio.sleep(0.05)  # b is in the engine's inbox
        past_b_prefix.resume()
        return await asyncio.gather(stream_task, a_task, b_task)

    try:
        _, _, b_beside = asyncio.run(run())
        assert past_b_prefix.reached.is_set()
        assert local.settled().shared_tokens >= 192  # B took A's cells, once in the pool
        local.assert_released()
    finally:
        local.stop()
    alone = LocalEngine.start(local_model, EngineConfig(parallel=4, ctx_size=4096,
                                                        cache=CacheConfig(enabled=False)))
    try:
        assert asyncio.run(generated(alone, b)) == b_beside
    finally:
        alone.stop()


def test_a_request_cancelled_while_computed_apart_frees_the_prefill_context(local_model):
    stream = greedy(local_model, "Count from one to fifty:", 40)
    prompt = greedy(local_model, "Tell me about rivers. " * 60, 8)
    local = LocalEngine.start(local_model, EngineConfig(parallel=4, ctx_size=2048,
                                                        target_tpot_ms=150))
    first_chunk = Pause(local, range(1, len(prompt.prompt_tokens)))

    async def run():
        started = asyncio.Event()
        stream_task = asyncio.create_task(generated(local, stream, started))
        await started.wait()
        handle = local.submit(prompt)
        await first_chunk.wait()
        handle.cancel()
        first_chunk.resume()
        await stream_task
        # The context takes the next fresh prompt.
        return await generated(local, prompt)

    try:
        assert len(asyncio.run(run())) == 8
        local.assert_released()
        assert not local.engine.prefill.busy
    finally:
        local.stop()
