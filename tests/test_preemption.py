"""More concurrent demand than KV cells: the engine preempts the newest request (its blocks go to
the pool, its cells are freed) and resumes it later. Every request completes, and each generated
token is the greedy choice of llama-cpp-python run on the same tokens (within the rounding noise
of F16 kernels batched differently)."""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from llama_cpp import Llama

from engine.config import CacheConfig, EngineConfig
from engine.messages import GenerationRequest, SamplerSettings
from loadtest.gateway_process import GatewayProcess
from tests.conftest import openai_client
from tests.local_engine import LocalEngine

TOPICS = ["rivers", "mountains", "deserts", "forests", "oceans", "glaciers", "volcanoes",
          "islands"]
# Noise between two batchings of the same tokens with F16 KV: up to 0.5 in the logits here
# (tests/test_kv_codec.py); a token that continued from corrupted KV would be far off.
TOLERANCE = 1.0


def _prompt(local_model, topic: str) -> list[int]:
    text = f"Write a long, detailed essay about {topic}, their history and their future. "
    return local_model.tokenize(text * 3, add_special=True, parse_special=False)


@pytest.fixture(scope="module")
def scorer(model_path):
    return Llama(str(model_path), n_ctx=1024, logits_all=True, flash_attn=True,
                 n_threads=os.cpu_count(), verbose=False)


def assert_greedy(scorer: Llama, eog: np.ndarray, prompt: list[int], generated: tuple[int, ...]):
    scorer.reset()
    scorer.eval(prompt + list(generated))
    logits = np.array(scorer.scores[len(prompt) - 1: len(prompt) - 1 + len(generated)])
    logits[:, eog] = -np.inf  # ignore_eos suppressed them in the engine too
    chosen = logits[np.arange(len(generated)), list(generated)]
    gaps = logits.max(axis=1) - chosen
    assert gaps.max() <= TOLERANCE, f"token {int(gaps.argmax())} is {gaps.max():.2f} off greedy"
    assert (gaps == 0).mean() >= 0.9


def test_more_demand_than_cells_completes_and_stays_greedy(local_model, scorer):
    # 8 requests of ~50 prompt + 100 generated tokens want ~1,200 cells; the context has 512.
    local = LocalEngine.start(local_model, EngineConfig(
        parallel=8, ctx_size=512, batch_tokens=128, cache=CacheConfig(budget_mb=64,
                                                                      block_size=16)))
    prompts = [_prompt(local_model, topic) for topic in TOPICS]

    async def generate(prompt):
        handle = local.submit(GenerationRequest(prompt, max_tokens=100, ignore_eos=True,
                                                sampler=SamplerSettings(temperature=0.0)))
        return [output async for output in handle.outputs()][-1]

    async def all_at_once():
        return await asyncio.gather(*(generate(p) for p in prompts))

    try:
        finals = asyncio.run(all_at_once())
        snap = local.settled()
        assert snap.preemptions > 0
        assert all(f.error is None and f.finish_reason == "length" for f in finals)
        assert all(len(f.generated) == 100 for f in finals)
        for prompt, final in zip(prompts, finals, strict=True):
            assert_greedy(scorer, local_model.eog_tokens, prompt, final.generated)
        assert snap.cells_used == 0
        local.assert_released()  # no preempted hold left
    finally:
        local.stop()


def test_preemption_through_the_server(model_path, model_name):
    server = GatewayProcess(model_path, "--parallel", "8", "--ctx-size", "512")
    client = openai_client(server)

    def ask(topic):
        r = client.chat.completions.create(
            model=model_name, max_tokens=100, temperature=0, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": f"Write a long essay about {topic}."}])
        return r.choices[0].finish_reason, r.usage.completion_tokens

    try:
        with ThreadPoolExecutor(len(TOPICS)) as pool:
            results = list(pool.map(ask, TOPICS))
        assert results == [("length", 100)] * len(TOPICS)
        metrics = server.settled()
        assert metrics["prefixgate_num_preemptions_total"] > 0
        assert metrics["prefixgate_kv_cells_used"] == 0
        assert metrics["prefixgate_kv_pool_blocks_held"] == 0
    finally:
        server.stop()


def test_a_request_preempted_while_prefilling_reports_nothing_cached(local_model):
    """B's prompt cannot finish prefilling beside A: B is preempted mid-prompt, stores what it
    computed, and later reloads it. That is its own work: cached_tokens stays 0, and the cache
    counts each prompt's lookup once. (Before, B reported its own blocks as cached.)"""
    local = LocalEngine.start(local_model, EngineConfig(
        parallel=2, ctx_size=512, batch_tokens=64, cache=CacheConfig(budget_mb=64,
                                                                     block_size=16)))
    short = _prompt(local_model, "rivers")[:50]
    long = local_model.tokenize("Glaciers carve valleys over thousands of years. " * 60,
                                add_special=True, parse_special=False)[:470]
    assert len(long) == 470  # with A's 50, more than the 512 cells

    async def generate(prompt, max_tokens):
        handle = local.submit(GenerationRequest(prompt, max_tokens=max_tokens, ignore_eos=True,
                                                sampler=SamplerSettings(temperature=0.0)))
        return [output async for output in handle.outputs()][-1]

    async def both():
        return await asyncio.gather(generate(short, 60), generate(long, 4))

    try:
        first, second = asyncio.run(both())
        snap = local.settled()
        assert snap.preemptions > 0
        assert first.error is None and second.error is None
        assert second.usage.cached_tokens == 0 and first.usage.cached_tokens == 0
        assert snap.cache.queried_tokens == len(short) + len(long)
        assert snap.cache.hit_tokens == 0
        local.assert_released()
    finally:
        local.stop()
