"""A second llama.cpp context where a fresh prompt is computed away from the pool.

In the unified pool every query row of a prompt chunk reads the mask of every live cell, the
other sequences' included: beside 8 sequences of 300-600 cells a 256-token prompt took 10-13%
longer there than in a context of its own, moving its KV into the pool after included
(`python -m loadtest.step_cost`). So the engine computes one fresh prompt at a time here, chunk
by chunk as the step budget allows, and moves its cells into the pool once the last chunk is
computed, before its first token is sampled: from then on it decodes in the pool like any
other sequence, and shares its cells from there.

Only a prompt with nothing cached goes here (a cached prefix is loaded into the pool, where
other sequences may share it), and only in a model whose KV moves whole: no sliding window,
no recurrent state.
"""

from __future__ import annotations

from engine.config import ContextShape
from engine.llama import Context, Model

# The sequence id the prompt has in this context: it holds one at a time.
SEQ = 0


class PrefillContext:
    def __init__(self, model: Model, pool_shape: ContextShape, n_cells: int) -> None:
        """`n_cells`: the longest prompt computed here (longer ones stay in the pool)."""
        self.ctx = Context(model, ContextShape(
            n_ctx=n_cells, n_seq_max=1, n_batch=pool_shape.n_batch, n_outputs=1,
            n_threads=pool_shape.n_threads, kv_type=pool_shape.kv_type,
            flash_attn=pool_shape.flash_attn, unified=True))
        self.n_cells = n_cells
        self.busy = False

    def takes(self, n_tokens: int) -> bool:
        return not self.busy and n_tokens <= self.n_cells

    def move_into(self, pool: Context, seq_id: int) -> None:
        """Gives the pool's (empty) sequence `seq_id` the prompt's cells, and frees this
        context. Raises DecodeError when the pool refuses them (no room)."""
        try:
            pool.load_sequence_state(seq_id, self.ctx.sequence_state(SEQ))
        finally:
            self.release()

    def release(self) -> None:
        self.ctx.clear()
        self.busy = False

    def close(self) -> None:
        self.ctx.close()
