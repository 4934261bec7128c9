"""Greedy outputs through the gateway equal llama-cpp-python's own, token for token."""

from __future__ import annotations

import pytest
from llama_cpp import Llama

from gateway.llama import KV_CACHE_TYPE

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three prime numbers."}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Explain what a radix tree is in one sentence."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."},
     {"role": "assistant", "content": "Buenos días."},
     {"role": "user", "content": "And into French?"}],
    [{"role": "user", "content": "Count from one to twenty in words."}],
]
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Once upon a time, in a land far away,"]


@pytest.fixture(scope="module")
def reference(model_path) -> Llama:
    # Same KV type and attention kernel as the engine, one sequence, whole-prompt prefill.
    return Llama(str(model_path), n_ctx=2048, n_threads=2, flash_attn=True,
                 type_k=KV_CACHE_TYPE, type_v=KV_CACHE_TYPE, verbose=False)


@pytest.mark.parametrize("messages", CHATS)
def test_chat_equals_llama_cpp_python(reference, client, model_name, messages):
    expected = reference.create_chat_completion(messages=messages, max_tokens=40,
                                                temperature=0.0)
    got = client.chat.completions.create(model=model_name, messages=messages, max_tokens=40,
                                         temperature=0)
    assert got.choices[0].message.content == expected["choices"][0]["message"]["content"]
    assert got.usage.prompt_tokens == expected["usage"]["prompt_tokens"]
    assert got.usage.completion_tokens == expected["usage"]["completion_tokens"]
    assert got.choices[0].finish_reason == expected["choices"][0]["finish_reason"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_equals_llama_cpp_python(reference, client, model_name, prompt):
    expected = reference.create_completion(prompt, max_tokens=24, temperature=0.0)
    got = client.completions.create(model=model_name, prompt=prompt, max_tokens=24,
                                    temperature=0)
    assert got.choices[0].text == expected["choices"][0]["text"]
    assert got.usage.prompt_tokens == expected["usage"]["prompt_tokens"]
    assert got.usage.completion_tokens == expected["usage"]["completion_tokens"]
