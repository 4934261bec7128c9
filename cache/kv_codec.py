"""The KV block codec: llama.cpp's serialised sequence state <-> fixed-size pool blocks.

`llama_state_seq_get_data` writes one sequence as (little-endian):
    u32 magic 0xAF143CD8, i32 source seq id, u32 n_stream,
    per stream: u32 cell_count, then if cell_count > 0:
        per cell: i32 pos, u32 n_seq_id (1), i32 seq id
        u32 v_trans, u32 n_layer,
        per layer K: i32 type, u64 row bytes, cell_count rows
        per layer V, v_trans = 0: i32 type, u64 row bytes, cell_count rows
        per layer V, v_trans = 1: i32 type, u32 element bytes, u32 n_embd, then n_embd rows of
                                  cell_count elements (flash attention off)
Cells come in the context's cell order, which in a unified KV pool need not be position order.
A block stores the K and V rows of up to `block_size` consecutive positions, cell-major whatever
v_trans is, at fixed offsets, so one block loads into contexts with or without flash attention.
The layout is internal to the pinned llama.cpp version; the round-trip tests fail loudly if an
upgrade changes it.
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
    v_trans: bool
    k_types: tuple[int, ...]
    k_row_bytes: tuple[int, ...]
    v_types: tuple[int, ...]
    v_row_bytes: tuple[int, ...]
    v_element_bytes: tuple[int, ...]

    @property
    def n_layer(self) -> int:
        return len(self.k_types)

    @property
    def bytes_per_token(self) -> int:
        return sum(self.k_row_bytes) + sum(self.v_row_bytes)

    def block_bytes(self, block_size: int) -> int:
        return _BLOCK_HEADER.size + block_size * self.bytes_per_token

    def fingerprint(self, model_id: str) -> str:
        """Blocks are only ever read by a process whose model and KV types give the same value.
        v_trans and the stream count are left out: blocks are stored the same way for both."""
        h = xxhash.xxh3_128()
        h.update(model_id.encode())
        h.update(repr((self.k_types, self.k_row_bytes, self.v_types, self.v_row_bytes)).encode())
        return h.hexdigest()

    @classmethod
    def from_sequence_state(cls, blob: bytes | memoryview | np.ndarray) -> KVLayout:
        return SequenceState.parse(blob, layout=None).layout


@dataclass
class SequenceState:
    """A parsed one-sequence blob: per-layer rows (views into the blob) ordered by cell, and the
    cell index of each position."""

    layout: KVLayout
    first_pos: int
    cell_of: np.ndarray  # cell index of position first_pos + i
    k: list[np.ndarray]  # per layer: (n_cells, row bytes) uint8
    v: list[np.ndarray]  # the same, or (n_embd, n_cells) of whole elements when V is transposed

    @classmethod
    def parse(cls, blob: bytes | memoryview | np.ndarray, layout: KVLayout | None
              ) -> SequenceState:
        buf = np.frombuffer(blob, dtype=np.uint8)
        magic, _seq, n_stream = struct.unpack_from("<IiI", buf, 0)
        if magic != MAGIC:
            raise LayoutError(f"unexpected sequence state magic {magic:#x}")
        offset, cells = 12, None
        for _ in range(n_stream):
            (count,) = struct.unpack_from("<I", buf, offset)
            offset += 4
            if count == 0:
                continue
            if cells is not None:
                raise LayoutError("a sequence spans more than one KV stream")
            cells = np.frombuffer(buf, _CELL, count, offset)
            if np.any(cells["n_seq"] != 1):
                raise LayoutError("cells listed with several sequences (or with extensions)")
            offset += count * _CELL.itemsize
            v_trans, n_layer = struct.unpack_from("<II", buf, offset)
            offset += 8
            k, k_types, k_rows, offset = _read_rows(buf, offset, n_layer, count)
            if v_trans:
                v, v_types, v_rows, v_elements, offset = _read_transposed(buf, offset, n_layer,
                                                                          count)
            else:
                v, v_types, v_rows, offset = _read_rows(buf, offset, n_layer, count)
                v_elements = (0,) * n_layer
        if cells is None:
            raise LayoutError("the sequence holds no cells")
        found = KVLayout(n_stream, bool(v_trans), k_types, k_rows, v_types, v_rows, v_elements)
        if layout is not None and found != layout:
            raise LayoutError(f"KV layout changed: {found} != {layout}")
        order = np.argsort(cells["pos"], kind="stable")
        first_pos = int(cells["pos"][order[0]])
        if np.any(cells["pos"][order] != np.arange(first_pos, first_pos + len(order))):
            raise LayoutError("sequence positions are not consecutive")
        return cls(found, first_pos, order, k, v)

    def write_block(self, block: np.ndarray, start: int, end: int) -> None:
        """Copy the cells of positions [start, end) into a pool block."""
        n = end - start
        cells = _cell_index(self.cell_of[start - self.first_pos: end - self.first_pos])
        _BLOCK_HEADER.pack_into(block, 0, n, start)
        dests = _block_rows(block, self.layout, n)
        n_layer = self.layout.n_layer
        for rows, dest in zip(self.k, dests[:n_layer], strict=True):
            dest[:] = rows[cells]
        for rows, dest in zip(self.v, dests[n_layer:], strict=True):
            if self.layout.v_trans:  # (n_embd, cells) of whole elements: gather along cells
                dest.view(rows.dtype)[:] = rows[:, cells].T
            else:
                dest[:] = rows[cells]


def block_tokens(block: np.ndarray) -> tuple[int, int]:
    """(n_tokens, first position) stored in a block."""
    return _BLOCK_HEADER.unpack_from(block, 0)


class SequenceAssembler:
    """Builds blobs that `llama_state_seq_set_data` loads as one sequence, in a buffer reused
    from call to call: assembling writes every byte once, with no intermediate copy."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self._buffer = np.empty(0, np.uint8)

    def assemble(self, blocks: list[tuple[np.ndarray, int]], seq_id: int) -> np.ndarray:
        """The first `n` cells of each given block, in order; blocks hold consecutive
        positions. The result is a view of the reused buffer, valid until the next call."""
        layout = self.layout
        total = sum(n for _, n in blocks)
        first_pos = block_tokens(blocks[0][0])[1]
        size = self.blob_bytes(total)
        if len(self._buffer) < size:
            self._buffer = np.empty(size, np.uint8)
        out = self._buffer[:size]
        struct.pack_into("<IiII", out, 0, MAGIC, seq_id, layout.n_stream, total)
        offset = 16
        cells = np.frombuffer(out, _CELL, total, offset)
        cells["pos"] = np.arange(first_pos, first_pos + total)
        cells["n_seq"] = 1
        cells["seq"] = seq_id
        offset += total * _CELL.itemsize
        struct.pack_into("<II", out, offset, int(layout.v_trans), layout.n_layer)
        offset += 8
        views = [_block_rows(block, layout, n) for block, n in blocks]
        for layer in range(2 * layout.n_layer):
            i = layer % layout.n_layer
            if layer < layout.n_layer or not layout.v_trans:
                types, row_bytes = ((layout.k_types, layout.k_row_bytes) if layer < layout.n_layer
                                    else (layout.v_types, layout.v_row_bytes))
                struct.pack_into("<iQ", out, offset, types[i], row_bytes[i])
                offset += 12
                for view in views:
                    rows = view[layer]
                    out[offset: offset + rows.size] = rows.reshape(-1)
                    offset += rows.size
            else:  # transposed V: one row per embedding dimension, one element per cell
                element = layout.v_element_bytes[i]
                dtype = _element_dtype(element)
                n_embd = layout.v_row_bytes[i] // element
                struct.pack_into("<iII", out, offset, layout.v_types[i], element, n_embd)
                offset += 12
                size = n_embd * total * element
                dest = out[offset: offset + size].view(dtype).reshape(n_embd, total)
                cell = 0
                for view, (_, n) in zip(views, blocks, strict=True):
                    dest[:, cell: cell + n] = view[layer].view(dtype).T
                    cell += n
                offset += size
        out[offset:] = 0  # the empty streams' cell counts
        return out

    def blob_bytes(self, n_cells: int) -> int:
        layout = self.layout
        per_layer_headers = 12 * 2 * layout.n_layer
        return (12 + 4 * layout.n_stream + n_cells * _CELL.itemsize + 8 + per_layer_headers
                + n_cells * layout.bytes_per_token)


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


def _read_transposed(buf: np.ndarray, offset: int, n_layer: int, count: int):
    """Transposed V as (n_embd, count) views of whole elements, without copying."""
    arrays, types, rows, elements = [], [], [], []
    for _ in range(n_layer):
        type_id, element, n_embd = struct.unpack_from("<iII", buf, offset)
        offset += 12
        size = n_embd * count * element
        arrays.append(buf[offset: offset + size].view(_element_dtype(element))
                      .reshape(n_embd, count))
        offset += size
        types.append(type_id)
        rows.append(n_embd * element)
        elements.append(element)
    return arrays, tuple(types), tuple(rows), tuple(elements), offset


def _element_dtype(element: int) -> np.dtype:
    """One KV element as one numpy item, so that gathers move elements, not bytes."""
    return np.dtype({1: "u1", 2: "<u2", 4: "<u4"}.get(element, f"V{element}"))


def _cell_index(cells: np.ndarray) -> slice | np.ndarray:
    """A slice when the cells are consecutive (the common case): a view beats a gather."""
    if len(cells) and cells[-1] - cells[0] == len(cells) - 1 and np.all(np.diff(cells) == 1):
        return slice(int(cells[0]), int(cells[-1]) + 1)
    return cells


def _block_rows(block: np.ndarray, layout: KVLayout, n: int) -> list[np.ndarray]:
    """Views of a block's first n rows per layer, K layers then V layers. Each layer owns a fixed
    region sized for a full block, so a block's rows never move when it is partly used."""
    capacity = (len(block) - _BLOCK_HEADER.size) // layout.bytes_per_token
    views, offset = [], _BLOCK_HEADER.size
    for row_bytes in layout.k_row_bytes + layout.v_row_bytes:
        views.append(block[offset: offset + n * row_bytes].reshape(n, row_bytes))
        offset += capacity * row_bytes
    return views
