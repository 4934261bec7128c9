"""Moves KV between the llama.cpp context and the shared block pool, for the engine thread.

A load assembles the matched blocks into one blob and hands it to `llama_state_seq_set_data`; a
store serialises only the positions whose blocks the tree lacks and cuts them into pool slots.
With unified KV both go through a scratch sequence, so that a sequence can take blocks after
the cells it already shares with another live sequence, and a store serialises just its range.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import numpy as np

from cache.block_pool import BlockPool
from cache.kv_codec import KVLayout, SequenceAssembler, SequenceState
from cache.radix_tree import Match, RadixTree
from gateway.llama import Batch, Context, Model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheConfig:
    enabled: bool = True
    budget_mb: int = 1024
    block_size: int = 64


@dataclass
class CacheStats:
    queried_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # prompt tokens loaded from the pool instead of computed
    uncached_requests: int = 0  # requests whose blocks did not fit: everything was in use
    store_failures: int = 0  # stores that raised: the request ran on, uncached
    loads: int = 0
    load_seconds: float = 0.0  # assembling and loading matched blocks into sequences
    stores: int = 0
    store_seconds: float = 0.0  # serialising sequences and cutting them into blocks


class PrefixCache:
    def __init__(self, ctx: Context, layout: KVLayout, config: CacheConfig,
                 scratch_seq: int | None) -> None:
        self.ctx = ctx
        self.layout = layout
        self.scratch_seq = scratch_seq  # None: per-sequence KV streams, no range copies
        self.pool = BlockPool(
            name=f"{os.getpid()}", slot_bytes=layout.block_bytes(config.block_size),
            budget_bytes=config.budget_mb << 20,
            fingerprint=layout.fingerprint(os.path.basename(ctx.model.path)),
            block_size=config.block_size)
        self.tree = RadixTree(self.pool)
        self.stats = CacheStats()
        self._assembler = SequenceAssembler(layout)
        log.info("prefix cache: %d blocks of %d tokens (%.1f MiB each) in %s",
                 self.pool.n_slots, config.block_size, self.pool.slot_bytes / 2**20,
                 self.pool.path)

    @classmethod
    def for_context(cls, model: Model, ctx: Context, config: CacheConfig,
                    scratch_seq: int | None) -> PrefixCache | None:
        if not config.enabled:
            log.info("prefix cache disabled")
            return None
        if not model.has_independent_position_kv:
            log.warning("prefix cache disabled: this model's KV (sliding-window or recurrent) "
                        "cannot be split into independent position blocks")
            return None
        return cls(ctx, _probe_layout(ctx), config, scratch_seq)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def load(self, tokens: np.ndarray, seq_id: int, have: int = 0) -> int:
        """Loads cached KV for `tokens` after the first `have` positions the sequence already
        holds; returns how many positions it holds now. The blocks are in the context once
        this returns, so none of them stays held."""
        match = self.tree.match(tokens)
        try:
            if match.n_tokens <= have:
                return have
            start = time.perf_counter()
            first = have // self.block_size  # blocks are block-aligned: load from the one
            blocks = [(self.pool.block(slot), n) for slot, n in match.blocks()[first:]]
            if have == 0:  # nothing to keep: load straight into the (empty) sequence
                self.ctx.load_sequence_state(seq_id, self._assembler.assemble(blocks, seq_id))
            else:
                scratch = self.scratch_seq
                try:
                    self.ctx.load_sequence_state(scratch,
                                                 self._assembler.assemble(blocks, scratch))
                    self.ctx.share(scratch, seq_id, have, match.n_tokens)
                finally:
                    self.ctx.forget(scratch)
            self.stats.loads += 1
            self.stats.load_seconds += time.perf_counter() - start
            return match.n_tokens
        finally:
            self.tree.release(match)

    def cached_length(self, tokens: np.ndarray) -> int:
        return self.tree.matched_length(tokens)

    def store(self, tokens: np.ndarray, seq_id: int, final: bool,
              hold: bool = False) -> Match | None:
        """Stores the blocks of the sequence's first len(tokens) cells that the tree lacks. A
        failure only skips caching. With `hold` the path stays retained and is returned."""
        start = time.perf_counter()
        state: list[SequenceState] = []

        def write(block: np.ndarray, begin: int, end: int) -> None:
            if not state:  # serialise once, from the first missing block on
                state.append(self._serialise(seq_id, begin, len(tokens)))
            state[0].write_block(block, begin, end)

        try:
            path, complete = self.tree.insert(tokens, write)
        except Exception:
            log.exception("storing KV blocks failed; the request runs on uncached")
            self.stats.store_failures += 1
            return None
        finally:
            if state and self.scratch_seq is not None:
                self.ctx.forget(self.scratch_seq)
        self.stats.stores += 1
        self.stats.store_seconds += time.perf_counter() - start
        if final and not complete:
            self.stats.uncached_requests += 1
        if hold:
            return path
        self.tree.release(path)
        return None

    def _serialise(self, seq_id: int, begin: int, end: int) -> SequenceState:
        if self.scratch_seq is None:  # its own stream: cells cannot be shared out of it
            return SequenceState.parse(self.ctx.sequence_state(seq_id), self.layout)
        self.ctx.share(seq_id, self.scratch_seq, begin, end)
        return SequenceState.parse(self.ctx.sequence_state(self.scratch_seq), self.layout)

    def release(self, match: Match) -> None:
        self.tree.release(match)

    def close(self) -> None:
        self.pool.close()


def _probe_layout(ctx: Context) -> KVLayout:
    """Computes one token in sequence 0 to read the serialised layout, then forgets it."""
    batch = Batch(1)
    try:
        batch.add([ctx.model.bos_token if ctx.model.bos_token >= 0 else 0], 0, 0, False)
        ctx.decode(batch)
        return KVLayout.from_sequence_state(ctx.sequence_state(0))
    finally:
        ctx.forget(0)
        batch.close()
