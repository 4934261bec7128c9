"""Moves KV between a worker's llama.cpp context and the shared block arena, on its engine thread.

A load asks the index for the matched blocks, assembles them into one blob and hands it to
`llama_state_seq_set_data`; a store asks the index for slots for the blocks it lacks, serialises
only those positions and cuts them into the slots. With unified KV both go through a scratch
sequence, so that a sequence can take blocks after the cells it already shares with another
live sequence, and a store serialises just its range. The index itself lives in the gateway
(cache/index.py): this side never allocates, frees or evicts a block.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import numpy as np

from cache.arena import BlockArena
from cache.index import Lease, StorePlan
from cache.kv_codec import KVLayout, SequenceAssembler, SequenceState
from engine.config import CacheConfig
from engine.llama import Batch, Context, Model
from engine.messages import CacheStats

log = logging.getLogger(__name__)


class BlockIndex(Protocol):
    """The cache index's calls a worker makes (cache.index.IndexClient in-process,
    engine.process.RemoteIndex across processes)."""

    def match(self, tokens: np.ndarray, namespace: str) -> Lease: ...
    def release(self, lease_id: int) -> None: ...
    def plan_store(self, tokens: np.ndarray, namespace: str, final: bool,
                   hold: bool) -> StorePlan: ...
    def commit_store(self, plan_id: int, written: bool) -> None: ...


class PrefixCache:
    def __init__(self, ctx: Context, layout: KVLayout, arena: BlockArena, index: BlockIndex,
                 scratch_seq: int | None) -> None:
        self.ctx = ctx
        self.layout = layout
        self.arena = arena
        self.index = index
        self.block_size = arena.header.block_size
        self.scratch_seq = scratch_seq  # None: per-sequence KV streams, no range copies
        self.stats = CacheStats()
        self._assembler = SequenceAssembler(layout)

    def load(self, tokens: np.ndarray, namespace: str, seq_id: int, have: int = 0) -> int:
        """Loads cached KV for `tokens` after the first `have` positions the sequence already
        holds; returns how many positions it holds now. The blocks are in the context once
        this returns, so none of them stays held."""
        lease = self.index.match(tokens, namespace)
        try:
            if lease.n_tokens <= have:
                return have
            start = time.perf_counter()
            first = have // self.block_size  # blocks are block-aligned: load from the one
            blocks = [(self.arena.block(slot), n) for slot, n in lease.blocks[first:]]
            if have == 0:  # nothing to keep: load straight into the (empty) sequence
                self.ctx.load_sequence_state(seq_id, self._assembler.assemble(blocks, seq_id))
            else:
                scratch = self.scratch_seq
                try:
                    self.ctx.load_sequence_state(scratch,
                                                 self._assembler.assemble(blocks, scratch))
                    self.ctx.share(scratch, seq_id, have, lease.n_tokens)
                finally:
                    self.ctx.forget(scratch)
            self.stats.loads += 1
            self.stats.load_seconds += time.perf_counter() - start
            return lease.n_tokens
        finally:
            self.index.release(lease.lease_id)

    def store(self, tokens: np.ndarray, namespace: str, seq_id: int, final: bool,
              hold: bool = False) -> int | None:
        """Stores the blocks of the sequence's first len(tokens) cells that the tree lacks. A
        failure only skips caching. With `hold` the stored path stays referenced: the lease id
        to release is returned."""
        start = time.perf_counter()
        try:
            plan = self.index.plan_store(tokens, namespace, final, hold)
        except Exception:
            log.exception("the cache index gave no slots; the request runs on uncached")
            self.stats.store_failures += 1
            return None
        written = False
        try:
            if plan.slots:
                state = self._serialise(seq_id, plan.begin, plan.end)
                for i, slot in enumerate(plan.slots):
                    begin = plan.begin + i * self.block_size
                    state.write_block(self.arena.block(slot), begin,
                                      min(begin + self.block_size, plan.end))
            written = True
        except Exception:
            log.exception("storing KV blocks failed; the request runs on uncached")
            self.stats.store_failures += 1
        finally:
            if plan.slots and self.scratch_seq is not None:
                self.ctx.forget(self.scratch_seq)
            self.index.commit_store(plan.plan_id, written)
        self.stats.stores += 1
        self.stats.store_seconds += time.perf_counter() - start
        return plan.plan_id if hold and written else None

    def _serialise(self, seq_id: int, begin: int, end: int) -> SequenceState:
        if self.scratch_seq is None:  # its own stream: cells cannot be shared out of it
            return SequenceState.parse(self.ctx.sequence_state(seq_id), self.layout)
        self.ctx.share(seq_id, self.scratch_seq, begin, end)
        return SequenceState.parse(self.ctx.sequence_state(self.scratch_seq), self.layout)

    def release(self, lease_id: int) -> None:
        self.index.release(lease_id)


def cacheable_layout(model: Model, ctx: Context, config: CacheConfig) -> KVLayout | None:
    """The layout of the context's serialised KV, or None when its blocks cannot be cached."""
    if not config.enabled:
        log.info("prefix cache disabled")
        return None
    if not model.has_independent_position_kv:
        log.warning("prefix cache disabled: this model's KV (sliding-window or recurrent) "
                    "cannot be split into independent position blocks")
        return None
    return _probe_layout(ctx)


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
