"""The Redis copy of stored responses (gateway/responses/shared_store.py) with a real redis-server
on loopback: one writer thread whatever Redis's speed, deletes that a late store never undoes,
conversations encrypted at rest, and none in Redis without a key."""

from __future__ import annotations

import threading

import openai
import pytest
import redis

from cache.redis_tier import TierConfig
from gateway.core.conversation import Message
from gateway.responses.shared_store import DELETED, QUEUE_RESPONSES, SharedResponses
from gateway.responses.store import StoredResponse
from loadtest.gateway_process import GatewayProcess
from tests.test_redis_tier import wait_stored

SECRET = "The harbour gate code is 4711-ALPHA."


def stored(i: int, owner: str = "tenant-a") -> StoredResponse:
    messages = [Message(role="user", content=f"{SECRET} ({i})"),
                Message(role="assistant", content="Noted.")]
    return StoredResponse.make(f"resp_{i:032x}", owner, {"id": f"resp_{i:032x}"},
                               [{"type": "message", "role": "user", "id": "msg_1",
                                 "content": [{"type": "input_text", "text": SECRET}]}],
                               messages, None, "", f"user: {SECRET}\nassistant: Noted.\n",
                               list(range(1000, 1040)), fingerprint="a fingerprint")


def shared(url: str, key: bytes = b"key-one") -> SharedResponses:
    return SharedResponses(TierConfig(url, key=key), ttl_seconds=3600)


def test_one_writer_thread_and_a_bounded_queue_while_redis_is_slow(redis_url):
    """Writes stalled (CLIENT PAUSE WRITE): 300 stores start no thread each (they did: one
    per store), the queue keeps at most QUEUE_RESPONSES and drops the rest, and the writer
    goes on once Redis does."""
    url, _ = redis_url
    admin = redis.Redis.from_url(url)
    replica = shared(url)
    threads = threading.active_count()
    admin.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
    try:
        for i in range(300):
            replica.put(stored(i))
        assert threading.active_count() == threads
        assert 300 - QUEUE_RESPONSES - 16 <= replica.dropped < 300
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
    assert replica.flush(timeout=60)  # the backlog, then a store of its own
    late = stored(1000)
    replica.put(late)
    assert replica.flush(timeout=60)
    assert replica.get(late.id).all_tokens() == late.all_tokens()
    replica.close()


def test_a_late_store_never_brings_a_deleted_response_back(redis_url):
    """Deleted through one replica before another's store of it reached Redis: the store
    finds the tombstone and leaves it (it overwrote it, and the response came back on every
    replica)."""
    url, _ = redis_url
    first, second = shared(url), shared(url)
    response = stored(1)
    second.delete(response.id)
    first.put(response)
    assert first.flush(timeout=60)
    assert first.get(response.id) is DELETED and second.get(response.id) is DELETED
    # Stored, then deleted, then stored again by a replica that missed the delete: deleted.
    other = stored(2)
    first.put(other)
    assert first.flush(timeout=60)
    assert second.get(other.id).id == other.id
    second.delete(other.id)
    first.put(other)
    assert first.flush(timeout=60)
    assert first.get(other.id) is DELETED
    first.close()
    second.close()


def test_conversations_are_encrypted_at_rest(redis_url):
    """Redis holds no text of a conversation (it held it as plain JSON); the value reads back
    whole with the key, and is a miss with another key or once tampered with."""
    url, _ = redis_url
    replica = shared(url)
    response = stored(7)
    replica.put(response)
    assert replica.flush(timeout=60)
    raw = redis.Redis.from_url(url)
    (key,) = raw.keys("prefixgate:*")
    value = raw.get(key)
    assert b"4711" not in value and b"harbour" not in value and b"Noted" not in value
    got = replica.get(response.id)
    assert got.conversation() == response.conversation() and got.owner == "tenant-a"
    assert got.all_tokens() == response.all_tokens() and got.all_text() == response.all_text()
    assert shared(url, key=b"key-two").get(response.id) is None
    raw.set(key, value[:-1] + bytes([value[-1] ^ 1]))
    assert replica.get(response.id) is None
    raw.set(key, value)
    raw.rename(key, key[:-1] + b"0")  # moved to another id: refused too
    assert replica.get(response.id[:-1] + "0") is None
    replica.close()


def test_without_a_key_no_conversation_goes_to_redis(redis_url, model_path):
    """--redis-url without --redis-key: the KV tier still shares blocks, the stored responses
    stay on the replica (it put them in Redis as plain text), and the start-up log says so."""
    url, _ = redis_url
    server = GatewayProcess(model_path, "--parallel", "2", "--ctx-size", "2048",
                            "--redis-url", url)
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        created = client.responses.create(model=server.model_name, max_output_tokens=4,
                                          input=f"{SECRET} " * 12)
        wait_stored(server, 1)  # the KV tier wrote its blocks
        assert client.responses.retrieve(created.id).id == created.id  # kept on the replica
        raw = redis.Redis.from_url(url)
        assert not raw.keys("prefixgate:*responses*")
        log = server.log_path.read_text(errors="replace")
        assert "stored responses stay on this replica" in log
    finally:
        server.stop()


@pytest.mark.parametrize("key", [None, b""])
def test_the_redis_copy_needs_a_key(redis_url, key):
    url, _ = redis_url
    with pytest.raises(ValueError, match="--redis-key"):
        shared(url, key=key)
