"""Stored responses in Redis (`--redis-url` with `--redis-key`), so that any replica can
continue a conversation: written through on store, read on a local miss, deleted everywhere.

A GET or continuation asks Redis first: a response deleted through one replica leaves a
tombstone there, so it is gone on all of them; one Redis does not know (its write still under
way, dropped, or Redis down or slow past `--redis-timeout`) is served from the replica's own
copy.

Encrypted at rest: a value is AES-256-GCM under a key derived from `--redis-key` (HKDF-SHA256,
apart from the KV tier's HMAC), with its Redis key as associated data, so Redis holds no text
or token ids of a conversation, and a value that does not decrypt (written with another key,
altered, or moved to another id) is a miss. Without `--redis-key` stored responses are not put
in Redis at all (whole conversations, in plain text to whoever reads Redis): each replica keeps
its own, and the gateway says so at start.

Keys `prefixgate:v4:responses:<id>`; a value holds the stored response whole (its
conversation from the first turn: another replica may know no parent), its owner and its
model's fingerprint in it. Writes go through one thread from a bounded queue
(QUEUE_RESPONSES): never on a request's path, and a store when Redis is so slow that the queue
is full is dropped (`dropped`, a log line; the replica keeps its own copy). A store is a SET NX:
it never overwrites a value, so a delete's tombstone stays whatever store lands after it; a
delete writes over whatever is there.
Values and tombstones expire with `--response-store-hours`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading

import orjson
import redis
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from pydantic import ValidationError

from cache.redis_tier import TierConfig
from gateway.responses.store import StoredResponse

log = logging.getLogger(__name__)

QUEUE_RESPONSES = 256  # stores waiting for Redis; beyond, new ones are dropped
WRITE_BATCH = 16  # stores per pipelined write
_FORMAT = b"\x01"  # AES-256-GCM, a 12-byte nonce after this byte
_NONCE_BYTES = 12
TOMBSTONE = b"deleted"  # the plaintext of a delete (a response's JSON starts with "{")
DELETED = object()  # what get() answers for a response deleted through any replica


class SharedResponses:
    def __init__(self, config: TierConfig, ttl_seconds: float) -> None:
        if not config.key:
            raise ValueError("stored responses go to Redis only encrypted, with --redis-key")
        self._aead = AESGCM(HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                                 info=b"prefixgate stored responses v3").derive(config.key))
        self._ttl = max(1, int(ttl_seconds))
        self._prefix = b"prefixgate:v4:responses:"
        self._redis = redis.Redis.from_url(config.url, socket_timeout=config.timeout,
                                           socket_connect_timeout=config.timeout)
        self._writes = redis.Redis.from_url(config.url, socket_timeout=10,
                                            socket_connect_timeout=config.timeout * 5)
        self._queue: queue.Queue[StoredResponse | threading.Event | None] = \
            queue.Queue(QUEUE_RESPONSES)
        self.dropped = 0  # stores never written: the queue was full
        self._writer = threading.Thread(target=self._write_loop, name="redis-responses",
                                        daemon=True)
        self._writer.start()

    def put(self, entry: StoredResponse) -> None:
        """Queues it for the writer: the caller is the event loop."""
        try:
            self._queue.put_nowait(entry)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 100 == 0:
                log.warning("Redis is not keeping up with stored responses: %d not written "
                            "there (each replica still has its own)", self.dropped)

    def flush(self, timeout: float) -> bool:
        """Waits until what was queued before is written (or failed); False past `timeout`."""
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            batch: list[StoredResponse] = []
            flushed: list[threading.Event] = []
            while item is not None:
                if isinstance(item, threading.Event):
                    flushed.append(item)
                else:
                    batch.append(item)
                if len(batch) >= WRITE_BATCH or self._queue.empty():
                    break
                item = self._queue.get_nowait()
            if batch:
                self._write(batch)
            for done in flushed:
                done.set()
            if item is None:
                return

    def _write(self, batch: list[StoredResponse]) -> None:
        try:
            with self._writes.pipeline(transaction=False) as pipe:
                for entry in batch:
                    key = self._key(entry.id)
                    pipe.set(key, self._seal(key, orjson.dumps(entry.to_json())), nx=True,
                             ex=self._ttl)
                pipe.execute()
        except redis.RedisError as exc:
            log.warning("storing %d responses in Redis failed: %s", len(batch), exc)
        except Exception:  # the writer outlives anything one batch does
            log.exception("storing %d responses in Redis failed", len(batch))

    def get(self, response_id: str) -> StoredResponse | object | None:
        """The stored response; DELETED; or None if Redis has none that decrypts. RedisError
        when Redis does not answer (the caller then trusts its own copy)."""
        key = self._key(response_id)
        value = self._redis.get(key)
        if value is None:
            return None
        plain = self._open(key, value)
        if plain is None:
            log.warning("a stored response in Redis does not decrypt: %s", response_id)
            return None
        if plain == TOMBSTONE:
            return DELETED
        try:
            return StoredResponse.from_json(orjson.loads(plain))
        except (ValueError, KeyError, TypeError, ValidationError) as exc:
            log.warning("a stored response in Redis does not parse (%s): %s", response_id, exc)
            return None

    def delete(self, response_id: str) -> None:
        """A tombstone, so that every replica's own copy is known to be gone; written over
        whatever is there, and never written over by a store."""
        key = self._key(response_id)
        self._writes.set(key, self._seal(key, TOMBSTONE), ex=self._ttl)

    def close(self) -> None:
        """Writes what is queued (for a few seconds at most), then stops the writer."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=5)
        self._writer.join(5)
        self._redis.close()
        self._writes.close()

    def _key(self, response_id: str) -> bytes:
        return self._prefix + response_id.encode()

    def _seal(self, key: bytes, plain: bytes) -> bytes:
        nonce = os.urandom(_NONCE_BYTES)
        return _FORMAT + nonce + self._aead.encrypt(nonce, plain, key)

    def _open(self, key: bytes, value: bytes) -> bytes | None:
        if value[:1] != _FORMAT or len(value) < 1 + _NONCE_BYTES + 16:
            return None
        try:
            return self._aead.decrypt(value[1:1 + _NONCE_BYTES], value[1 + _NONCE_BYTES:], key)
        except InvalidTag:
            return None
