"""Real KV blocks round-trip through the pool, in both engine modes' context layouts.

This also pins the serialised layout of the vendored llama.cpp: if an upgrade changes it, these
tests fail instead of the cache serving garbage."""

from __future__ import annotations

import numpy as np
import pytest

from cache.kv_codec import (
    KVLayout,
    LayoutError,
    SectionLayout,
    SequenceAssembler,
    SequenceState,
)
from engine.config import EngineConfig
from engine.llama import Batch, Context, DecodeError

BLOCK = 16
SCRATCH = 3


MODES = {"default": {}, "default --no-flash-attn": {"flash_attn": False},
         "deterministic": {"deterministic": True}}


@pytest.fixture(scope="module", params=list(MODES))
def ctx(request, local_model):
    context = Context(local_model, EngineConfig(parallel=3, ctx_size=3 * 512, batch_tokens=256,
                                                **MODES[request.param]).context_shape())
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


def to_blocks(state: SequenceState, end: int) -> list[tuple[np.ndarray, int]]:
    """Positions [0, end) cut into blocks, as a store writes them into arena slots."""
    blocks = []
    for start in range(0, end, BLOCK):
        block = np.zeros(state.layout.block_bytes(BLOCK), np.uint8)
        stop = min(start + BLOCK, end)
        state.write_block(block, start, start, stop)
        blocks.append((block, stop - start))
    return blocks


def rows_by_position(state: SequenceState, section: int = 0) -> list[np.ndarray]:
    """Every layer's K and V rows of a section, in position order, as bytes per cell."""
    rows = state.sections[section]
    v = [layer[:, rows.cell_of].T for layer in rows.v] if state.layout.v_trans \
        else [layer[rows.cell_of] for layer in rows.v]
    return [np.ascontiguousarray(layer).view(np.uint8).reshape(len(rows.cell_of), -1)
            for layer in [layer[rows.cell_of] for layer in rows.k] + v]


def test_restored_prefix_continues_like_a_cold_prefill(ctx, local_model, capsys):
    """Bitwise in the deterministic layout; in the unified ones (F16) the
    restored cells sit elsewhere in the pool, so sums group differently: close, not equal."""
    tokens = local_model.tokenize("The history of the radix tree begins with " * 8,
                                  add_special=False, parse_special=False)
    prefix, tail = tokens[:-5], tokens[-5:]
    cold = prefill(ctx, tokens, seq=0)
    prefill(ctx, prefix, seq=1)
    state = SequenceState.parse(ctx.sequence_state(1), layout=None)
    try:
        blob = SequenceAssembler(state.layout).assemble(to_blocks(state, len(prefix)), 2)
        ctx.load_sequence_state(2, blob)
        warm = prefill(ctx, tail, seq=2, start=len(prefix))
    finally:
        ctx.clear()
    diff = float(np.abs(warm - cold).max())
    with capsys.disabled():
        print(f"\nmax abs logit difference, restored prefix vs cold prefill "
              f"({'unified F16' if ctx.shape.unified else 'deterministic'}): {diff}")
    if ctx.shape.unified:
        assert diff < 1.0  # rounding noise (docs/deterministic.md): up to ~0.98 here
        assert int(np.argmax(warm)) == int(np.argmax(cold))
    else:
        assert diff == 0.0


def test_round_trip_keeps_every_byte_even_out_of_cell_order(ctx, local_model):
    """Cells out of position order (a unified pool reuses freed cells) and transposed V (flash
    attention off) come back byte for byte, each at its position, through partial blocks."""
    words = local_model.tokenize("Alpha beta gamma delta epsilon zeta eta theta " * 6,
                                 add_special=False, parse_special=False)
    prefill(ctx, words[:40], seq=0)
    prefill(ctx, words[:30], seq=1)
    ctx.forget(0)  # frees cells before sequence 1's, which its next tokens take in a unified pool
    prefill(ctx, words[30:45], seq=1, start=30)
    source = SequenceState.parse(ctx.sequence_state(1), layout=None)
    if ctx.shape.unified:
        assert np.any(np.diff(source.sections[0].cell_of) < 0)  # really out of order
    expected = rows_by_position(source)
    layout = source.layout
    try:
        used = 2 * BLOCK + 5  # two whole blocks and 5 cells of the third
        blocks = to_blocks(source, 45)
        blob = SequenceAssembler(layout).assemble(blocks[:2] + [(blocks[2][0], 5)], seq_id=2)
        ctx.load_sequence_state(2, blob)
        loaded = SequenceState.parse(ctx.sequence_state(2), layout)
    finally:
        ctx.clear()
    assert loaded.sections[0].first_pos == 0 and len(loaded.sections[0].cell_of) == used
    for got, want in zip(rows_by_position(loaded), expected, strict=True):
        assert np.array_equal(got, want[:used])


def test_layout_is_read_and_checked(ctx, local_model):
    prefill(ctx, [1, 2, 3], seq=0)
    blob = bytes(ctx.sequence_state(0))
    ctx.clear()
    layout = KVLayout.from_sequence_state(blob)
    assert layout.n_layer == 30
    if ctx.shape.unified:  # F16 rows of 192 values, V transposed without flash attention
        assert layout.n_stream == 1 and layout.v_trans == (not ctx.shape.flash_attn)
        assert layout.bytes_per_token == 2 * 30 * 192 * 2
    else:  # Q8_0 rows of 192 values: 6 blocks of 34 bytes
        assert layout.n_stream == 3 and not layout.v_trans
        assert layout.bytes_per_token == 2 * 30 * 204
    with pytest.raises(LayoutError):
        SequenceState.parse(blob, layout=KVLayout(4, False, (
            SectionLayout((1,), (2,), (1,), (2,), (0,)),)))
    with pytest.raises(LayoutError):
        SequenceState.parse(b"\0" * len(blob), layout=None)


def test_a_load_into_fragmented_cells_takes_any_free_ones(ctx, local_model):
    """Review: a load needs as many free cells as it brings, not a run of them. Two sequences
    decoded in turns fill the unified pool in 32-cell stripes; forgetting one leaves half the
    pool free with no free run longer than 32, and a 100-cell prefix still loads, exact."""
    if not ctx.shape.unified:
        pytest.skip("a stream per sequence: nothing else lives among its cells")
    stripe, n_cells = 32, ctx.shape.n_ctx
    tokens = [100 + i % 900 for i in range(n_cells // 2)]
    for start in range(0, len(tokens), stripe):
        for seq in (0, 1):
            prefill(ctx, tokens[start:start + stripe], seq, start)
    source = SequenceState.parse(ctx.sequence_state(0), layout=None)
    expected = rows_by_position(source)
    used = 100
    blob = SequenceAssembler(source.layout).assemble(to_blocks(source, used), seq_id=2)
    try:
        with pytest.raises(DecodeError):  # the pool is full: nowhere to load
            ctx.load_sequence_state(2, blob)
        ctx.forget(0)  # half the pool free, in stripes of 32 cells between sequence 1's
        ctx.load_sequence_state(2, blob)
        loaded = SequenceState.parse(ctx.sequence_state(2), source.layout)
    finally:
        ctx.clear()
    assert len(loaded.sections[0].cell_of) == used
    for got, want in zip(rows_by_position(loaded), expected, strict=True):
        assert np.array_equal(got, want[:used])
