"""Greedy outputs through the gateway equal llama-cpp-python's own with its default settings
(F16 KV, flash attention off, n_batch 512), token for token, for a request run alone: computed,
and again with its prompt taken from the prefix cache."""

from __future__ import annotations

import pytest
from llama_cpp import Llama

from loadtest.gateway_process import GatewayProcess
from tests.conftest import DEFAULT_ARGS, openai_client

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
    # Longer than one 512-token prefill chunk.
    [{"role": "system", "content": "You are a meticulous archivist. " + "The archive holds "
      "letters, maps, ledgers and photographs from three centuries of the town's history. " * 40},
     {"role": "user", "content": "Summarise what the archive holds."}],
]
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Once upon a time, in a land far away,"]


@pytest.fixture(scope="module")
def reference(model_path) -> Llama:
    """llama-cpp-python as a new user makes it: default settings, a context for the chats."""
    return Llama(str(model_path), n_ctx=4096, verbose=False)


@pytest.fixture(scope="module")
def solo_client(model_path):
    """A cached gateway of this module's own, whose pool only requests run alone fill: blocks
    computed beside other requests carry their batch's rounding (see README, Engine modes)."""
    server = GatewayProcess(model_path, *DEFAULT_ARGS)
    yield openai_client(server)
    server.stop()


@pytest.mark.parametrize("messages", CHATS)
def test_chat_equals_llama_cpp_python(reference, solo_client, model_name, messages):
    reference.reset()  # a fresh call, not a continuation of the previous test's prompt
    expected = reference.create_chat_completion(messages=messages, max_tokens=40,
                                                temperature=0.0)
    for attempt in ("computed", "cached"):
        got = solo_client.chat.completions.create(model=model_name, messages=messages,
                                                  max_tokens=40, temperature=0)
        assert got.choices[0].message.content == expected["choices"][0]["message"]["content"], \
            attempt
        assert got.usage.prompt_tokens == expected["usage"]["prompt_tokens"]
        assert got.usage.completion_tokens == expected["usage"]["completion_tokens"]
        assert got.choices[0].finish_reason == expected["choices"][0]["finish_reason"]
    assert got.usage.prompt_tokens_details.cached_tokens == got.usage.prompt_tokens - 2


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_equals_llama_cpp_python(reference, uncached_client, model_name, prompt):
    client = uncached_client
    reference.reset()
    expected = reference.create_completion(prompt, max_tokens=24, temperature=0.0)
    got = client.completions.create(model=model_name, prompt=prompt, max_tokens=24,
                                    temperature=0)
    assert got.choices[0].text == expected["choices"][0]["text"]
    assert got.usage.prompt_tokens == expected["usage"]["prompt_tokens"]
    assert got.usage.completion_tokens == expected["usage"]["completion_tokens"]
