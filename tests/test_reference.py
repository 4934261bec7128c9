"""Greedy outputs through the gateway equal llama-cpp-python's own, token for token, for a
request run alone. The default mode (F16 KV, flash attention on) matches llama-cpp-python with
`flash_attn=True`; `--no-flash-attn` matches its defaults (F16 KV, flash attention off, n_batch
512). Computed, always; with the prompt taken from the prefix cache, wherever the mode computes
the prompt's last tokens with the kernels llama-cpp-python uses for them (see
`exact_when_cached`)."""

from __future__ import annotations

import os

import pytest
from llama_cpp import Llama

from cache.tokens import most_cached
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


THREADS = os.cpu_count()  # the gateway's --threads
# mode -> (the gateway's extra flags, llama-cpp-python's flash_attn)
MODES = {"default": ((), True), "--no-flash-attn": (("--no-flash-attn",), False),
         "--speculation off": (("--speculation", "off"), True)}
N_BATCH = 512  # llama-cpp-python's prefill chunk, and the engine's --batch-tokens
FA_TILE_ROWS = 64  # llama.cpp's CPU flash attention is tiled from this many query rows on


def exact_when_cached(mode: str, n_prompt: int) -> bool:
    """A cached prompt's last 8-11 tokens are computed as one small batch. Without flash
    attention SmolLM2's kernels give a row the same sums in any batch of two rows or more. With
    it, attention takes a tiled kernel for 64 query rows or more and a row-by-row one below, so
    the tail's rows match llama-cpp-python's only when its last prefill chunk is also under 64."""
    return not MODES[mode][1] or (n_prompt - 1) % N_BATCH + 1 < FA_TILE_ROWS


@pytest.fixture(scope="module", params=list(MODES))
def mode(request) -> str:
    return request.param


def reference_llama(model_path, flash_attn: bool) -> Llama:
    """llama-cpp-python as a new user makes it, with the gateway's threads: flash attention
    splits a decode's work by thread, so its rounding depends on their number
    (llama-cpp-python decodes with half the cores by default)."""
    return Llama(str(model_path), n_ctx=4096, flash_attn=flash_attn, n_threads=THREADS,
                 verbose=False)


@pytest.fixture(scope="module")
def reference(model_path, mode) -> Llama:
    llm = reference_llama(model_path, MODES[mode][1])
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def flash_reference(model_path) -> Llama:
    """The reference of the default mode, for the uncached gateway of the session."""
    llm = reference_llama(model_path, True)
    yield llm
    llm.close()


def _gateway(model_path, mode: str, *args: str):
    server = GatewayProcess(model_path, *DEFAULT_ARGS, *MODES[mode][0], *args)
    yield openai_client(server)
    server.stop()


@pytest.fixture(scope="module")
def computing_client(request, model_path, mode):
    """Every prompt computed: no block of another prompt enters it. The default mode's is the
    session's uncached gateway, started with the same flags."""
    if not MODES[mode][0]:
        yield openai_client(request.getfixturevalue("uncached_gateway"))
        return
    yield from _gateway(model_path, mode, "--no-prefix-cache")


@pytest.fixture(scope="module")
def solo_client(model_path, mode):
    """A cached gateway of this module's own, whose pool only requests run alone fill: blocks
    computed beside other requests carry their batch's rounding (see docs/architecture.md,
    Engine modes)."""
    yield from _gateway(model_path, mode)


@pytest.mark.parametrize("messages", CHATS)
def test_chat_equals_llama_cpp_python(reference, computing_client, solo_client, mode,
                                      model_name, messages):
    reference.reset()  # a fresh call, not a continuation of the previous test's prompt
    expected = reference.create_chat_completion(messages=messages, max_tokens=40,
                                                temperature=0.0)
    want = expected["choices"][0]

    def ask(client):
        return client.chat.completions.create(model=model_name, messages=messages,
                                              max_tokens=40, temperature=0)

    computed = ask(computing_client)
    ask(solo_client)  # computes the prompt, and stores its blocks
    cached = ask(solo_client)
    usage = cached.usage
    assert usage.prompt_tokens_details.cached_tokens == most_cached(usage.prompt_tokens)
    attempts = {"computed": computed}
    if exact_when_cached(mode, expected["usage"]["prompt_tokens"]):
        attempts["cached"] = cached
    for attempt, got in attempts.items():
        assert got.choices[0].message.content == want["message"]["content"], attempt
        assert got.usage.prompt_tokens == expected["usage"]["prompt_tokens"]
        assert got.usage.completion_tokens == expected["usage"]["completion_tokens"]
        assert got.choices[0].finish_reason == want["finish_reason"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_equals_llama_cpp_python(flash_reference, uncached_client, model_name,
                                            prompt):
    client, reference = uncached_client, flash_reference
    reference.reset()
    expected = reference.create_completion(prompt, max_tokens=24, temperature=0.0)
    got = client.completions.create(model=model_name, prompt=prompt, max_tokens=24,
                                    temperature=0)
    assert got.choices[0].text == expected["choices"][0]["text"]
    assert got.usage.prompt_tokens == expected["usage"]["prompt_tokens"]
    assert got.usage.completion_tokens == expected["usage"]["completion_tokens"]
