"""A fresh prompt computed in the prefill context, away from the pool's other sequences' cells
(engine/prefill_context.py), on the real model: where its rows go, that every request keeps the
tokens it gets when the prompt is computed in the pool, that a request sharing its prefix waits
for its cells to reach the pool, and that nothing stays held."""

from __future__ import annotations

import asyncio
import dataclasses

from engine.config import CacheConfig, EngineConfig
from engine.messages import GenerationRequest, SamplerSettings
from gateway.workers.handles import GenerationHandle
from tests.local_engine import Hold, LocalEngine, recorded, streaming

# No cache: the same prompt is computed each time; no drafts: a pool call's rows are decodes.
# Steps of 32 prompt tokens beside a stream, on any machine: a prompt of 126 tokens takes four.
CONFIG = EngineConfig(parallel=4, ctx_size=2048, step_tokens=32, speculation=False,
                      cache=CacheConfig(enabled=False))


def greedy(model, text: str, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(model.tokenize(text, add_special=True, parse_special=False),
                             max_tokens=max_tokens, ignore_eos=True,
                             sampler=SamplerSettings(temperature=0.0))


async def generated(local: LocalEngine, request: GenerationRequest) -> tuple[int, ...]:
    return await tokens(local.submit(request))


async def tokens(handle: GenerationHandle) -> tuple[int, ...]:
    """The request's tokens, once it ended."""
    outputs = [output async for output in handle.outputs()]
    assert all(output.error is None for output in outputs), outputs[-1].error
    return outputs[-1].generated


def computed_apart(local: LocalEngine, rows: range) -> Hold:
    """Holds the engine after the prefill context's first call that brings the rows it
    computed into `rows`."""
    return Hold(local.engine.prefill.ctx, lambda _calls, computed: computed in rows)


def test_a_fresh_prompt_is_computed_apart_and_changes_no_token(local_model):
    """Alone, the prompt gets the tokens it gets in the pool (one chunk either way: chunks of
    other sizes round differently). Beside a stream, it is computed apart in chunks, and the
    stream gets the tokens it gets alone."""
    stream = greedy(local_model, "Count from one to fifty:", 40)
    # 126 tokens: the pool's cells stay below 256, where a lone decode row is computed in one
    # pass (from a span of 512, in two halves added up after: docs/scheduler.md).
    prompt = greedy(local_model, "Tell me about rivers. " * 25, 8)

    async def beside_a_stream(local: LocalEngine):
        hold = streaming(local)
        stream_task = asyncio.create_task(generated(local, stream))
        await hold.wait()
        prompt_task = asyncio.create_task(tokens(local.submit(prompt)))
        hold.release()
        return await asyncio.gather(stream_task, prompt_task)

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
    # Steps of 64 prompt tokens: A's prompt takes several beside the stream, the fourth ending
    # past B's prefix.
    local = LocalEngine.start(local_model, EngineConfig(parallel=4, ctx_size=4096,
                                                        step_tokens=64))
    past_b_prefix = computed_apart(local, range(220, len(a.prompt_tokens)))  # A still apart

    async def run():
        hold = streaming(local)
        stream_task = asyncio.create_task(generated(local, stream))
        await hold.wait()
        a_task = asyncio.create_task(tokens(local.submit(a)))
        hold.release()
        await past_b_prefix.wait()
        b_task = asyncio.create_task(tokens(local.submit(b)))  # in the engine's inbox
        past_b_prefix.release()
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
                                                        step_tokens=32))
    first_chunk = computed_apart(local, range(1, len(prompt.prompt_tokens)))

    async def run():
        hold = streaming(local)
        stream_task = asyncio.create_task(generated(local, stream))
        await hold.wait()
        handle = local.submit(prompt)
        hold.release()
        await first_chunk.wait()
        handle.cancel()
        first_chunk.release()
        await stream_task
        # The context takes the next fresh prompt.
        return await generated(local, prompt)

    try:
        assert len(asyncio.run(run())) == 8
        local.assert_released()
        assert not local.engine.prefill.busy
    finally:
        local.stop()
