"""The prefix cache on recurrent (Mamba) and hybrid (LFM2: short convolutions beside attention)
models, on tiny random-weight GGUFs (tests/tiny_models.py). A recurrent layer keeps one state
per sequence, not KV per position: blocks keep the state after them where a prompt chunk or an
answer's block ended, and a prefix resumes at the deepest such block. Outputs and logprobs
after a hit equal a cold prefill's, and `cached_tokens` says what was really skipped."""

from __future__ import annotations

import pytest

from loadtest.gateway_process import GatewayProcess, started_together
from tests.conftest import (
    across_a_restart,
    cached_and_uncached,
    greedy_completion,
    openai_client,
)
from tests.test_redis_tier import tier, wait_stored
from tests.test_workers import TWO_WORKERS, wait_for_health
from tests.tiny_models import tiny_model

ARGS = ("--parallel", "4", "--ctx-size", "4096", "--no-flash-attn")
BLOCK = 64
WORDS = ["harbour", "ferry", "lighthouse", "keeper", "storm", "ship", "weather", "log", "tide",
         "anchor"]


def text(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] + str(i % 13) for i in range(n_words))


@pytest.fixture(scope="module", params=["mamba", "lfm2"])
def gateways(request):
    yield from cached_and_uncached(tiny_model(request.param), *ARGS)


def complete(server: GatewayProcess, prompt: str, max_tokens: int = 12):
    return greedy_completion(server, prompt, max_tokens, logprobs=3)


def computed(server: GatewayProcess) -> float:
    return server.settled()["prefixgate_prompt_tokens_computed_total"]


def test_the_cache_keeps_recurrent_states(gateways):
    cached, _ = gateways
    assert "recurrent model (a state of" in cached.log_path.read_text()


def test_a_shared_prefix_resumes_from_a_kept_state_exactly(gateways):
    """The first prompt's chunks end at block boundaries, and one at the last boundary before
    its end: a second prompt sharing all of it but its last words resumes there."""
    cached, uncached = gateways
    prefix = text(300, 1)
    first = complete(cached, prefix + " and then the first ending")
    assert first[:2] == complete(uncached, prefix + " and then the first ending")[:2]
    before = computed(cached)
    warm = complete(cached, prefix + " but later a second ending")
    cold = complete(uncached, prefix + " but later a second ending")
    assert warm[:2] == cold[:2]  # the text, and every top-3 logprob
    usage = warm[2]
    skipped = usage.prompt_tokens_details.cached_tokens
    assert skipped > 0 and skipped % BLOCK == 0  # a block boundary...
    assert usage.prompt_tokens - skipped <= BLOCK + 8  # ...the last before the endings part
    # cached_tokens is what was really skipped: the rest was computed.
    assert computed(cached) - before == usage.prompt_tokens - skipped
    assert cold[2].prompt_tokens_details.cached_tokens == 0


def test_a_chat_resumes_after_its_previous_answer(gateways):
    """The state after a request's last computed position is kept when it ends: the next turn
    of a chat resumes from it when it starts with that turn's tokens. The answer was computed
    a token per step, which rounds a hybrid's attention KV differently from a prefill of the
    same tokens (as on Gemma 3, tests/test_sliding_window.py): the text is compared here."""
    cached, uncached = gateways
    prompt = text(150, 2)
    answer, _, usage = complete(cached, prompt, max_tokens=20)
    first_end = usage.prompt_tokens + usage.completion_tokens - 1  # the last token is not run
    follow_up = prompt + answer + " and the keeper answers"
    warm = complete(cached, follow_up)
    cold = complete(uncached, follow_up)
    assert warm[0] == cold[0]
    # Where the retokenized answer still equals the generated tokens, up to the first end.
    assert warm[2].prompt_tokens_details.cached_tokens >= first_end // BLOCK * BLOCK
    metrics = cached.settled()
    assert metrics["prefixgate_prefix_cache_load_failures_total"] == 0
    assert metrics["prefixgate_kv_pool_blocks_held"] == 0


def test_a_restart_keeps_the_states(tmp_path):
    path = tiny_model("lfm2")
    args = (*ARGS, "--cache-dir", str(tmp_path))
    prompt = text(200, 3)
    before, after = across_a_restart(path, args, lambda server: complete(server, prompt))
    assert after[:2] == before[:2]
    usage = after[2]
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 2) // BLOCK * BLOCK


def test_a_state_one_worker_kept_is_loaded_by_the_other():
    path = tiny_model("lfm2")
    server = GatewayProcess(path, *TWO_WORKERS)
    try:
        wait_for_health(server, "ok")  # both workers: round-robin's order is then known
        prefix = text(300, 4)
        first = complete(server, prefix + " the first ending")
        second = complete(server, prefix + " the first ending")
        assert set(server.per_worker("prefixgate_routing_decisions_total").values()) == {1}
        assert second[2].prompt_tokens_details.cached_tokens \
            == (second[2].prompt_tokens - 2) // BLOCK * BLOCK
        assert second[:2] == first[:2]
        assert server.settled()["prefixgate_kv_pool_blocks_held"] == 0
    finally:
        server.stop()


def test_a_state_one_gateway_kept_is_loaded_by_another_through_redis(redis_url):
    url, _ = redis_url
    path = tiny_model("mamba")
    first, second = started_together(*(GatewayProcess(path, *ARGS, "--redis-url", url,
                                                      wait=False) for _ in range(2)))
    try:
        prompt = text(300, 5)
        cold = complete(first, prompt)
        wait_stored(first, cold[2].prompt_tokens // BLOCK)
        warm = complete(second, prompt)
        assert warm[2].prompt_tokens_details.cached_tokens \
            == (warm[2].prompt_tokens - 2) // BLOCK * BLOCK
        assert tier(second, "hits")["redis"] == warm[2].prompt_tokens_details.cached_tokens
        assert warm[:2] == cold[:2]
    finally:
        first.stop()
        second.stop()


def test_a_pinned_state_survives_a_flood(tmp_path):
    """A pool of about 60 blocks: the pinned prompt's blocks and states stay while 12 other
    prompts of 5 blocks each go through."""
    path = tiny_model("lfm2")
    server = GatewayProcess(path, *ARGS, "--cache-mb", "1", "--pin-budget-mb", "1")
    try:
        def ask(prompt: str, retention: str = "in_memory") -> int:
            r = openai_client(server).completions.create(
                model=server.model_name, prompt=prompt, max_tokens=4, temperature=0,
                extra_body={"prompt_cache_retention": retention})
            return r.usage.prompt_tokens_details.cached_tokens

        pinned = text(250, 6)
        ask(pinned, "24h")
        for seed in range(12):
            ask(f"Flood {seed}: " + text(250, 7 + seed))
        assert server.settled()["prefixgate_prefix_cache_evictions_total"] > 0
        assert ask(pinned) > 200
        assert ask("Flood 0: " + text(250, 7)) == 0  # evicted
    finally:
        server.stop()
