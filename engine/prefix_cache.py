"""Moves KV between a worker's llama.cpp context and the shared block arena, on its engine thread.

A load asks the index for the matched blocks, assembles them into one blob and hands it to
`llama_state_seq_set_data`; a store asks the index for slots for the blocks it lacks, serialises
only those positions and cuts them into the slots. With unified KV both go through a scratch
sequence, so that a sequence can take blocks after the cells it already shares with another
live sequence, and a store serialises just its range. The index itself lives in the gateway
(cache/index.py): this side never allocates, frees or evicts a block.

A sliding-window model's blocks hold its window layers' rows too. llama.cpp keeps those only for
a sequence's last n_swa positions, so such a model's blocks are stored the step they are
computed, and a load brings the window's rows from the blocks even where a live sequence
shared the rest.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Protocol

import numpy as np

from cache.arena import BlockArena
from cache.index import Lease, StorePlan
from cache.kv_codec import (
    KVLayout,
    LayoutError,
    SequenceAssembler,
    SequenceState,
    WindowPassed,
    block_state,
    block_tokens,
    write_block_header,
    write_state,
)
from cache.tokens import resume_point
from engine.config import CacheConfig, ContextShape
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

    @property
    def stores_eagerly(self) -> bool:
        """A sliding-window model's blocks are stored as soon as they are computed: llama.cpp
        drops a position's window rows once the sequence's window has passed it. A recurrent
        model's too: its state after a block is there only until the next step."""
        return bool(self.layout.window or self.layout.state_bytes)

    @property
    def keeps_states(self) -> bool:
        """A recurrent model's prefix resumes only where a block keeps the state after it, so
        its prompt chunks end at block boundaries; and a live sequence's state is at its own
        end, not a prefix's, so its cells are not shared."""
        return bool(self.layout.state_bytes)

    def load(self, tokens: np.ndarray, namespace: str, seq_id: int, donor: int | None = None,
             live: int = 0) -> tuple[int, int]:
        """Gives the sequence, which holds nothing, the KV of the longest prefix of `tokens`
        that the donor's first `live` positions and the pool hold: shared cells first, then
        blocks. Returns (positions shared, positions held). Never raises: a failure leaves the
        prefix to compute. No block stays held once this returns."""
        shared = 0
        try:
            lease = self.index.match(tokens, namespace)
        except Exception:
            log.exception("the cache index failed a match; computing the prompt")
            self.stats.load_failures += 1
            lease = None
        try:
            state = None
            if self.keeps_states:
                n, state = self._deepest_state(lease) if lease else (0, None)
                live = 0
            else:
                n, live = resume_point(lease.n_tokens) if lease else 0, resume_point(live)
            if self.layout.window:  # the window's rows come from blocks: the donor's may be gone
                live = min(live, n)
            if live:
                self.ctx.share(donor, seq_id, 0, live)
                shared = live
            if n <= shared and not (self.layout.window and n):
                return shared, shared
            start = time.perf_counter()
            self._load_blocks(lease, seq_id, have=shared, n=n, state=state)
            self.stats.loads += 1
            self.stats.load_seconds += time.perf_counter() - start
            return shared, max(n, shared)
        except Exception:  # the cache is an optimisation: compute the prompt instead
            log.exception("loading cached blocks failed; computing the prompt")
            self.stats.load_failures += 1
            # A window or state left half loaded is wrong: then nothing stays.
            shared = 0 if self.layout.window or self.keeps_states else shared
            self.ctx.cut(seq_id, shared)
            return shared, shared
        finally:
            if lease:
                self.index.release(lease.lease_id)

    def _deepest_state(self, lease: Lease) -> tuple[int, np.ndarray | None]:
        """The end of the deepest matched block that keeps the state after it, and the state."""
        for i in reversed(range(len(lease.blocks))):
            slot, matched = lease.blocks[i]
            block = self.arena.block(slot)
            state = block_state(block, self.layout)
            if state is not None and matched == block_tokens(block)[0]:
                return i * self.block_size + matched, state
        return 0, None

    def _load_blocks(self, lease: Lease, seq_id: int, have: int, n: int,
                     state: np.ndarray | None) -> None:
        """Loads the lease's positions [have, n) (and all of the window before n, whatever the
        sequence holds), or with `state` (a recurrent model's, after n) positions [0, n)."""
        bs = self.block_size
        if state is not None and not self.layout.sections:  # recurrent layers only
            self.ctx.load_sequence_state(seq_id, state, partial=True)
            return
        blocks = [(self.arena.block(slot), min(count, n - i * bs))
                  for i, (slot, count) in enumerate(lease.blocks) if i * bs < n]
        if have == 0:  # nothing to keep: load straight into the (empty) sequence
            self.ctx.load_sequence_state(seq_id, self._assembler.assemble(blocks, seq_id,
                                                                          state=state))
            return
        if have < n:  # blocks are block-aligned: load from the one `have` is in
            scratch = self.scratch_seq
            try:
                self.ctx.load_sequence_state(scratch, self._assembler.assemble(
                    blocks[have // bs:], scratch, window=False))
                self.ctx.share(scratch, seq_id, have, n)
            finally:
                self.ctx.forget(scratch)
        if self.layout.window:  # replaces whatever window rows the sequence shared
            window = blocks[self.layout.window_start(n) // bs:]
            self.ctx.load_sequence_state(seq_id, self._assembler.assemble(
                window, seq_id, full=False), partial=True)

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
                self._write(seq_id, plan)
            written = True
        except WindowPassed as exc:
            log.warning("not storing KV blocks: %s (stored too late)", exc)
            self.stats.store_failures += 1
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

    def _write(self, seq_id: int, plan: StorePlan) -> None:
        """Serialises the plan's positions and cuts them into its slots. A window section holds
        only the last n_swa positions of what it serialises: ranges of at most that many,
        aligned to it (as a chunked window is), get them all. A recurrent model's last block
        keeps the state when the sequence is at its end."""
        bs, window = self.block_size, self.layout.window
        edges = [plan.begin, *range((plan.begin // window + 1) * window, plan.end, window),
                 plan.end] if window else [plan.begin, plan.end]
        for lo, hi in itertools.pairwise(edges):
            rows = self._serialise(seq_id, lo, hi) if self.layout.sections else None
            for i, slot in enumerate(plan.slots):
                begin = plan.begin + i * bs
                end = min(begin + bs, plan.end)
                if rows is None:  # recurrent layers only: no rows
                    write_block_header(self.arena.block(slot), begin, end)
                elif begin < hi and end > lo:
                    rows.write_block(self.arena.block(slot), begin, max(begin, lo),
                                     min(end, hi))
        if self.keeps_states and self.ctx.position_end(seq_id) == plan.end:
            state = self.ctx.sequence_state(seq_id, partial=True)
            if len(state) == self.layout.state_bytes:
                write_state(self.arena.block(plan.slots[-1]), state)

    def _serialise(self, seq_id: int, begin: int, end: int) -> SequenceState:
        if self.scratch_seq is None:  # its own stream: cells cannot be shared out of it
            return SequenceState.parse(self.ctx.sequence_state(seq_id), self.layout)
        self.ctx.forget(self.scratch_seq)
        self.ctx.share(seq_id, self.scratch_seq, begin, end)
        return SequenceState.parse(self.ctx.sequence_state(self.scratch_seq), self.layout)

    def release(self, lease_id: int) -> None:
        self.index.release(lease_id)


def cacheable_layout(model: Model, ctx: Context, config: CacheConfig) -> KVLayout | None:
    """The layout of the context's serialised KV, or None when its blocks cannot be cached
    (said once, with the reason)."""
    if not config.enabled:
        log.info("prefix cache disabled")
        return None
    if model.has_recurrent_state and model.n_swa:
        log.warning("prefix cache disabled: a hybrid model with sliding-window attention "
                    "writes its window and its recurrent state as one partial state, which "
                    "blocks do not keep apart")
        return None
    if model.n_swa and not ctx.shape.unified:
        log.warning("prefix cache disabled: a sliding-window model's blocks are copied out of "
                    "a shared cell pool, which the deterministic mode does not use")
        return None
    try:
        layout = _probe_layout(ctx, model.has_recurrent_state)
    except LayoutError as exc:
        log.warning("prefix cache disabled: this model's serialised state is not one the "
                    "cache can cut into blocks (%s)", exc)
        return None
    if model.n_swa:
        if len(layout.sections) != 2:
            log.warning("prefix cache disabled: a sliding-window model whose KV has %d "
                        "sections, not 2", len(layout.sections))
            return None
        layout = dataclasses.replace(layout, window=model.n_swa)
        full, windowed = layout.sections
        cells = window_cells(ctx.shape, model.n_swa)
        log.info("sliding-window model (window %d): blocks keep every layer's KV, and a "
                 "prefix resumes with its last window's. KV in the context: %.0f MiB for the "
                 "full layers (%d cells), %.0f MiB for the window layers (%d cells%s)",
                 model.n_swa, ctx.shape.n_ctx * full.bytes_per_token / 2**20, ctx.shape.n_ctx,
                 cells * windowed.bytes_per_token / 2**20, cells,
                 ", --swa-full" if ctx.shape.swa_full else "")
    if layout.state_bytes:
        log.info("recurrent model (a state of %d bytes): blocks keep the state after them "
                 "where a prompt chunk or an answer's block ended, and a prefix resumes at "
                 "the deepest such block", layout.state_bytes)
    return layout


def window_cells(shape: ContextShape, n_swa: int) -> int:
    """KV cells llama.cpp gives the window layers (src/llama-kv-cache-iswa.cpp): every
    sequence's window and a batch, rounded up to 256, unless --swa-full gives them n_ctx."""
    if shape.swa_full:
        return shape.n_ctx
    cells = n_swa * (shape.n_seq_max if shape.unified else 1) + (shape.n_ubatch or shape.n_batch)
    return min(shape.n_ctx, -(-cells // 256) * 256)


def _probe_layout(ctx: Context, recurrent: bool) -> KVLayout:
    """Computes one token in sequence 0 to read the serialised layout, then forgets it."""
    batch = Batch(1)
    try:
        # With one output, as every later step has: a context whose first decode had none
        # crashed on Vulkan (Mesa's lavapipe) at a later batch of several outputs.
        batch.add([ctx.model.bos_token if ctx.model.bos_token >= 0 else 0], 0, 0, 1)
        ctx.decode(batch)
        state_bytes = len(ctx.sequence_state(0, partial=True)) if recurrent else 0
        if recurrent and not state_bytes:
            raise LayoutError("llama.cpp wrote no recurrent state")
        return KVLayout.from_sequence_state(ctx.sequence_state(0), state_bytes)
    finally:
        ctx.forget(0)
        batch.close()
