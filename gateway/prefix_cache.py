"""Moves KV between the llama.cpp context and the shared block pool, for the engine thread.

Admission loads a request's longest cached prefix into its sequence in one
`llama_state_seq_set_data` call; after its prefill and when it finishes, the blocks the tree lacks
are cut out of the sequence's serialised state and stored.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import numpy as np

from cache.block_pool import BlockPool
from cache.kv_codec import KVLayout, SequenceState, assemble_sequence
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
    hit_tokens: int = 0  # prompt tokens loaded instead of computed
    uncached_requests: int = 0  # requests whose blocks did not fit: everything was in use
    loads: int = 0
    load_seconds: float = 0.0  # assembling and loading matched blocks into sequences


class PrefixCache:
    def __init__(self, ctx: Context, layout: KVLayout, config: CacheConfig) -> None:
        self.ctx = ctx
        self.layout = layout
        self.pool = BlockPool(
            name=f"{os.getpid()}", slot_bytes=layout.block_bytes(config.block_size),
            budget_bytes=config.budget_mb << 20,
            fingerprint=layout.fingerprint(os.path.basename(ctx.model.path)),
            block_size=config.block_size)
        self.tree = RadixTree(self.pool)
        self.stats = CacheStats()
        log.info("prefix cache: %d blocks of %d tokens (%.1f MiB each) in %s",
                 self.pool.n_slots, config.block_size, self.pool.slot_bytes / 2**20,
                 self.pool.path)

    @classmethod
    def for_context(cls, model: Model, ctx: Context, config: CacheConfig) -> PrefixCache | None:
        if not config.enabled:
            log.info("prefix cache disabled")
            return None
        if not model.has_independent_position_kv:
            log.warning("prefix cache disabled: this model's KV (sliding-window or recurrent) "
                        "cannot be split into independent position blocks")
            return None
        return cls(ctx, _probe_layout(ctx), config)

    def load(self, prompt: list[int], seq_id: int) -> Match:
        """Loads the longest cached prefix of `prompt` into the (empty) sequence. At least the
        last prompt token is left to compute, since its logits give the first output token."""
        tokens = np.asarray(prompt[:-1], dtype=np.int32)
        match = self.tree.match(tokens)
        self.stats.queried_tokens += len(prompt)
        if match.n_tokens:
            start = time.perf_counter()
            blocks = [(self.pool.block(slot), n) for slot, n in match.blocks()]
            try:
                self.ctx.load_sequence_state(seq_id,
                                             assemble_sequence(self.layout, blocks, seq_id))
            except Exception:
                self.tree.release(match)
                raise
            self.stats.loads += 1
            self.stats.load_seconds += time.perf_counter() - start
            self.stats.hit_tokens += match.n_tokens
        return match

    def cached_length(self, tokens: list[int]) -> int:
        return self.tree.matched_length(np.asarray(tokens, dtype=np.int32))

    def store(self, tokens: list[int], seq_id: int) -> Match:
        """Stores the blocks of the sequence's first len(tokens) cells the tree lacks; returns
        their path, held for the caller."""
        state: list[SequenceState] = []

        def write(block: np.ndarray, start: int, end: int) -> None:
            if not state:  # serialise the sequence only if some block is missing
                state.append(SequenceState.parse(self.ctx.sequence_state(seq_id), self.layout))
            state[0].write_block(block, start, end)

        path, complete = self.tree.insert(np.asarray(tokens, dtype=np.int32), write)
        if not complete:
            self.stats.uncached_requests += 1
        return path

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
