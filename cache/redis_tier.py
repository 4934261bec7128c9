"""The Redis tier: KV blocks shared by gateways that share no arena (other pods, other machines).

What is written, by `TierConfig.write` (`--redis-write`):
- "store" (write-through, a plain gateway's default): every block a worker stores is also
  written to Redis, so that a replica behind a load balancer that picks at random finds what
  another computed. The queue holds the block itself (its slot in the arena stays referenced,
  so unchanged, until the writer has copied it).
- "evict" (write-back at eviction, the default of a `--dynamo` node): a block is written only
  when LRU eviction takes it from the pool. Behind Dynamo's KV router each prefix goes to the
  node that holds it, so another node rarely needs a block while its holder keeps it; what
  the holder evicts, it or another node may still load instead of computing. Its bytes are
  copied under the cache index's lock, before the slot can be reused (the copy of one block;
  none when the queue is full or the breaker open), and queued like a stored block. Blocks
  never evicted are never written: what a node holds when it stops is kept by `--cache-dir`,
  and what it holds when it dies is recomputed where the router sends it next.
Either way the writer, a thread of its own, never on a request's path, makes the value and its
signature outside the cache index's lock. On a local miss the gateway asks Redis for the
prompt's following blocks in one MGET (one round trip for the whole prompt, capped by
`--redis-timeout`) and adopts what it finds into its own pool before routing the request, which
then loads them like any cached block.

Keys: `prefixgate:v1:<fingerprint>:<block key>`, the block key being the radix tree's chained
hash (parent key + tokens, from the namespace's root), so the model and KV layout, the tenant
namespace and the whole prefix are all in it. One value per block holds a small header (magic,
version, fingerprint digest, token count), the block's tokens and its bytes: never a data key and
a separate metadata key that an eviction could split. Values are checked on load like local hits
(header, fingerprint, tokens); one that does not verify is a miss and counts as an error.

Trust: without `--redis-key`, anyone who can write to the Redis can plant KV for any tenant and
prefix (values are verified only by their tokens and the fingerprint, both public). With it,
every value carries an HMAC-SHA256 over its key and its bytes, and one that does not verify is
a miss: only holders of the key can write KV a gateway will use. Gateways with different keys
(or one with and one without) share nothing. Reading Redis still shows token ids: keep it on a
network only gateways reach.

Redis slow, down or answering garbage never fails a request or delays it past the cap: a miss,
a metric and a log line. After repeated failures the tier is skipped for a while (a circuit
breaker), then tried again.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import queue
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import redis
import xxhash

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_MAGIC = b"PGKV"
_HEADER = struct.Struct("<4sHHI16s")  # magic, version, flags, n_tokens, fingerprint digest
_SIGNED = 1  # flags: an HMAC-SHA256 of the Redis key and the value follows the block's bytes
_MAC_BYTES = 32
BREAKER_FAILURES = 3  # consecutive failures that open the breaker
BREAKER_SECONDS = 30.0  # how long the tier is skipped then
WRITE_BATCH = 16  # blocks per pipelined write
WRITE_POLICIES = ("store", "evict")  # TierConfig.write: see the module's docstring


@dataclass(frozen=True)
class _Stored:
    """A block waiting for the writer: its bytes hold still until `done()`."""

    key: bytes  # the block key (the radix tree's)
    tokens: np.ndarray
    data: bytes | memoryview | np.ndarray
    done: Callable[[], None]


@dataclass(frozen=True)
class TierConfig:
    url: str
    timeout: float = 0.2  # seconds a lookup may add to a request
    ttl: int = 86400  # seconds a block lives in Redis after its last write
    queue_blocks: int = 256  # blocks waiting to be written; beyond, new ones are dropped
    key: bytes | None = None  # signs every value (HMAC-SHA256); None: values are unsigned
    write: str = "store"  # one of WRITE_POLICIES: when a block is written

    def __post_init__(self) -> None:
        if self.write not in WRITE_POLICIES:
            raise ValueError(f"the Redis tier writes blocks at {WRITE_POLICIES}, "
                             f"not {self.write!r}")

    @property
    def writes_back(self) -> bool:
        """Whether blocks are written when evicted rather than when stored."""
        return self.write == "evict"


@dataclass
class TierStats:
    hit_tokens: int = 0  # prompt tokens loaded from Redis into the pool instead of computed
    stored_blocks: int = 0
    errors: int = 0  # failed calls and values that did not verify
    dropped_blocks: int = 0  # not written: the queue was full


def _nothing() -> None:
    """A copied block's `done`: nothing is held for it."""


class RedisTier:
    def __init__(self, config: TierConfig, fingerprint: str, slot_bytes: int) -> None:
        self.config = config
        self.slot_bytes = slot_bytes
        self.stats = TierStats()
        self._prefix = f"prefixgate:v{FORMAT_VERSION}:{fingerprint}:".encode()
        self._fingerprint = xxhash.xxh3_128(fingerprint.encode()).digest()
        self._reads = redis.Redis.from_url(config.url, socket_timeout=config.timeout,
                                           socket_connect_timeout=config.timeout)
        # Writes carry megabytes and nobody waits for them: a longer timeout.
        self._writes = redis.Redis.from_url(config.url, socket_timeout=10,
                                            socket_connect_timeout=config.timeout * 5)
        self._queue: queue.Queue[_Stored | None] = queue.Queue(config.queue_blocks)
        self._failures = 0
        self._skip_until = 0.0
        self._lock = threading.Lock()  # the breaker and the stats, from both threads
        self._writer = threading.Thread(target=self._write_loop, name="redis-tier", daemon=True)
        self._writer.start()

    def key(self, block_key: bytes) -> bytes:
        return self._prefix + block_key.hex().encode()

    # ----- writes -------------------------------------------------------------------------

    def put(self, block_key: bytes, tokens: np.ndarray, data: bytes | memoryview | np.ndarray,
            done: Callable[[], None]) -> None:
        """Queues a block for Redis: `data` its bytes, which stay unchanged until `done()`,
        called once the writer has copied them (at once when the queue is full). It only
        queues: the copy and the signature are the writer's."""
        try:
            self._queue.put_nowait(_Stored(block_key, tokens, data, done))
        except queue.Full:
            done()
            with self._lock:
                self.stats.dropped_blocks += 1

    def put_evicted(self, block_key: bytes, tokens: np.ndarray,
                    data: bytes | memoryview | np.ndarray) -> None:
        """Queues a block the pool is evicting: its bytes are copied now (the caller holds
        the lock that keeps the slot from being reused until this returns), unless the queue
        is full or the breaker open, when it is not written at all."""
        if self.skipping():  # as the writer would: let go, not counted as dropped
            return
        if self._queue.full():
            with self._lock:
                self.stats.dropped_blocks += 1
            return
        self.put(block_key, tokens, bytes(data), _nothing)

    def _value(self, block: _Stored) -> tuple[bytes, bytes]:
        """(Redis key, value) of a queued block: its bytes copied, the block let go, then the
        copy signed (the hash lets go of the GIL) and joined to its header."""
        try:
            data = bytes(block.data)
        finally:
            block.done()
        key = self.key(block.key)
        flags = _SIGNED if self.config.key else 0
        head = (_HEADER.pack(_MAGIC, FORMAT_VERSION, flags, len(block.tokens), self._fingerprint)
                + block.tokens.astype("<i4").tobytes())
        parts = [head, data]
        if self.config.key:  # over the key too: a signed value cannot move to another prefix
            mac = hmac.new(self.config.key, key + head, hashlib.sha256)
            mac.update(data)
            parts.append(mac.digest())
        return key, b"".join(parts)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < WRITE_BATCH and not self._queue.empty():
                item = self._queue.get_nowait()
                if item is None:
                    self._queue.put(None)  # finish this batch, then stop
                    break
                batch.append(item)
            if self.skipping():
                for block in batch:
                    block.done()
                continue
            try:
                values = [self._value(block) for block in batch]
            except Exception:  # never the writer's end: the blocks not reached are let go
                log.exception("Redis tier: making %d values failed", len(batch))
                for block in batch:
                    block.done()
                continue
            try:
                with self._writes.pipeline(transaction=False) as pipe:
                    for key, value in values:
                        pipe.set(key, value, ex=self.config.ttl)
                    pipe.execute()
                self._succeeded(len(batch))
            except redis.RedisError as exc:
                self._failed(f"writing {len(batch)} blocks", exc)

    # ----- reads --------------------------------------------------------------------------

    def held(self, block_keys: list[bytes]) -> int | None:
        """How many of the blocks, from the first, Redis has (by key: values are verified only
        when fetched); None when it cannot say. Explaining a miss: nothing is fetched."""
        if not block_keys or self.skipping():
            return None if block_keys else 0
        try:
            with self._reads.pipeline(transaction=False) as pipe:
                for key in block_keys:
                    pipe.exists(self.key(key))
                present = pipe.execute()
        except redis.RedisError as exc:
            log.warning("Redis tier: explaining a miss: %s", exc)
            return None
        return next((i for i, found in enumerate(present) if not found), len(present))

    def fetch(self, block_keys: list[bytes], chunks: list[np.ndarray]) -> list[bytes]:
        """The bytes of the blocks, in order, up to the first one Redis lacks or that does not
        verify (its tokens must be `chunks[i]`)."""
        if not block_keys or self.skipping():
            return []
        try:
            keys = [self.key(k) for k in block_keys]
            values = self._reads.mget(keys)
        except redis.RedisError as exc:
            self._failed("looking up blocks", exc)
            return []
        self._succeeded(0)
        found = []
        for key, value, chunk in zip(keys, values, chunks, strict=True):
            if value is None:
                break
            data = self._verified(key, value, chunk)
            if data is None:
                with self._lock:
                    self.stats.errors += 1
                log.warning("a Redis value did not verify (corrupted, or of another model); "
                            "computing instead")
                break
            found.append(data)
        return found

    def _verified(self, key: bytes, value: bytes, chunk: np.ndarray) -> bytes | None:
        if len(value) < _HEADER.size:
            return None
        magic, version, flags, n_tokens, fingerprint = _HEADER.unpack_from(value)
        end = _HEADER.size + 4 * n_tokens
        signed = bool(self.config.key)
        mac = _MAC_BYTES if signed else 0
        if (magic, version, fingerprint, flags) != (_MAGIC, FORMAT_VERSION, self._fingerprint,
                                                    _SIGNED if signed else 0) \
                or n_tokens != len(chunk) or len(value) != end + self.slot_bytes + mac:
            return None
        if signed and not hmac.compare_digest(
                value[-mac:], hmac.new(self.config.key, key + value[:-mac],
                                       hashlib.sha256).digest()):
            return None
        if not np.array_equal(np.frombuffer(value, "<i4", n_tokens, _HEADER.size), chunk):
            return None
        return value[end:end + self.slot_bytes]

    def record_hit(self, n_tokens: int) -> None:
        with self._lock:
            self.stats.hit_tokens += n_tokens

    # ----- the breaker --------------------------------------------------------------------

    def skipping(self) -> bool:
        """Whether the breaker is open: the tier is left alone after repeated failures."""
        with self._lock:
            return time.monotonic() < self._skip_until

    def _succeeded(self, stored: int) -> None:
        with self._lock:
            self._failures = 0
            self.stats.stored_blocks += stored

    def _failed(self, what: str, exc: Exception) -> None:
        with self._lock:
            self.stats.errors += 1
            self._failures += 1
            if self._failures >= BREAKER_FAILURES:
                self._skip_until = time.monotonic() + BREAKER_SECONDS
                self._failures = 0
                log.error("Redis tier: %s failed (%s); skipping it for %.0f s", what, exc,
                          BREAKER_SECONDS)
                return
        log.warning("Redis tier: %s failed: %s", what, exc)

    def close(self) -> None:
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=5)
        self._writer.join(5)
        self._reads.close()
        self._writes.close()
