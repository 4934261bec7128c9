"""The Redis tier with a real redis-server on loopback: a prefix one gateway computed is loaded
by another that shares no arena with it; a value that does not verify is never loaded; Redis
going away costs a miss, not a failed or stalled request."""

from __future__ import annotations

import threading
import time

import numpy as np
import openai
import pytest
import redis

from cache.index import CacheIndex
from cache.redis_tier import BREAKER_FAILURES, RedisTier, TierConfig
from gateway.cli import build_parser, server_config
from gateway.workers.model_store import default_model_path
from loadtest.gateway_process import GatewayProcess, started_together
from tests.conftest import DETERMINISTIC_ARGS, openai_client
from tests.test_prefix_cache import ask, system_chat

SYSTEM = "You are the pilot station's assistant in the archipelago of Åland. Be brief. " * 10
QUESTION = "Where do the pilots board?"


def tier(server: GatewayProcess, name: str) -> dict[str, float]:
    return {s.labels["tier"]: s.value for s in server._samples()
            if s.name == f"prefixgate_prefix_cache_tier_{name}_total"}


def wait_stored(server: GatewayProcess, blocks: int) -> None:
    deadline = time.monotonic() + 30
    while tier(server, "stores")["redis"] < blocks:
        assert time.monotonic() < deadline, "the blocks never reached Redis"
        time.sleep(0.05)


def test_a_prefix_one_gateway_computed_is_loaded_by_another(redis_url, model_path, model_name):
    url, _ = redis_url
    first, second = started_together(*(
        GatewayProcess(model_path, *DETERMINISTIC_ARGS, "--redis-url", url, wait=False)
        for _ in range(2)))
    try:
        text, usage = ask(openai_client(first), model_name, system_chat(QUESTION, SYSTEM))
        assert usage.prompt_tokens_details.cached_tokens < 8
        wait_stored(first, usage.prompt_tokens // 64)
        again, usage = ask(openai_client(second), model_name, system_chat(QUESTION, SYSTEM))
        assert usage.prompt_tokens_details.cached_tokens > 100
        assert again == text  # deterministic mode: exact
        assert tier(second, "hits")["redis"] == usage.prompt_tokens_details.cached_tokens
        # Counted once: Redis's tokens reached the worker through the pool, not as pool hits.
        assert tier(second, "hits")["pool"] == 0
        second.settled()
    finally:
        first.stop()
        second.stop()


def test_values_that_do_not_verify_are_never_loaded(redis_url, model_path, model_name):
    url, _ = redis_url
    client = redis.Redis.from_url(url)
    writer = GatewayProcess(model_path, *DETERMINISTIC_ARGS, "--redis-url", url)
    try:
        text, usage = ask(openai_client(writer), model_name, system_chat(QUESTION, SYSTEM))
        wait_stored(writer, usage.prompt_tokens // 64)
    finally:
        writer.stop()
    written = {key: client.get(key) for key in client.keys("prefixgate:*")}
    # Another model or KV layout (the default mode's F16 blocks): its keys carry its own
    # fingerprint. Copied under those keys, the values still say whose they are: not loaded.
    other = GatewayProcess(model_path, "--redis-url", url)
    try:
        ask(openai_client(other), model_name, system_chat("Something else entirely?"))
        wait_stored(other, 1)
        theirs = next(k for k in client.keys("prefixgate:*") if k not in written)
        prefix = theirs.rsplit(b":", 1)[0]
        for key, value in written.items():
            client.set(prefix + b":" + key.rsplit(b":", 1)[1], value)
        _, usage = ask(openai_client(other), model_name, system_chat(QUESTION, SYSTEM))
        assert usage.prompt_tokens_details.cached_tokens < 8
        assert tier(other, "errors")["redis"] >= 1 and tier(other, "hits")["redis"] == 0
    finally:
        other.stop()
    # Corrupted in place (a token changed): detected, ignored, computed instead.
    for key, value in written.items():
        client.set(key, value[:40] + bytes([value[40] ^ 0xFF]) + value[41:])
    fresh = GatewayProcess(model_path, *DETERMINISTIC_ARGS, "--redis-url", url)
    try:
        again, usage = ask(openai_client(fresh), model_name, system_chat(QUESTION, SYSTEM))
        assert usage.prompt_tokens_details.cached_tokens < 8
        assert again == text
        assert tier(fresh, "errors")["redis"] >= 1 and tier(fresh, "hits")["redis"] == 0
    finally:
        fresh.stop()


def test_redis_going_away_costs_a_miss_not_a_request(redis_url, model_path, model_name):
    url, redis_process = redis_url
    server = GatewayProcess(model_path, *DETERMINISTIC_ARGS, "--redis-url", url,
                            "--redis-timeout", "0.2")
    try:
        client = openai_client(server)
        ask(client, model_name, system_chat("A warm-up question?", SYSTEM))
        redis_process.kill()
        redis_process.wait()
        for i in range(5):  # all answered; the breaker opens after a few failures
            start = time.perf_counter()
            text, usage = ask(client, model_name, system_chat(f"Question {i}: tides?", "Cold. "
                                                              * 40))
            assert text is not None and time.perf_counter() - start < 30
        assert tier(server, "errors")["redis"] >= 1
        assert server.health()[1]["status"] == "ok"
        server.settled()
    finally:
        server.stop()


def test_the_breaker_opens_after_repeated_failures(redis_url):
    """What prefixgate_prefix_cache_tier_breaker_open reports: closed while Redis answers,
    open once it failed BREAKER_FAILURES times in a row."""
    url, redis_process = redis_url
    redis_tier = RedisTier(TierConfig(url), "a fingerprint", slot_bytes=16)
    key, tokens = bytes(16), np.arange(4, dtype=np.int32)
    try:
        assert redis_tier.fetch([key], [tokens]) == [] and not redis_tier.skipping()  # a miss
        redis_process.kill()
        redis_process.wait()
        for _ in range(BREAKER_FAILURES):
            assert not redis_tier.skipping()
            assert redis_tier.fetch([key], [tokens]) == []
        assert redis_tier.skipping() and redis_tier.stats.errors == BREAKER_FAILURES
    finally:
        redis_tier.close()


def test_a_stored_block_is_copied_for_redis_on_the_writer_thread_and_held_until_then(
        redis_url):
    """Storing a block takes the cache index's lock for its bookkeeping only: its bytes are read
    (copied, then signed) on the tier's writer thread, after commit_store returned, and its slot
    stays referenced until then, so that nothing rewrites it meanwhile."""
    url, _ = redis_url
    redis_tier = RedisTier(TierConfig(url, key=b"the-tier-secret"), "a fingerprint",
                           slot_bytes=16)
    reading, read = threading.Event(), threading.Event()
    readers = []

    class Block:
        """A block's bytes in the arena, noting which thread reads them, then waiting."""

        def __bytes__(self) -> bytes:
            readers.append(threading.current_thread().name)
            reading.set()
            assert read.wait(30)
            return bytes(range(16))

    index = CacheIndex(4, 4, on_stored=lambda key, tokens, slot, done: redis_tier.put(
        key, tokens, Block(), done))
    tokens = np.arange(4, dtype=np.int32)
    try:
        plan = index.plan_store(0, tokens, "", final=True, hold=False)
        index.commit_store(plan.plan_id, written=True)  # returns before the bytes are read
        assert reading.wait(30) and readers == ["redis-tier"]
        assert index.snapshot().blocks_held == 1 and index.problems({0}) == []
        read.set()
        deadline = time.monotonic() + 30
        while redis_tier.stats.stored_blocks < 1:
            assert time.monotonic() < deadline, "the block never reached Redis"
            time.sleep(0.01)
        assert index.snapshot().blocks_held == 0 and index.problems({0}) == []
        (key,) = index.chain_keys(tokens, "")
        assert redis_tier.fetch([key], [tokens]) == [bytes(range(16))]  # signed, verified
    finally:
        read.set()
        redis_tier.close()


def test_with_a_redis_key_only_values_signed_with_it_are_loaded(redis_url, model_path,
                                                                 model_name):
    """A writer without the key cannot plant KV: a value whose KV bytes were changed (its
    tokens and fingerprint intact, all an unsigned tier checks) is a miss, and so is anything
    written under another key."""
    url, _ = redis_url
    client = redis.Redis.from_url(url)
    signed = ("--redis-url", url, "--redis-key", "the-tier-secret")
    writer = GatewayProcess(model_path, *DETERMINISTIC_ARGS, *signed)
    try:
        text, usage = ask(openai_client(writer), model_name, system_chat(QUESTION, SYSTEM))
        wait_stored(writer, usage.prompt_tokens // 64)
    finally:
        writer.stop()
    other = GatewayProcess(model_path, *DETERMINISTIC_ARGS, "--redis-url", url, "--redis-key",
                           "another-secret")
    try:
        _, usage = ask(openai_client(other), model_name, system_chat(QUESTION, SYSTEM))
        assert usage.prompt_tokens_details.cached_tokens < 8
        assert tier(other, "errors")["redis"] >= 1 and tier(other, "hits")["redis"] == 0
    finally:
        other.stop()
    for key in client.keys("prefixgate:*"):
        value = client.get(key)
        client.set(key, value[:-100] + bytes([value[-100] ^ 0xFF]) + value[-99:])
    reader = GatewayProcess(model_path, *DETERMINISTIC_ARGS, *signed)
    try:
        again, usage = ask(openai_client(reader), model_name, system_chat(QUESTION, SYSTEM))
        assert usage.prompt_tokens_details.cached_tokens < 8 and again == text
        assert tier(reader, "errors")["redis"] >= 1 and tier(reader, "hits")["redis"] == 0
    finally:
        reader.stop()


def test_a_stored_response_is_continued_and_deleted_through_any_replica(redis_url, model_path):
    """Two gateways on one Redis: a response stored through one is retrieved and continued
    through the other, and once deleted through either it is gone on both (a tombstone). A
    gateway signing with another --redis-key finds nothing."""
    url, _ = redis_url
    args = ("--parallel", "2", "--ctx-size", "2048", "--redis-url", url, "--redis-key", "k1")
    first, second, other = started_together(
        *(GatewayProcess(model_path, *args, wait=False) for _ in range(2)),
        GatewayProcess(model_path, *args[:-1], "k2", wait=False))
    try:
        a, b, c = (openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0)
                   for s in (first, second, other))
        created = a.responses.create(model=first.model_name, max_output_tokens=8,
                                     input="Name a large city in France.")
        deadline = time.monotonic() + 10
        while True:  # written on a thread of its own
            try:
                got = b.responses.retrieve(created.id)
                break
            except openai.NotFoundError:
                assert time.monotonic() < deadline, "the response never reached Redis"
                time.sleep(0.05)
        assert got.output_text == created.output_text
        continued = b.responses.create(model=second.model_name, max_output_tokens=4,
                                       previous_response_id=created.id, input="And in Italy?")
        assert continued.usage.input_tokens > created.usage.input_tokens
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(created.id)  # signed with another key: not trusted
        b.responses.delete(created.id)
        with pytest.raises(openai.NotFoundError):
            a.responses.retrieve(created.id)  # its own copy is known to be gone
    finally:
        for server in (first, second, other):
            server.stop()


def test_with_write_back_a_block_reaches_redis_when_evicted_copied_before_its_slot_is_reused(
        redis_url):
    """--redis-write evict: storing a block queues nothing; evicting it queues a copy of its
    bytes taken under the index's lock, so the new block written into the freed slot at once
    (while the writer is busy) is not what Redis gets. Nothing stays held or queued."""
    url, _ = redis_url
    redis_tier = RedisTier(TierConfig(url, write="evict"), "a fingerprint", slot_bytes=16)
    arena = np.zeros((2, 16), np.uint8)
    index = CacheIndex(2, 4, on_evicted=lambda key, tokens, slot: redis_tier.put_evicted(
        key, tokens, arena[slot]))
    reading, read = threading.Event(), threading.Event()

    class Busy:
        """What keeps the writer busy until told: the first value it copies."""

        def __bytes__(self) -> bytes:
            reading.set()
            assert read.wait(30)
            return bytes(16)

    def store(tokens: np.ndarray, fill: int) -> None:
        plan = index.plan_store(0, tokens, "", final=True, hold=False)
        for slot in plan.slots:  # as a worker writes its plan's slots
            arena[slot] = fill
        index.commit_store(plan.plan_id, written=True)

    first, second, third = (np.arange(4, dtype=np.int32) + 10 * i for i in range(3))
    try:
        store(first, 1)
        store(second, 2)
        assert redis_tier._queue.empty() and index.snapshot().evictions == 0
        redis_tier.put(bytes(16), np.arange(4, dtype=np.int32), Busy(), lambda: None)
        assert reading.wait(30)
        store(third, 3)  # evicts the first, whose slot the third's bytes overwrite
        assert index.snapshot().evictions == 1
        read.set()
        deadline = time.monotonic() + 30
        while redis_tier.stats.stored_blocks < 2:
            assert time.monotonic() < deadline, "the evicted block never reached Redis"
            time.sleep(0.01)
        (key,) = index.chain_keys(first, "")
        assert redis_tier.fetch([key], [first]) == [bytes([1] * 16)]
        assert all(redis_tier.fetch(index.chain_keys(t, ""), [t]) == [] for t in (second,
                                                                                  third))
        assert redis_tier._queue.empty() and redis_tier.stats.dropped_blocks == 0
        assert index.snapshot().blocks_held == 0 and index.problems({0}) == []
    finally:
        read.set()
        redis_tier.close()


def test_a_dynamo_node_writes_back_at_eviction_and_a_plain_gateway_as_it_stores():
    parser = build_parser()

    def write(*flags: str) -> str:
        config = server_config(parser, parser.parse_args(
            ["--model", str(default_model_path()), "--redis-url", "redis://r:6379", *flags]))
        return config.models[0].workers.redis.write

    assert write() == "store" and write("--dynamo") == "evict"
    assert write("--dynamo", "--redis-write", "store") == "store"
    assert write("--redis-write", "evict") == "evict"


def test_evicted_blocks_alone_reach_redis_and_another_gateway_loads_them(redis_url, model_path,
                                                                         model_name):
    """A gateway writing back at eviction, with a pool of 4 blocks, serves six prompts: Redis
    then holds exactly the blocks it evicted (counted once it stopped, its queue drained),
    none of those still in its pool. A second gateway loads the first prompt, long evicted,
    from Redis, and finds nothing there for the last, which the first never evicted."""
    url, _ = redis_url
    # 6 MiB holds 4 F16 blocks of 64 tokens (tests/test_prefix_cache.py's small pool).
    small = ("--parallel", "2", "--ctx-size", "1024", "--cache-mb", "6", "--redis-url", url)
    prompts = [f"{topic} matter to people for many reasons. " * 12 for topic in
               ["Apples", "Bridges", "Clouds", "Dragons", "Engines", "Forests"]]

    def complete(server: GatewayProcess, prompt: str):
        return openai_client(server).completions.create(
            model=model_name, prompt=prompt, max_tokens=8, temperature=0).usage

    writer = GatewayProcess(model_path, *small, "--redis-write", "evict")
    try:
        for prompt in prompts:
            complete(writer, prompt)
        metrics = writer.settled()
    finally:
        writer.stop()  # the tier's writer finishes its queue
    evicted = metrics["prefixgate_prefix_cache_evictions_total"]
    assert evicted > 0 and metrics["prefixgate_kv_pool_blocks_used"] > 0
    assert len(redis.Redis.from_url(url).keys("prefixgate:*")) == evicted
    reader = GatewayProcess(model_path, *small)
    try:
        usage = complete(reader, prompts[0])
        assert usage.prompt_tokens_details.cached_tokens >= 64
        assert tier(reader, "hits")["redis"] == usage.prompt_tokens_details.cached_tokens
        assert complete(reader, prompts[-1]).prompt_tokens_details.cached_tokens == 0
        reader.settled()
    finally:
        reader.stop()
