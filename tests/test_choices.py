"""n > 1: the prompt is computed once and shared by every choice; each choice samples with its
own seed, so they differ, and the same seed gives the same choices again."""

from __future__ import annotations

import pytest

from cache.tokens import most_cached
from loadtest.gateway_process import GatewayProcess
from tests.conftest import openai_client

PROMPT = "Write one sentence about the sea near Helsinki. " * 12  # ~120 tokens


@pytest.mark.parametrize("mode", [(), ("--deterministic",)], ids=["default", "deterministic"])
def test_n_choices_share_one_prefill(model_path, model_name, mode):
    server = GatewayProcess(model_path, "--parallel", "4", "--ctx-size", "8192", *mode)
    try:
        client = openai_client(server)
        before = server.metrics()["prefixgate_prompt_tokens_computed_total"]
        r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=16, n=4,
                                      temperature=1.0, seed=7)
        computed = server.metrics()["prefixgate_prompt_tokens_computed_total"] - before
        assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
        assert r.usage.completion_tokens == 4 * 16 or any(c.finish_reason == "stop"
                                                          for c in r.choices)
        # One prefill: the prompt once, plus the tail each other choice computes itself.
        prompt = r.usage.prompt_tokens
        assert computed <= prompt + 3 * (prompt - most_cached(prompt))
        texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
        assert len(set(texts)) > 1  # temperature 1, seeds 7..10
        if mode:  # the same seeds, the same choices: exact where batching cannot change them
            again = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=16,
                                              n=4, temperature=1.0, seed=7)
            assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts
        server.settled()
    finally:
        server.stop()


def test_streamed_choices_carry_their_index(client, model_name):
    texts = {}
    for chunk in client.chat.completions.create(
            model=model_name, max_tokens=8, n=3, temperature=1.0, seed=1, stream=True,
            messages=[{"role": "user", "content": "Say something."}]):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert sorted(texts) == [0, 1, 2] and all(texts.values())
