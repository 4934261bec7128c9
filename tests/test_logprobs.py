"""logprobs in OpenAI's shapes, from the model's own distribution: the chosen tokens' values
agree with llama-cpp-python's for the same greedy completion."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from llama_cpp import Llama

PROMPT = "The three largest cities of Finland are"


@pytest.fixture(scope="module")
def reference(model_path):
    return Llama(str(model_path), n_ctx=1024, logits_all=True, flash_attn=True,
                 n_threads=os.cpu_count(), verbose=False)


def test_completion_logprobs_agree_with_llama_cpp_python(client, model_name, reference):
    reference.reset()
    expected = reference.create_completion(PROMPT, max_tokens=12, temperature=0, logprobs=2)
    ours = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12,
                                     temperature=0, logprobs=2)
    got, want = ours.choices[0], expected["choices"][0]
    assert got.text == want["text"]
    np.testing.assert_allclose(got.logprobs.token_logprobs, want["logprobs"]["token_logprobs"],
                               atol=1e-3)
    assert got.logprobs.tokens == want["logprobs"]["tokens"]
    assert "".join(got.logprobs.tokens) == got.text
    assert got.logprobs.text_offset[0] == 0
    assert all(len(top) == 2 for top in got.logprobs.top_logprobs)


def test_chat_logprobs_whole_and_streamed(client, model_name):
    messages = [{"role": "user", "content": "Name a Finnish city."}]
    whole = client.chat.completions.create(model=model_name, messages=messages, max_tokens=10,
                                           temperature=0, logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert math.isclose(entry.logprob, tops[0], abs_tol=1e-6)  # greedy takes the likeliest
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
    assert "".join(e.token for e in content) == whole.choices[0].message.content
    streamed = [e for chunk in client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=10, temperature=0, logprobs=True,
        top_logprobs=3, stream=True) if chunk.choices and chunk.choices[0].logprobs
        for e in chunk.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == \
        [(e.token, round(e.logprob, 5)) for e in content]


def test_top_logprobs_needs_logprobs(client, model_name):
    import openai

    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=model_name, max_tokens=1, top_logprobs=2,
                                       messages=[{"role": "user", "content": "Hi"}])
    assert raised.value.body["param"] == "top_logprobs"
