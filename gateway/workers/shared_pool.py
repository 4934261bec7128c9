"""The gateway's side of the shared block pool: the arena, the cache index over it, the Redis
tier and the snapshot on disk. Created when the first worker reports its KV layout, or from the
--cache-dir snapshot while the workers load (then kept if their layout is the snapshot's); the
workers move the bytes, this side alone decides which slots hold what."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cache import persistence
from cache.arena import HEADER_BYTES, ArenaHeader, BlockArena, default_arena_path
from cache.fingerprint import gguf_fingerprint
from cache.index import CacheIndex
from cache.kv_codec import KVLayout
from cache.redis_tier import RedisTier, TierStats
from cache.tokens import reusable_prompt
from engine.llama import runtime_version
from engine.messages import (
    CommitStore,
    GenerationRequest,
    IndexReply,
    MatchCall,
    PlanStoreCall,
    ReleaseLease,
)
from gateway.config import WorkersConfig

log = logging.getLogger(__name__)

INDEX_CALLS = (MatchCall, PlanStoreCall, ReleaseLease, CommitStore)


@dataclass(frozen=True)
class TierHits:
    """Prompt tokens looked up in the cache, and those each tier served instead of computing."""

    queried: int
    by_tier: dict[str, int]

    @property
    def served(self) -> int:
        return sum(self.by_tier.values())


def kv_fingerprint(model_path: str, layout: KVLayout) -> str:
    """What guards the arena and the tier's keys: the model's content, the llama.cpp build and
    the KV layout."""
    return layout.fingerprint(f"{gguf_fingerprint(model_path)}/{runtime_version()}")


class SharedPool:
    # What pins are set and expire by: the wall clock. Only the tests' own entry point
    # (tests/clocked_gateway.py) puts a clock of theirs here, which they move themselves; no
    # flag or variable of a server reaches it.
    clock: Callable[[], float] = staticmethod(time.time)

    def __init__(self, config: WorkersConfig, fingerprint: str, slot_bytes: int,
                 layout: KVLayout | None) -> None:
        """Use `for_layout` or `from_snapshot`."""
        self.config = config
        self.fingerprint = fingerprint
        # What a block holds (window rows, a recurrent state): the workers' KV layout, known
        # once one is ready (`fits`).
        self.layout = layout
        self.arena = _create_arena(config, slot_bytes, fingerprint)
        header = self.arena.header
        self.tier = (RedisTier(config.redis, self.fingerprint, header.slot_bytes)
                     if config.redis is not None else None)
        budget = config.pin_budget_mb
        # The tier hears of a block when it is stored (write-through) or when it is evicted
        # (write-back, --redis-write evict): never both.
        back = self.tier is not None and self.tier.config.writes_back
        self.index = CacheIndex(
            header.n_slots, header.block_size,
            on_stored=self._to_tier if self.tier and not back else None,
            pin_budget=None if budget is None else (budget << 20) // header.slot_bytes,
            namespace_share=config.tenant_cache_share, clock=self.clock,
            on_evicted=self._evicted_to_tier if back else None)
        if config.cache_dir is not None:  # before any request can use the pool
            persistence.load(config.cache_dir, self.index, self.arena)

    @classmethod
    def for_layout(cls, config: WorkersConfig, layout: KVLayout) -> SharedPool:
        """The pool for the workers' KV layout (and the --cache-dir snapshot, if it fits)."""
        return cls(config, kv_fingerprint(config.model_path, layout),
                   layout.block_bytes(config.engine.cache.block_size), layout)

    @classmethod
    def from_snapshot(cls, config: WorkersConfig) -> SharedPool | None:
        """The pool the --cache-dir snapshot was saved from, its blocks read in, made while the
        workers load the model rather than after (a reloaded model served 0.1-0.3 s later
        for the read); None without a snapshot. The first ready worker's layout decides whether
        it is used (`fits`)."""
        found = persistence.header(config.cache_dir) if config.cache_dir else None
        if found is None or found.get("block_size") != config.engine.cache.block_size:
            return None
        return cls(config, str(found["fingerprint"]), int(found["slot_bytes"]), None)

    def fits(self, layout: KVLayout) -> bool:
        """Whether the workers' KV layout is the one this pool's blocks were made for; if
        so, it is this pool's layout from now on."""
        if self.fingerprint != kv_fingerprint(self.config.model_path, layout) or \
                self.arena.header.slot_bytes != layout.block_bytes(self.arena.header.block_size):
            return False
        self.layout = layout
        return True

    # ----- a worker's index calls, answered on its reader thread -------------------------------

    def answer(self, worker_id: int, message, reply) -> None:
        """Answers one of INDEX_CALLS; `reply` sends to the worker that asked."""
        index = self.index
        if isinstance(message, MatchCall):
            reply(IndexReply(message.call_id, index.match(worker_id, message.tokens,
                                                          message.namespace)))
        elif isinstance(message, PlanStoreCall):
            reply(IndexReply(message.call_id, index.plan_store(
                worker_id, message.tokens, message.namespace, message.final, message.hold)))
        elif isinstance(message, ReleaseLease):
            index.release(message.lease_id)
        elif isinstance(message, CommitStore):
            index.commit_store(message.plan_id, message.written)

    # ----- requests ----------------------------------------------------------------------------

    def history(self, request: GenerationRequest, limit: int) -> tuple[int, ...]:
        """Up to `limit` tokens the cache holds after the whole prompt, when it holds all of
        it: the latest answer to the same prompt in the tenant's namespace, to draft from
        (engine/speculation.py). Nothing when the prompt is new somewhere."""
        prompt = np.asarray(request.prompt_tokens, dtype=np.int32)
        report = self.index.report(prompt, request.namespace, following=limit)
        return tuple(int(t) for t in report.following) if report.n_tokens == len(prompt) \
            else ()

    def cached_length(self, request: GenerationRequest) -> int:
        return self.index.cached_length(np.asarray(request.prompt_tokens, dtype=np.int32),
                                        request.namespace)

    def pin(self, request: GenerationRequest, n_tokens: int, seconds: float) -> None:
        """The cached blocks of the prompt's first `n_tokens` outlive LRU for `seconds`
        (OpenAI's prompt_cache_retention "24h", Anthropic's cache_control breakpoints)."""
        self.index.pin(np.asarray(request.prompt_tokens[:n_tokens], dtype=np.int32),
                       request.namespace, self.clock() + seconds)

    def fetch_from_tier(self, request: GenerationRequest) -> int:
        """On a local miss, adopts the prompt's following blocks from Redis into the pool (one
        round trip, capped by --redis-timeout); returns the prompt tokens they added. Blocking:
        call it off the event loop. The tier only ever saves work: whatever goes wrong here,
        the request computes instead."""
        if self.tier is None:
            return 0
        try:
            return self._fetch_from_tier(request)
        except Exception:
            log.exception("adopting blocks from Redis failed; computing instead")
            return 0

    def redis_held(self, tokens: np.ndarray, namespace: str) -> int | None:
        """Prompt tokens Redis holds from the start, in whole blocks; None without a tier or
        when it cannot say. Blocking."""
        if self.tier is None:
            return None
        bs = self.index.block_size
        keys = self.index.chain_keys(tokens[: len(tokens) // bs * bs], namespace)
        held = self.tier.held(keys)
        return None if held is None else held * bs

    def _fetch_from_tier(self, request: GenerationRequest) -> int:
        prompt = reusable_prompt(np.asarray(request.prompt_tokens, dtype=np.int32))
        bs, namespace = self.index.block_size, request.namespace
        have = self.index.cached_length(prompt, namespace)
        first = have // bs
        if len(prompt) - first * bs < bs:  # not a whole block to gain
            return 0
        keys = self.index.chain_keys(prompt, namespace)[first:]
        chunks = [prompt[i: i + bs] for i in range(first * bs, len(prompt), bs)]
        found = self.tier.fetch(keys, chunks)
        if not found:
            return 0

        def block_bytes(start: int, _end: int) -> bytes | None:
            i = start // bs - first
            return found[i] if 0 <= i < len(found) else None

        held = self.index.adopt(prompt[: first * bs + sum(len(c) for c in chunks[:len(found)])],
                                namespace, block_bytes, self.arena)
        adopted = max(0, held - have)
        self.tier.record_hit(adopted)
        return adopted

    def _to_tier(self, block_key: bytes, tokens: np.ndarray, slot: int,
                 done: Callable[[], None]) -> None:
        """A stored block, for Redis: the tier's writer copies its bytes from the arena (the
        slot holds still until `done`)."""
        self.tier.put(block_key, tokens, self.arena.block(slot), done)

    def _evicted_to_tier(self, block_key: bytes, tokens: np.ndarray, slot: int) -> None:
        """A block the pool evicts, for Redis (--redis-write evict): called under the index's
        lock, so its bytes are copied before anything can reuse the slot."""
        self.tier.put_evicted(block_key, tokens, self.arena.block(slot))

    # ----- what /metrics and the cache page read -----------------------------------------------

    def tier_stats(self) -> TierStats:
        return dataclasses.replace(self.tier.stats) if self.tier else TierStats()

    def tier_skipping(self) -> bool:
        return self.tier is not None and self.tier.skipping()

    def tier_hits(self, queried: int, loaded: int) -> TierHits:
        """The one place hits are added up across tiers. Workers count what they `loaded` from
        the pool; blocks adopted from Redis reach them through the pool too, so those tokens
        are Redis's hits, and the pool's own are the rest (each token counted once)."""
        from_redis = min(self.tier_stats().hit_tokens, loaded)
        return TierHits(queried, {"pool": loaded - from_redis, "redis": from_redis})

    # ----- the end -----------------------------------------------------------------------------

    def close(self, save: bool = True) -> None:
        """After the workers stopped (nothing writes the arena any more): the snapshot, if
        asked for (and `save`), then the tier and the arena."""
        cache_dir: Path | None = self.config.cache_dir
        if cache_dir is not None and save:
            try:
                n = persistence.save(cache_dir, self.index, self.arena)
                log.info("saved %d cached blocks to %s", n, cache_dir)
            except OSError:
                log.exception("saving the prefix cache to %s failed", cache_dir)
        if self.tier is not None:
            self.tier.close()
        self.arena.close()


def _create_arena(config: WorkersConfig, slot_bytes: int, fingerprint: str) -> BlockArena:
    cache = config.engine.cache
    n_slots = ((cache.budget_mb << 20) - HEADER_BYTES) // slot_bytes
    if n_slots < 1:
        raise ValueError(f"a cache budget of {cache.budget_mb} MiB holds no "
                         f"{slot_bytes}-byte block")
    arena = BlockArena.create(config.arena_path or default_arena_path(),
                              ArenaHeader(fingerprint, slot_bytes, n_slots,
                                          cache.block_size))
    log.info("prefix cache: %d blocks of %d tokens (%.1f MiB each) in %s", n_slots,
             cache.block_size, slot_bytes / 2**20, arena.path)
    return arena
