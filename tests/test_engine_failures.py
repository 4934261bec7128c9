"""A request that fails inside the engine releases every cache reference it held."""

from __future__ import annotations

import asyncio

from gateway.engine import Engine, EngineConfig, GenerationRequest
from gateway.llama import DecodeError, SamplerSettings
from gateway.prefix_cache import CacheConfig

GREEDY = SamplerSettings(temperature=0.0)


def test_failed_decode_releases_every_reference(local_model):
    engine = Engine(local_model, EngineConfig(parallel=2, seq_len=512, batch_tokens=64,
                                              threads=2,
                                              cache=CacheConfig(budget_mb=32, block_size=16)))
    engine.start()
    prompt = local_model.tokenize("A long shared introduction about rivers and lakes. " * 6,
                                  add_special=False, parse_special=False)
    healthy_decode = engine.ctx.decode
    calls = 0

    def decode_failing_on_second_call(batch):
        nonlocal calls
        calls += 1
        if calls == 2:
            raise DecodeError("injected failure")
        healthy_decode(batch)

    async def run(tokens):
        handle = engine.submit(GenerationRequest(tokens, max_tokens=8, sampler=GREEDY))
        return [output async for output in handle.outputs()]

    try:
        first = asyncio.run(run(prompt))
        assert first[-1].finish_reason == "length"
        engine.ctx.decode = decode_failing_on_second_call
        failed = asyncio.run(run(prompt + prompt[:20]))  # holds cached blocks when it fails
        assert failed[-1].error and failed[-1].usage.cached_tokens > 0
        engine.ctx.decode = healthy_decode
        again = asyncio.run(run(prompt))
        assert "".join(o.text for o in again) == "".join(o.text for o in first)
        pool = engine.cache.pool
        assert engine.n_running == 0 and pool.n_used > 0
        assert (pool.refcounts[pool.refcounts > 0] == 1).all()  # only the tree's references
    finally:
        engine.stop()
