"""The sampler checks a grammar as llama-server does (the chain's pick first, the whole
vocabulary only when the pick is rejected), and a greedy pick first looks for the best allowed
token among the likeliest: the same tokens as masking the whole vocabulary, far fewer passes."""

from __future__ import annotations

import pytest

from engine import llama
from engine.config import ContextShape
from engine.llama import Batch, Candidates, Context, Sampler
from engine.messages import SamplerSettings
from gateway.formats.structured import grammar_for
from loadtest.workloads import RECORD_SCHEMA


def generate(model, settings: SamplerSettings, n_tokens: int = 120, may_end: bool = True
             ) -> tuple[list[int], int]:
    """Greedy tokens for a JSON prompt, and how many picks masked the whole vocabulary.
    may_end=False: the end of generation is banned (ignore_eos) until the grammar's end."""
    ctx, batch = Context(model, ContextShape(2048, 1, 512, 2, flash_attn=True)), Batch(512)
    sampler = Sampler(settings, model, 2048, ban_eog=not may_end)
    candidates = Candidates(model.n_vocab)
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
            token = sampler.sample(ctx, index, candidates, allow_eog=may_end)
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
@pytest.mark.parametrize("may_end", [True, False])
def test_greedy_grammar_picks_equal_a_full_pass(local_model, monkeypatch, penalties, may_end):
    settings = SamplerSettings(temperature=0.0, **penalties, grammar=grammar_for(
        "json_schema", {"name": "record", "schema": RECORD_SCHEMA}))
    fast, fast_passes = generate(local_model, settings, may_end=may_end)
    monkeypatch.setattr(llama, "GREEDY_TRIES", 1)  # past the pick, one partial sort at once
    partial_sort, _ = generate(local_model, settings, may_end=may_end)
    monkeypatch.setattr(llama, "GREEDY_SEARCH", 0)  # every rejected pick masks everything
    full, full_passes = generate(local_model, settings, may_end=may_end)
    assert fast == partial_sort == full and len(fast) > 20
    assert full_passes > 2 * fast_passes
