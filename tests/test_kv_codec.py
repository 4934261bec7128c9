"""Real KV blocks round-trip through the pool: a restored prefix continues exactly as a cold one.

This also pins the serialised layout of the vendored llama.cpp: if an upgrade changes it, these
tests fail instead of the cache serving garbage."""

from __future__ import annotations

import numpy as np
import pytest

from cache.block_pool import BlockPool
from cache.kv_codec import KVLayout, LayoutError, SequenceState, assemble_sequence
from gateway.llama import Batch, Context, ContextShape

BLOCK = 16


@pytest.fixture(scope="module")
def ctx(local_model):
    context = Context(local_model, ContextShape(n_ctx=4 * 512, n_seq_max=4, n_batch=256,
                                                n_threads=2))
    yield context
    context.close()


def prefill(ctx: Context, tokens: list[int], seq: int, start: int = 0) -> np.ndarray:
    batch = Batch(256)
    try:
        index = batch.add(tokens, start, seq, True)
        ctx.decode(batch)
        return ctx.logits(index).copy()
    finally:
        batch.close()


def test_restored_prefix_gives_bitwise_identical_logits(ctx, local_model, capsys):
    tokens = local_model.tokenize("The history of the radix tree begins with " * 8,
                                  add_special=False, parse_special=False)
    prefix, tail = tokens[:-5], tokens[-5:]
    cold = prefill(ctx, tokens, seq=0)

    prefill(ctx, prefix, seq=1)
    state = SequenceState.parse(ctx.sequence_state(1), layout=None)
    layout = state.layout
    pool = BlockPool("test-codec", layout.block_bytes(BLOCK), 64 << 20, "fp", BLOCK)
    try:
        blocks = []
        for start in range(0, len(prefix), BLOCK):
            slot = pool.allocate()
            end = min(start + BLOCK, len(prefix))
            state.write_block(pool.block(slot), start, end)
            blocks.append((pool.block(slot), end - start))
        ctx.load_sequence_state(2, assemble_sequence(layout, blocks, seq_id=2))
        warm = prefill(ctx, tail, seq=2, start=len(prefix))
    finally:
        pool.close()
        for seq in range(3):
            ctx.forget(seq)
    diff = float(np.abs(warm - cold).max())
    with capsys.disabled():
        print(f"\nmax abs logit difference, restored prefix vs cold prefill: {diff}")
    assert diff == 0.0


def test_partial_block_reuse_is_exact(ctx, local_model):
    """A match ending inside a block reuses only the matching cells of that block."""
    tokens = local_model.tokenize("Alpha beta gamma delta epsilon zeta eta theta " * 4,
                                  add_special=False, parse_special=False)
    cold = prefill(ctx, tokens, seq=0)
    prefill(ctx, tokens[:BLOCK * 2], seq=1)
    state = SequenceState.parse(ctx.sequence_state(1), layout=None)
    pool = BlockPool("test-partial", state.layout.block_bytes(BLOCK), 16 << 20, "fp", BLOCK)
    try:
        slots = [pool.allocate(), pool.allocate()]
        state.write_block(pool.block(slots[0]), 0, BLOCK)
        state.write_block(pool.block(slots[1]), BLOCK, 2 * BLOCK)
        used = BLOCK + 5  # the whole first block and 5 cells of the second
        blob = assemble_sequence(state.layout, [(pool.block(slots[0]), BLOCK),
                                                (pool.block(slots[1]), 5)], seq_id=2)
        ctx.load_sequence_state(2, blob)
        warm = prefill(ctx, tokens[used:], seq=2, start=used)
    finally:
        pool.close()
        for seq in range(3):
            ctx.forget(seq)
    assert float(np.abs(warm - cold).max()) == 0.0


def test_layout_is_read_and_checked(ctx, local_model):
    prefill(ctx, [1, 2, 3], seq=0)
    blob = bytes(ctx.sequence_state(0))
    ctx.forget(0)
    layout = KVLayout.from_sequence_state(blob)
    assert layout.n_layer == 30 and layout.n_stream == 4
    assert layout.bytes_per_token == 2 * 30 * 204  # Q8_0 rows of 192 values
    with pytest.raises(LayoutError):
        SequenceState.parse(blob, layout=KVLayout(4, (1,), (2,), (1,), (2,)))
    with pytest.raises(LayoutError):
        SequenceState.parse(b"\0" * len(blob), layout=None)
