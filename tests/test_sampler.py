"""The sampler checks a grammar as llama-server does (the chain's pick first, the whole
vocabulary only when the pick is rejected), and a greedy pick first looks for the best allowed
token among the likeliest: the same tokens as masking the whole vocabulary, far fewer passes."""

from __future__ import annotations

import pytest

from engine import llama
from engine.config import ContextShape
from engine.llama import Batch, Candidates, Context, Sampler
from engine.messages import SamplerSettings
from gateway.structured import grammar_for
from loadtest.workloads import RECORD_SCHEMA


def generate(model, settings: SamplerSettings, n_tokens: int = 120) -> tuple[list[int], int]:
    """Greedy tokens for a JSON prompt, and how many picks masked the whole vocabulary."""
    ctx, batch = Context(model, ContextShape(2048, 1, 512, 2, flash_attn=True)), Batch(512)
    sampler, candidates = Sampler(settings, model, 2048), Candidates(model.n_vocab)
    full_passes, pick = [0], sampler._pick

    def counted(*args, with_grammar: bool, **kw):
        full_passes[0] += with_grammar
        return pick(*args, with_grammar=with_grammar, **kw)

    sampler._pick = counted
    prompt = model.tokenize("A book, as a JSON record: ", add_special=True, parse_special=False)
    index, pos, out = batch.add(prompt, 0, 0, True), len(prompt), []
    try:
        for _ in range(n_tokens):
            ctx.decode(batch)
            token = sampler.sample(ctx, index, candidates)
            if model.is_eog(token):
                break
            out.append(token)
            batch.clear()
            index = batch.add([token], pos, 0, True)
            pos += 1
    finally:
        sampler.close()
        batch.close()
        ctx.close()
    return out, full_passes[0]


@pytest.mark.parametrize("penalties", [{}, {"frequency_penalty": 0.5}])
def test_greedy_grammar_picks_equal_a_full_pass(local_model, monkeypatch, penalties):
    settings = SamplerSettings(temperature=0.0, **penalties, grammar=grammar_for(
        "json_schema", {"name": "record", "schema": RECORD_SCHEMA}))
    fast, fast_passes = generate(local_model, settings)
    monkeypatch.setattr(llama, "GREEDY_SEARCH", 0)  # every rejected pick masks everything
    full, full_passes = generate(local_model, settings)
    assert fast == full and len(fast) > 20
    assert full_passes > 2 * fast_passes
