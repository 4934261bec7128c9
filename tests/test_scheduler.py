"""The step budget (engine/scheduler.py): the step cost fit, the budget's bounds, and a
closed-loop run of 8 clients on a simulated CPU whose steps cost what the fit assumes. The run
is the fake engine: each step decodes every generating sequence and computes prompt chunks in
arrival order within the budget, as engine/batching.py plans it."""

from __future__ import annotations

import asyncio
import collections

import numpy as np
import pytest

from engine.batching import FA_TILE_ROWS
from engine.config import CacheConfig, EngineConfig
from engine.llama import KVCacheFull
from engine.messages import GenerationRequest, SamplerSettings
from engine.scheduler import MIN_PROMPT_TOKENS, PRIOR, Scheduler, StepCost, StepCostFit
from tests.local_engine import LocalEngine, recorded, streaming

TRUE_COST = StepCost(fixed=0.010, per_decode=0.003, per_prompt=0.002)



async def final(local: LocalEngine, request: GenerationRequest):
    """The request's last output."""
    async for output in local.submit(request).outputs():
        last = output
    return last


async def beside_a_stream(local: LocalEngine, stream: GenerationRequest,
                          beside: GenerationRequest) -> list:
    """The last outputs of `stream` and of `beside`, which joins it at the step `streaming`
    holds the engine at, the same on any machine."""
    hold = streaming(local)
    stream_task = asyncio.create_task(final(local, stream))
    await hold.wait()
    beside_task = asyncio.create_task(final(local, beside))
    await asyncio.sleep(0)  # it runs up to its first wait: submitted
    hold.release()
    return await asyncio.gather(stream_task, beside_task)

def test_the_fit_finds_a_linear_cost_through_noise():
    fit = StepCostFit()
    rng = np.random.default_rng(0)
    for _ in range(600):
        n_decode, n_prompt = int(rng.integers(0, 9)), int(rng.choice([0, 16, 64, 128, 512]))
        noise = rng.normal(1, 0.05)
        fit.observe(n_decode, n_prompt, TRUE_COST.seconds(n_decode, n_prompt) * noise)
    assert fit.cost.fixed == pytest.approx(TRUE_COST.fixed, rel=0.2)
    assert fit.cost.per_decode == pytest.approx(TRUE_COST.per_decode, rel=0.1)
    assert fit.cost.per_prompt == pytest.approx(TRUE_COST.per_prompt, rel=0.05)


def test_the_fit_starts_from_the_prior_and_never_goes_negative():
    fit = StepCostFit()
    assert fit.cost == PRIOR
    for _ in range(50):  # decode-only steps whose time does not grow with their size
        fit.observe(8, 0, 0.001)
    assert fit.cost.per_decode > 0 and fit.cost.per_prompt > 0 and fit.cost.fixed >= 0


@pytest.mark.parametrize("target", [0.0, 0.05, 0.15, 1.0])
def test_the_budget_keeps_steps_within_the_target_and_prompts_moving(target):
    scheduler = Scheduler(target, StepCostFit(prior=TRUE_COST))  # read before any step
    assert scheduler.prompt_budget(0, 512) == 512  # nobody waits: the whole batch
    for n_decode in range(1, 9):
        budget = scheduler.prompt_budget(n_decode, 512)
        assert MIN_PROMPT_TOKENS <= budget <= 512 - n_decode  # no prompt starves
        if budget > MIN_PROMPT_TOKENS:
            assert TRUE_COST.seconds(n_decode, budget) <= target + 1e-9
            assert budget == 512 - n_decode or \
                TRUE_COST.seconds(n_decode, budget + 1) > target


def closed_loop(target: float, clients: int = 8, requests: int = 24, prompt: int = 300,
                output: int = 24) -> dict:
    """Clients that each send a request when their last one ends, on the simulated CPU."""
    scheduler = Scheduler(target, StepCostFit())
    now, started, done, steps = 0.0, 0, [], 0
    running: list[dict] = []
    waits: list[tuple[float, float]] = []
    while started < requests or running:
        while started < requests and len(running) < clients:
            running.append({"arrived": now, "left": prompt, "tokens": 0})
            started += 1
        decoding = [r for r in running if r["left"] == 0]
        budget = scheduler.prompt_budget(len(decoding), 512)
        chunks = []
        for r in running:
            if r["left"] and budget > 0:
                n = min(r["left"], budget)
                chunks.append((r, n))
                budget -= n
        n_prompt = sum(n for _, n in chunks)
        seconds = TRUE_COST.seconds(len(decoding), n_prompt)
        scheduler.fit.observe(len(decoding), n_prompt, seconds)
        if decoding:  # what the streams waited, and the least a step with them can take
            waits.append((seconds, TRUE_COST.seconds(len(decoding), MIN_PROMPT_TOKENS)))
        now, steps = now + seconds, steps + 1
        for r, n in chunks:
            r["left"] -= n
            if not r["left"]:
                r["first"], r["tokens"] = now, 1
        for r in decoding:
            r["tokens"] += 1
        for r in [r for r in running if r["tokens"] >= output]:
            r["end"] = now
            running.remove(r)
            done.append(r)
    return {"done": done, "wall": now, "waits": waits}


@pytest.mark.parametrize("target", [0.05, 0.1, 0.3])
def test_streams_wait_at_most_the_target_and_every_prompt_finishes(target):
    """Once the fit has learnt the CPU (it starts from another model's prior), a step beside
    running streams takes at most the target, or the least it can with prompts still moving."""
    run = closed_loop(target)
    assert len(run["done"]) == 24  # no prompt starved
    for seconds, least in run["waits"][20:]:
        assert seconds <= max(target, least) * 1.02


def test_a_tighter_target_trades_first_tokens_for_smoother_streams():
    def medians(target):
        done = closed_loop(target)["done"]
        return (float(np.median([r["first"] - r["arrived"] for r in done])),
                float(np.median([(r["end"] - r["first"]) / 23 for r in done])))

    tight, loose = medians(0.06), medians(0.6)
    assert tight[1] < loose[1]  # TPOT
    assert tight[0] > loose[0]  # TTFT


def test_a_stream_is_decoded_apart_from_a_prompt_chunk_and_keeps_its_tokens(local_model):
    """A stream's decode row and a prompt chunk of 64 rows or more would share llama.cpp's
    flash-attention tiles, which then skip no other sequence's cells: the engine computes them
    in two calls. The stream's row then takes the path it takes alone, so its greedy tokens
    are the same whether or not a prompt is computed beside it."""
    # Steps of up to 256 prompt tokens beside the stream, whatever the machine's speed: the
    # prompt goes in one chunk; among the pool's cells, as one with a cached prefix is
    # computed. All the cells stay below 256, so that llama.cpp attends over a span of 256 in
    # both runs: from 512 cells on, it splits a lone row's cells between its threads and adds
    # them up in another order, which can change a greedy token where two are nearly tied.
    local = LocalEngine.start(local_model, EngineConfig(parallel=4, ctx_size=2048,
                                                        step_tokens=256,
                                                        prefill_context=False,
                                                        cache=CacheConfig(enabled=False)))
    calls = recorded(local.engine.ctx)
    stream = GenerationRequest(local_model.tokenize("Count from one to fifty:", add_special=True,
                                                    parse_special=False),
                               max_tokens=40, ignore_eos=True,
                               sampler=SamplerSettings(temperature=0.0))
    beside = GenerationRequest(local_model.tokenize("Tell me about rivers. " * 25,
                                                    add_special=True, parse_special=False),
                               max_tokens=2, ignore_eos=True,
                               sampler=SamplerSettings(temperature=0.0))

    try:
        alone = asyncio.run(final(local, stream)).generated
        calls.clear()
        assert asyncio.run(beside_a_stream(local, stream, beside))[0].generated == alone
        stream_slot = max(calls[0])  # the stream ran alone in its first calls
        chunks = [i for i, rows in enumerate(calls) if any(n > 1 for n in rows.values())]
        assert chunks, "the prompt beside was never computed"
        assert any(stream_slot in calls[i - 1] for i in chunks)  # while the stream decoded
        assert max(sum(calls[i].values()) for i in chunks) >= FA_TILE_ROWS
        for rows in calls:
            assert not (stream_slot in rows and rows.total() >= FA_TILE_ROWS), rows
    finally:
        local.stop()


def test_a_prompt_call_without_cells_after_the_decodes_preempts_and_loses_nothing(local_model):
    """When the second call of a step (the prompt chunk, after the decodes were computed and
    sampled) finds no KV cells, the newest request is preempted and resumes later: both
    requests finish whole, the stream's tokens as alone, and no cell or block stays held."""
    local = LocalEngine.start(local_model, EngineConfig(parallel=4, ctx_size=2048,
                                                        step_tokens=256,
                                                        prefill_context=False))
    decode = local.engine.ctx.decode
    refused, previous = [], collections.Counter()

    def full_once(batch):
        nonlocal previous
        seqs = collections.Counter(batch.raw.seq_id[i][0] for i in range(len(batch)))
        # The prompt's call right after another sequence's decode: a step's second call.
        if not refused and len(seqs) == 1 and len(batch) >= FA_TILE_ROWS and \
                previous and not previous.keys() & seqs.keys():
            refused.append(len(batch))
            raise KVCacheFull("no free KV cells (test)")
        previous = seqs
        decode(batch)

    stream = GenerationRequest(local_model.tokenize("Count from one to fifty:", add_special=True,
                                                    parse_special=False),
                               max_tokens=40, ignore_eos=True,
                               sampler=SamplerSettings(temperature=0.0))
    # All the cells below 256, as in the test above, so that the stream's tokens can match.
    beside = GenerationRequest(local_model.tokenize("Tell me about rivers. " * 25,
                                                    add_special=True, parse_special=False),
                               max_tokens=4, ignore_eos=True,
                               sampler=SamplerSettings(temperature=0.0))

    try:
        alone = asyncio.run(final(local, stream)).generated
        local.engine.ctx.decode = full_once
        streamed, prompted = asyncio.run(beside_a_stream(local, stream, beside))
        assert refused, "the prompt's call was never refused"
        assert local.settled().preemptions == 1
        assert streamed.error is None and streamed.generated == alone
        assert prompted.error is None and len(prompted.generated) == 4
        assert local.settled().cells_used == 0
        local.assert_released()
    finally:
        local.stop()


def test_prompts_waiting_together_share_a_call(local_model):
    """Prompts waiting together fill a step's budget side by side, in arrival order, rather
    than taking a step each. With nothing decoding a step takes the whole batch, so of three
    prompts of about 100 tokens submitted at once at least two are computed in one call (the
    engine may admit the first before the others arrive)."""
    local = LocalEngine.start(local_model, EngineConfig(parallel=4, ctx_size=2048,
                                                        prefill_context=False,
                                                        cache=CacheConfig(enabled=False)))
    calls = recorded(local.engine.ctx)
    requests = [GenerationRequest(local_model.tokenize(text * 20, add_special=True,
                                                       parse_special=False),
                                  max_tokens=3, ignore_eos=True,
                                  sampler=SamplerSettings(temperature=0.0))
                for text in ("Tell me about rivers. ", "Describe the mountains. ",
                             "Explain the oceans. ")]
    assert all(len(r.prompt_tokens) >= FA_TILE_ROWS for r in requests)

    async def finals():
        async def final(request):
            async for output in local.submit(request).outputs():
                last = output
            return last
        return await asyncio.gather(*(final(r) for r in requests))

    try:
        for output in asyncio.run(finals()):
            assert output.error is None and len(output.generated) == 3
        prompt_calls = [[seq for seq, n in rows.items() if n > 1] for rows in calls]
        assert max(len(seqs) for seqs in prompt_calls) >= 2, calls
        local.assert_released()
    finally:
        local.stop()
