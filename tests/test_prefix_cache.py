"""The prefix cache through the real server: cached output equals uncached output token for token
on the test chats, and `cached_tokens` says how much of each prompt was loaded or shared instead
of computed. In the two modes that promise it: `--deterministic`, and the default mode with
`--no-flash-attn`. With flash attention (the default) a cached prompt's last tokens take another
attention kernel than the whole prompt did (see docs/architecture.md, Engine modes), so there
the cache is checked against llama-cpp-python's exact tokens for short prompts
(tests/test_reference.py) and its greedy choices within rounding noise
(tests/test_preemption.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from cache.tokens import most_cached
from loadtest.gateway_process import GatewayProcess, started_together
from tests.conftest import DEFAULT_ARGS, openai_client
from tests.test_disconnect import abandon_many

SYSTEM = ("Marigold Books, a small bookshop, is where you assist. The shop opens at nine "
          "and closes at six, sells new and second-hand books, runs a reading club on "
          "Thursdays and ships parcels within the country. Answer briefly and politely. ") * 3


def ask(client, model, messages, max_tokens=24):
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                       temperature=0)
    return r.choices[0].message.content, r.usage


def system_chat(question, system=SYSTEM):
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


EXACT_DEFAULT_ARGS = (*DEFAULT_ARGS, "--no-flash-attn")


@pytest.fixture(scope="module")
def fresh_default_gateways(model_path):
    """Default-mode gateways of this module's own. In the default mode a block computed while
    other requests shared the batch carries that batch's rounding, so the comparisons here need
    a pool that only this module's sequential requests filled."""
    servers = started_together(
        GatewayProcess(model_path, *EXACT_DEFAULT_ARGS, wait=False),
        GatewayProcess(model_path, *EXACT_DEFAULT_ARGS, "--no-prefix-cache", wait=False))
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture(params=["--no-flash-attn", "deterministic"])
def clients(request):
    if request.param == "--no-flash-attn":
        servers = request.getfixturevalue("fresh_default_gateways")
    else:
        servers = (request.getfixturevalue("deterministic_gateway"),
                   request.getfixturevalue("deterministic_uncached_gateway"))
    return tuple(openai_client(server) for server in servers)


def test_repeated_and_shared_prompts_match_uncached(clients, model_name):
    client, uncached_client = clients
    first = system_chat("When do you open?")
    text, usage = ask(client, model_name, first)
    assert usage.prompt_tokens_details.cached_tokens < 8  # cold: the chat template's opening
    again, usage = ask(client, model_name, first)
    assert again == text
    # All but the last eight tokens, rounded down to a resume point: see cache/tokens.py.
    assert usage.prompt_tokens_details.cached_tokens == most_cached(usage.prompt_tokens)
    for question in ["Do you sell used books?", "What happens on Thursdays?"]:
        warm, usage = ask(client, model_name, system_chat(question))
        cold, _ = ask(uncached_client, model_name, system_chat(question))
        assert warm == cold
        # The system prompt is shared; the question is not.
        assert usage.prompt_tokens - 20 < usage.prompt_tokens_details.cached_tokens \
            <= most_cached(usage.prompt_tokens)


def test_unshared_prompt_is_computed_and_exact(clients, model_name):
    client, uncached_client = clients
    messages = system_chat("Describe a lighthouse in a storm.", "Zebras quietly juggle.")
    warm, usage = ask(client, model_name, messages)
    assert usage.prompt_tokens_details.cached_tokens < 8  # the chat template's opening only
    assert warm == ask(uncached_client, model_name, messages)[0]


def test_multi_turn_chat_hits_its_history_and_stays_exact(clients, model_name):
    client, uncached_client = clients
    history = [{"role": "system", "content": SYSTEM}]
    previous_prompt = 0
    for turn, question in enumerate(["Hello!", "Can you ship a book to Lyon?",
                                     "How much would it cost?", "Thank you."]):
        history.append({"role": "user", "content": question})
        warm, usage = ask(client, model_name, history, max_tokens=32)
        cold, cold_usage = ask(uncached_client, model_name, history, max_tokens=32)
        assert warm == cold, f"turn {turn}"
        assert cold_usage.prompt_tokens_details.cached_tokens == 0
        # The previous prompt and the answer to it are reused.
        assert usage.prompt_tokens_details.cached_tokens >= previous_prompt
        previous_prompt = usage.prompt_tokens
        history.append({"role": "assistant", "content": warm})


def test_concurrent_requests_share_a_new_prefix_exactly(deterministic_gateway,
                                                        deterministic_uncached_gateway,
                                                        model_name):
    gateway = deterministic_gateway
    client, uncached_client = (openai_client(deterministic_gateway),
                               openai_client(deterministic_uncached_gateway))
    system = "You are a weather bot for the city of Tampere. " * 12
    questions = [f"What is the forecast for day {i}?" for i in range(8)]

    def run(c, q):
        return ask(c, model_name, system_chat(q, system))

    with ThreadPoolExecutor(8) as pool:
        warm = list(pool.map(lambda q: run(client, q), questions))
        cold = list(pool.map(lambda q: run(uncached_client, q), questions))
    assert [w[0] for w in warm] == [c[0] for c in cold]
    # Arrivals during the first prefill wait for its blocks instead of computing them again.
    assert sum(w[1].prompt_tokens_details.cached_tokens > 100 for w in warm) >= 6
    assert gateway.settled()["prefixgate_kv_pool_blocks_held"] == 0


def test_concurrent_requests_share_live_cells(client, model_name, gateway):
    """Default mode: arrivals take the cells of a prefix another request holds or is computing
    right now (seq_cp), without copies from the pool or computing it again."""
    system = "You are a ferry timetable bot for the harbour of Turku. " * 12
    questions = [f"When does ferry {i} leave?" for i in range(8)]
    before = gateway.metrics()["prefixgate_prefix_shared_tokens_total"]
    with ThreadPoolExecutor(8) as pool:
        warm = list(pool.map(lambda q: ask(client, model_name, system_chat(q, system)),
                             questions))
    assert all(text for text, _ in warm)
    assert sum(usage.prompt_tokens_details.cached_tokens > 100 for _, usage in warm) >= 6
    metrics = gateway.settled()
    assert metrics["prefixgate_prefix_shared_tokens_total"] - before > 600
    assert metrics["prefixgate_kv_cells_used"] == 0
    assert metrics["prefixgate_kv_pool_blocks_held"] == 0


@pytest.fixture(scope="module")
def small_pool_gateway(model_path):
    # 6 MiB holds 4 F16 blocks of 64 tokens: not even two of the prompts below.
    server = GatewayProcess(model_path, "--parallel", "4", "--ctx-size", "1024",
                            "--cache-mb", "6")
    yield server
    server.stop()


def test_eviction_under_a_small_pool(small_pool_gateway, uncached_client, model_name):
    client = openai.OpenAI(base_url=small_pool_gateway.base_url + "/v1", api_key="unused",
                           max_retries=0)
    # Distinct first words, so that no prompt reuses (and so refreshes) another's blocks.
    prompts = [f"{topic} matter to people for many reasons. " * 12 for topic in
               ["Apples", "Bridges", "Clouds", "Dragons", "Engines", "Forests"]]

    def complete(c, prompt):
        r = c.completions.create(model=model_name, prompt=prompt, max_tokens=24, temperature=0)
        return r.choices[0].text, r.usage

    for prompt in prompts:
        assert complete(client, prompt)[0] == complete(uncached_client, prompt)[0]
    metrics = small_pool_gateway.settled()
    assert metrics["prefixgate_prefix_cache_evictions_total"] > 0
    assert metrics["prefixgate_kv_pool_bytes_capacity"] <= 6 << 20
    assert metrics["prefixgate_kv_pool_blocks_used"] <= 4
    assert metrics["prefixgate_kv_pool_blocks_held"] == 0
    # The most recently used prefix survives; the oldest was evicted.
    usage = complete(client, prompts[-1])[1]
    assert usage.prompt_tokens_details.cached_tokens == most_cached(usage.prompt_tokens)
    assert complete(client, prompts[0])[1].prompt_tokens_details.cached_tokens == 0


def test_abandoned_requests_return_the_pool_to_idle(gateway: GatewayProcess):
    abandon_many(gateway.base_url, gateway.model_name)
    metrics = gateway.settled(timeout=10)
    assert metrics["prefixgate_kv_pool_blocks_held"] == 0
    assert metrics["prefixgate_kv_pool_blocks_used"] > 0  # what they computed stays cached
