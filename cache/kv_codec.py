"""The KV block codec: llama.cpp's serialised sequence state <-> fixed-size pool blocks.

`llama_state_seq_get_data` writes one sequence as (little-endian):
    u32 magic 0xAF143CD8, i32 source seq id, u32 n_stream,
    per stream: u32 cell_count, then if cell_count > 0:
        per cell: i32 pos, u32 n_seq_id (1), i32 seq id
        u32 v_trans, u32 n_layer,
        per layer K: i32 type, u64 row bytes, cell_count rows
        per layer V: i32 type, u64 row bytes, cell_count rows    (v_trans = 0 only)
A block stores the K and V rows of up to `block_size` consecutive positions at fixed offsets, so
slicing, copying and reassembling blocks are plain numpy copies. The layout is internal to the
pinned llama.cpp version; the round-trip tests fail loudly if an upgrade changes it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

MAGIC = 0xAF143CD8
_CELL = np.dtype([("pos", "<i4"), ("n_seq", "<u4"), ("seq", "<i4")])
_BLOCK_HEADER = struct.Struct("<II")  # n_tokens, first position


class LayoutError(ValueError):
    pass


@dataclass(frozen=True)
class KVLayout:
    """What a serialised sequence looks like for one model and context configuration."""

    n_stream: int
    k_types: tuple[int, ...]
    k_row_bytes: tuple[int, ...]
    v_types: tuple[int, ...]
    v_row_bytes: tuple[int, ...]

    @property
    def n_layer(self) -> int:
        return len(self.k_types)

    @property
    def bytes_per_token(self) -> int:
        return sum(self.k_row_bytes) + sum(self.v_row_bytes)

    def block_bytes(self, block_size: int) -> int:
        return _BLOCK_HEADER.size + block_size * self.bytes_per_token

    def fingerprint(self, model_id: str) -> str:
        """Blocks are only ever read by a process whose model and KV layout give the same value."""
        h = xxhash.xxh3_128()
        h.update(model_id.encode())
        h.update(repr((self.k_types, self.k_row_bytes, self.v_types, self.v_row_bytes)).encode())
        return h.hexdigest()

    @classmethod
    def from_sequence_state(cls, blob: bytes) -> KVLayout:
        seq = SequenceState.parse(blob, layout=None)
        return seq.layout


@dataclass
class SequenceState:
    """A parsed one-sequence blob: positions and per-layer row arrays (views into the blob)."""

    layout: KVLayout
    positions: np.ndarray
    k: list[np.ndarray]  # per layer: (n_cells, row bytes) uint8
    v: list[np.ndarray]

    @classmethod
    def parse(cls, blob: bytes | memoryview, layout: KVLayout | None) -> SequenceState:
        buf = np.frombuffer(blob, dtype=np.uint8)
        magic, _seq, n_stream = struct.unpack_from("<IiI", buf, 0)
        if magic != MAGIC:
            raise LayoutError(f"unexpected sequence state magic {magic:#x}")
        offset, cells, cell_count = 12, None, 0
        for _ in range(n_stream):
            (count,) = struct.unpack_from("<I", buf, offset)
            offset += 4
            if count == 0:
                continue
            if cells is not None:
                raise LayoutError("a sequence spans more than one KV stream")
            cell_count = count
            cells = np.frombuffer(buf, _CELL, count, offset)
            if np.any(cells["n_seq"] != 1):
                raise LayoutError("cells shared by several sequences (or with extensions)")
            offset += count * _CELL.itemsize
            v_trans, n_layer = struct.unpack_from("<II", buf, offset)
            offset += 8
            if v_trans:
                raise LayoutError("transposed V (flash attention off) is not supported")
            k, k_types, k_rows, offset = _read_rows(buf, offset, n_layer, count)
            v, v_types, v_rows, offset = _read_rows(buf, offset, n_layer, count)
        if cells is None:
            raise LayoutError("the sequence holds no cells")
        found = KVLayout(n_stream, k_types, k_rows, v_types, v_rows)
        if layout is not None and found != layout:
            raise LayoutError(f"KV layout changed: {found} != {layout}")
        positions = cells["pos"].copy()
        if cell_count and np.any(np.diff(positions) != 1):
            raise LayoutError("sequence positions are not consecutive")
        return cls(found, positions, k, v)

    def write_block(self, block: np.ndarray, start: int, end: int) -> None:
        """Copy the cells at indices [start, end) into a pool block."""
        n = end - start
        _BLOCK_HEADER.pack_into(block, 0, n, int(self.positions[start]))
        for rows, dest in zip(self.k + self.v, _block_rows(block, self.layout, n), strict=True):
            dest[:] = rows[start:end]


def block_tokens(block: np.ndarray) -> tuple[int, int]:
    """(n_tokens, first position) stored in a block."""
    return _BLOCK_HEADER.unpack_from(block, 0)


def assemble_sequence(layout: KVLayout, blocks: list[tuple[np.ndarray, int]],
                      seq_id: int) -> bytes:
    """A blob that `llama_state_seq_set_data` loads as one sequence: the first `n` cells of each
    given block, in order. Blocks must hold consecutive positions."""
    total = sum(n for _, n in blocks)
    first_pos = block_tokens(blocks[0][0])[1]
    cells = np.zeros(total, _CELL)
    cells["pos"] = np.arange(first_pos, first_pos + total)
    cells["n_seq"] = 1
    cells["seq"] = seq_id
    parts = [struct.pack("<IiI", MAGIC, seq_id, layout.n_stream), struct.pack("<I", total),
             cells.tobytes(), struct.pack("<II", 0, layout.n_layer)]
    views = [_block_rows(block, layout, n) for block, n in blocks]
    for layer, (types, rows) in enumerate(
            [(layout.k_types, layout.k_row_bytes)] * layout.n_layer
            + [(layout.v_types, layout.v_row_bytes)] * layout.n_layer):
        i = layer % layout.n_layer
        parts.append(struct.pack("<iQ", types[i], rows[i]))
        parts.extend(view[layer].tobytes() for view in views)
    parts.append(struct.pack("<I", 0) * (layout.n_stream - 1))
    return b"".join(parts)


def _read_rows(buf: np.ndarray, offset: int, n_layer: int, count: int):
    arrays, types, rows = [], [], []
    for _ in range(n_layer):
        type_id, row_bytes = struct.unpack_from("<iQ", buf, offset)
        offset += 12
        arrays.append(buf[offset: offset + count * row_bytes].reshape(count, row_bytes))
        offset += count * row_bytes
        types.append(type_id)
        rows.append(row_bytes)
    return arrays, tuple(types), tuple(rows), offset


def _block_rows(block: np.ndarray, layout: KVLayout, n: int) -> list[np.ndarray]:
    """Views of a block's first n rows per layer, K layers then V layers. Each layer owns a fixed
    region sized for a full block, so a block's rows never move when it is partly used."""
    capacity = (len(block) - _BLOCK_HEADER.size) // layout.bytes_per_token
    views, offset = [], _BLOCK_HEADER.size
    for row_bytes in layout.k_row_bytes + layout.v_row_bytes:
        views.append(block[offset: offset + n * row_bytes].reshape(n, row_bytes))
        offset += capacity * row_bytes
    return views
