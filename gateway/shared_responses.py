"""Stored responses in Redis (`--redis-url`), so that any replica can continue a conversation:
written through on store, read on a local miss, deleted everywhere.

A GET or continuation asks Redis first: a response deleted through one replica leaves a
tombstone there, so it is gone on all of them; one Redis does not know (its write still under
way, or Redis down or slow past `--redis-timeout`) is served from the replica's own copy.

Keys `prefixgate:v2:responses:<model fingerprint>:<id>`; a value is the stored response as
JSON, its owner (the tenant whose key made it) in it, and with `--redis-key` an HMAC-SHA256
over key and value after it: a value that does not verify, or belongs to another tenant, is a
miss. Writes run on a thread of their own, never on a request's path. Values expire with
`--response-store-hours`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading

import orjson
import redis
from pydantic import ValidationError

from cache.redis_tier import TierConfig
from gateway.response_store import StoredResponse

log = logging.getLogger(__name__)

_MAC_BYTES = 32
TOMBSTONE = b"deleted"
DELETED = object()  # what get() answers for a response deleted through any replica


class SharedResponses:
    def __init__(self, config: TierConfig, fingerprint: str, ttl_seconds: float) -> None:
        self._key = config.key
        self._ttl = max(1, int(ttl_seconds))
        self._prefix = f"prefixgate:v2:responses:{fingerprint}:".encode()
        self._redis = redis.Redis.from_url(config.url, socket_timeout=config.timeout,
                                           socket_connect_timeout=config.timeout)
        self._writes = redis.Redis.from_url(config.url, socket_timeout=10,
                                            socket_connect_timeout=config.timeout * 5)

    def put(self, entry: StoredResponse) -> None:
        """Writes it on a thread of its own: the caller is the event loop."""
        threading.Thread(target=self._write, args=(entry,), name="redis-responses",
                         daemon=True).start()

    def _write(self, entry: StoredResponse) -> None:
        try:
            self._set(entry.id, orjson.dumps(entry.to_json()))
        except redis.RedisError as exc:
            log.warning("storing response %s in Redis failed: %s", entry.id, exc)

    def _set(self, response_id: str, value: bytes) -> None:
        key = self._prefix + response_id.encode()
        if self._key:  # over the key too: a signed value cannot move to another id
            value += hmac.new(self._key, key + value, hashlib.sha256).digest()
        self._writes.set(key, value, ex=self._ttl)

    def get(self, response_id: str) -> StoredResponse | object | None:
        """The stored response; DELETED; or None if Redis has none that verifies. RedisError
        when Redis does not answer (the caller then trusts its own copy)."""
        key = self._prefix + response_id.encode()
        value = self._redis.get(key)
        if value is None:
            return None
        if self._key:
            value, mac = value[:-_MAC_BYTES], value[-_MAC_BYTES:]
            expected = hmac.new(self._key, key + value, hashlib.sha256).digest()
            if not hmac.compare_digest(mac, expected):
                log.warning("a stored response in Redis does not verify: %s", response_id)
                return None
        if value == TOMBSTONE:
            return DELETED
        try:
            return StoredResponse.from_json(orjson.loads(value))
        except (ValueError, KeyError, TypeError, ValidationError) as exc:
            log.warning("a stored response in Redis does not parse (%s): %s", response_id, exc)
            return None

    def delete(self, response_id: str) -> None:
        """A tombstone, so that every replica's own copy is known to be gone."""
        self._set(response_id, TOMBSTONE)
