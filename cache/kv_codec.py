"""The KV block codec: llama.cpp's serialised sequence state <-> fixed-size pool blocks.

`llama_state_seq_get_data` writes one sequence as (little-endian) u32 magic 0xAF143CD8, i32
source seq id, then one section per KV cache of the context: one for most models, two for a
sliding-window model (its full-attention layers, then its window layers). A section is:
    u32 n_stream,
    per stream: u32 cell_count, then if cell_count > 0:
        per cell: i32 pos, u32 n_seq_id (1), i32 seq id
        u32 v_trans, u32 n_layer,
        per layer K: i32 type, u64 row bytes, cell_count rows
        per layer V, v_trans = 0: i32 type, u64 row bytes, cell_count rows
        per layer V, v_trans = 1: i32 type, u32 element bytes, u32 n_embd, then n_embd rows of
                                  cell_count elements (flash attention off)
Cells come in the context's cell order, which in a unified KV pool need not be position order.
A window section holds only the cells of the last `n_swa` positions of the sequence:
llama.cpp leaves out the ones its window has passed.

A block stores the K and V rows of every layer of up to `block_size` consecutive positions,
cell-major whatever v_trans is, at fixed offsets, so one block loads into contexts with or
without flash attention. A window layer's row of a position depends only on the prefix before it,
as a full layer's does, so blocks keep them too: a sequence resumed at any position then takes
its full layers' rows from all its blocks and its window layers' rows from the last ones.
The layout is internal to the pinned llama.cpp version; the round-trip tests fail loudly if an
upgrade changes it.
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass

import numpy as np
import xxhash

MAGIC = 0xAF143CD8
_CELL = np.dtype([("pos", "<i4"), ("n_seq", "<u4"), ("seq", "<i4")])
# A resumed sequence's window rows load from a multiple of this many positions (the extra ones
# are masked). Loaded into a cleared context they then sit at the same cell offsets, modulo 64,
# as a cold prefill's, and llama.cpp's vectorised attention sums them in the same groups:
# loaded from the window's exact start, Gemma 3's logits differed by 0.75 at one prompt length
# of ten (docs/sliding-window-and-recurrent.md).
WINDOW_ALIGNMENT = 64
_BLOCK_HEADER = struct.Struct("<III")  # n_tokens, first position, holds a recurrent state


class LayoutError(ValueError):
    pass


class WindowPassed(LayoutError):
    """The window layers' rows of a position are gone: llama.cpp drops them from a sequence
    once its window has passed them, and reuses their cells."""


@dataclass(frozen=True)
class SectionLayout:
    """The layers of one KV cache, as a serialised section lists them."""

    k_types: tuple[int, ...]
    k_row_bytes: tuple[int, ...]
    v_types: tuple[int, ...]
    v_row_bytes: tuple[int, ...]
    v_element_bytes: tuple[int, ...]  # transposed V only; 0 otherwise

    @property
    def n_layer(self) -> int:
        return len(self.k_types)

    @property
    def bytes_per_token(self) -> int:
        return sum(self.k_row_bytes) + sum(self.v_row_bytes)


@dataclass(frozen=True)
class KVLayout:
    """What a serialised sequence looks like for one model and context configuration."""

    n_stream: int
    v_trans: bool
    sections: tuple[SectionLayout, ...]
    # Positions the last section keeps (the model's n_swa) when it is a window section; 0 when
    # every section keeps every position.
    window: int = 0
    # A recurrent or hybrid model's state after a position, as LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
    # writes it (blob header included), ends its blobs; a block may keep the one after its last
    # position. 0: no recurrent layers.
    state_bytes: int = 0

    @property
    def n_layer(self) -> int:
        return sum(section.n_layer for section in self.sections)

    @property
    def bytes_per_token(self) -> int:
        return sum(section.bytes_per_token for section in self.sections)

    def block_bytes(self, block_size: int) -> int:
        return _BLOCK_HEADER.size + block_size * self.bytes_per_token + self.state_bytes

    def window_start(self, end: int) -> int:
        """The first position whose window rows a sequence resumed at `end` loads: the last
        n_swa positions (a superset for chunked windows, whose start is a multiple of n_swa at
        or after it), from a multiple of WINDOW_ALIGNMENT."""
        return max(0, end - self.window) // WINDOW_ALIGNMENT * WINDOW_ALIGNMENT

    def fingerprint(self, model_id: str) -> str:
        """Blocks are only ever read by a process whose model and KV types give the same value.
        v_trans and the stream count are left out: blocks are stored the same way for both."""
        h = xxhash.xxh3_128()
        h.update(model_id.encode())
        h.update(repr([(s.k_types, s.k_row_bytes, s.v_types, s.v_row_bytes)
                       for s in self.sections]).encode())
        h.update(repr((self.window, self.state_bytes)).encode())
        return h.hexdigest()

    @classmethod
    def from_sequence_state(cls, blob: bytes | memoryview | np.ndarray,
                            state_bytes: int = 0) -> KVLayout:
        """The layout of a blob that ends with a recurrent state of `state_bytes` (as the
        partial blob gives its size), or has none."""
        if state_bytes and len(blob) == state_bytes:  # recurrent layers only
            return cls(0, False, (), state_bytes=state_bytes)
        blob = np.frombuffer(blob, np.uint8)[: len(blob) - max(0, state_bytes - 8)]
        found = SequenceState.parse(blob, layout=None).layout
        return dataclasses.replace(found, state_bytes=state_bytes)


@dataclass
class SectionRows:
    """One section of a parsed blob: per-layer rows (views into the blob) ordered by cell, and
    the cell index of each position."""

    first_pos: int
    cell_of: np.ndarray  # cell index of position first_pos + i
    k: list[np.ndarray]  # per layer: (n_cells, row bytes) uint8
    v: list[np.ndarray]  # the same, or (n_embd, n_cells) of whole elements when V is transposed

    @property
    def end_pos(self) -> int:
        return self.first_pos + len(self.cell_of)


@dataclass
class SequenceState:
    """A parsed one-sequence blob; a section without cells is None."""

    layout: KVLayout
    sections: list[SectionRows | None]

    @classmethod
    def parse(cls, blob: bytes | memoryview | np.ndarray, layout: KVLayout | None
              ) -> SequenceState:
        buf = np.frombuffer(blob, dtype=np.uint8)
        if layout is not None and layout.state_bytes:  # the recurrent state after the sections
            buf = buf[: len(buf) - (layout.state_bytes - 8)]
        magic, _seq = struct.unpack_from("<Ii", buf, 0)
        if magic != MAGIC:
            raise LayoutError(f"unexpected sequence state magic {magic:#x}")
        offset, n_stream, v_trans = 8, 0, None
        sections: list[SectionRows | None] = []
        found: list[SectionLayout | None] = []
        while offset < len(buf):
            (n_stream,) = struct.unpack_from("<I", buf, offset)
            rows, section, section_v_trans, offset = _read_section(buf, offset + 4, n_stream)
            if section_v_trans is not None:
                if v_trans is not None and section_v_trans != v_trans:
                    raise LayoutError("sections disagree on V's layout")
                v_trans = section_v_trans
            sections.append(rows)
            found.append(section)
        if not any(sections):
            raise LayoutError("the sequence holds no cells")
        if layout is None:
            if None in found:
                raise LayoutError("a section holds no cells: its layers are unknown")
            layout = KVLayout(n_stream, bool(v_trans), tuple(found))
        elif (n_stream, bool(v_trans), len(found)) != (layout.n_stream, layout.v_trans,
                                                        len(layout.sections)) or any(
                section not in (None, expected)
                for section, expected in zip(found, layout.sections, strict=True)):
            raise LayoutError(f"KV layout changed: {found} != {layout}")
        return cls(layout, sections)

    def write_block(self, block: np.ndarray, block_start: int, start: int, end: int) -> None:
        """Copy every section's rows of positions [start, end) into the block that begins at
        position block_start; the block then holds [block_start, end). Raises WindowPassed
        when a section lacks some of those positions."""
        for rows in self.sections:
            if rows is None or rows.first_pos > start or rows.end_pos < end:
                raise WindowPassed(f"the rows of positions [{start}, {end}) are not all here")
        _BLOCK_HEADER.pack_into(block, 0, end - block_start, block_start, 0)
        dests = iter(_block_rows(block, self.layout, start - block_start, end - block_start))
        for rows in self.sections:
            cells = _cell_index(rows.cell_of[start - rows.first_pos: end - rows.first_pos])
            for layer in rows.k:
                next(dests)[:] = layer[cells]
            for layer in rows.v:
                dest = next(dests)
                if self.layout.v_trans:  # (n_embd, cells) of whole elements: gather by cell
                    dest.view(layer.dtype)[:] = layer[:, cells].T
                else:
                    dest[:] = layer[cells]


def block_tokens(block: np.ndarray) -> tuple[int, int]:
    """(n_tokens, first position) stored in a block."""
    return _BLOCK_HEADER.unpack_from(block, 0)[:2]


def write_block_header(block: np.ndarray, block_start: int, end: int) -> None:
    """A block of positions [block_start, end) without rows: a recurrent model's."""
    _BLOCK_HEADER.pack_into(block, 0, end - block_start, block_start, 0)


def write_state(block: np.ndarray, state: np.ndarray) -> None:
    """Keeps the recurrent state after the block's last position, a partial blob."""
    block[len(block) - len(state):] = state
    n_tokens, first, _ = _BLOCK_HEADER.unpack_from(block, 0)
    _BLOCK_HEADER.pack_into(block, 0, n_tokens, first, 1)


def block_state(block: np.ndarray, layout: KVLayout) -> np.ndarray | None:
    """The recurrent state after the block's last position, if it keeps one."""
    if not layout.state_bytes or not _BLOCK_HEADER.unpack_from(block, 0)[2]:
        return None
    return block[len(block) - layout.state_bytes:]


class SequenceAssembler:
    """Builds blobs that `llama_state_seq_set_data` loads as one sequence, in a buffer reused
    from call to call: assembling writes every byte once, with no intermediate copy."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self._buffer = np.empty(0, np.uint8)

    def assemble(self, blocks: list[tuple[np.ndarray, int]], seq_id: int, *,
                 full: bool = True, window: bool = True,
                 state: np.ndarray | None = None) -> np.ndarray:
        """The first `n` cells of each given block, in order; blocks hold consecutive
        positions. A window section brings only the positions a sequence resumed at their end
        needs. `full=False` leaves the other sections out: the blob then loads with
        LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY. `window=False` writes the window section empty. A
        recurrent model's `state` (a partial blob) ends the blob. The result is a view of the
        reused buffer, valid until the next call."""
        layout = self.layout
        first = block_tokens(blocks[0][0])[1]
        end = first + sum(n for _, n in blocks)
        last = len(layout.sections) - 1
        ranges: dict[int, tuple[int, int]] = {}  # section -> the positions it brings
        for i in range(len(layout.sections)):
            if layout.window and i == last:
                ranges[i] = (max(first, layout.window_start(end)), end) if window else (end, end)
            elif full:
                ranges[i] = (first, end)
        tail = state[8:] if state is not None else state  # without its blob header
        size = 8 + sum(_section_bytes(layout, layout.sections[i], hi - lo)
                       for i, (lo, hi) in ranges.items()) + (len(tail) if tail is not None else 0)
        if len(self._buffer) < size:
            self._buffer = np.empty(size, np.uint8)
        out = self._buffer[:size]
        struct.pack_into("<Ii", out, 0, MAGIC, seq_id)
        offset = 8
        views = [(_block_rows(block, layout, 0, n), block_tokens(block)[1], n)
                 for block, n in blocks]
        layer_base = 0
        for i, section in enumerate(layout.sections):
            if i in ranges:
                lo, hi = ranges[i]
                offset = _write_section(out, offset, layout, section, seq_id, lo, hi,
                                        [(rows[layer_base:], start, n)
                                         for rows, start, n in views])
            layer_base += 2 * section.n_layer
        if tail is not None:
            out[offset:] = tail
        return out


def _read_section(buf: np.ndarray, offset: int, n_stream: int):
    """(rows or None, layout or None, v_trans or None, offset after it)."""
    rows = layout = v_trans = None
    for _ in range(n_stream):
        (count,) = struct.unpack_from("<I", buf, offset)
        offset += 4
        if count == 0:
            continue
        if rows is not None:
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
        layout = SectionLayout(k_types, k_rows, v_types, v_rows, v_elements)
        order = np.argsort(cells["pos"], kind="stable")
        first_pos = int(cells["pos"][order[0]])
        if np.any(cells["pos"][order] != np.arange(first_pos, first_pos + len(order))):
            raise LayoutError("sequence positions are not consecutive")
        rows = SectionRows(first_pos, order, k, v)
    return rows, layout, v_trans, offset


def _section_bytes(layout: KVLayout, section: SectionLayout, n_cells: int) -> int:
    size = 4 + 4 * layout.n_stream
    if n_cells:
        size += n_cells * (_CELL.itemsize + section.bytes_per_token) + 8 + 24 * section.n_layer
    return size


def _write_section(out: np.ndarray, offset: int, layout: KVLayout, section: SectionLayout,
                   seq_id: int, lo: int, hi: int,
                   views: list[tuple[list[np.ndarray], int, int]]) -> int:
    """Writes positions [lo, hi) of one section from the blocks' row views; returns the offset
    after it. The section's cells are all in the first stream, the others are empty."""
    total = hi - lo
    struct.pack_into("<II", out, offset, layout.n_stream, total)
    offset += 8
    if total:
        cells = np.frombuffer(out, _CELL, total, offset)
        cells["pos"] = np.arange(lo, hi)
        cells["n_seq"] = 1
        cells["seq"] = seq_id
        offset += total * _CELL.itemsize
        struct.pack_into("<II", out, offset, int(layout.v_trans), section.n_layer)
        offset += 8
        # Per block, the rows it holds of [lo, hi).
        parts = [(rows, max(lo, start) - start, min(hi, start + n) - start)
                 for rows, start, n in views if start < hi and start + n > lo]
        n_layer = section.n_layer
        for layer in range(2 * n_layer):
            i = layer % n_layer
            if layer < n_layer or not layout.v_trans:
                types, row_bytes = ((section.k_types, section.k_row_bytes) if layer < n_layer
                                    else (section.v_types, section.v_row_bytes))
                struct.pack_into("<iQ", out, offset, types[i], row_bytes[i])
                offset += 12
                for rows, a, b in parts:
                    part = rows[layer][a:b]
                    out[offset: offset + part.size] = part.reshape(-1)
                    offset += part.size
            else:  # transposed V: one row per embedding dimension, one element per cell
                element = section.v_element_bytes[i]
                dtype = _element_dtype(element)
                n_embd = section.v_row_bytes[i] // element
                struct.pack_into("<iII", out, offset, section.v_types[i], element, n_embd)
                offset += 12
                size = n_embd * total * element
                dest = out[offset: offset + size].view(dtype).reshape(n_embd, total)
                cell = 0
                for rows, a, b in parts:
                    dest[:, cell: cell + b - a] = rows[layer][a:b].view(dtype).T
                    cell += b - a
                offset += size
    empty = 4 * (layout.n_stream - 1)
    out[offset: offset + empty] = 0  # the empty streams' cell counts
    return offset + empty


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


def _block_rows(block: np.ndarray, layout: KVLayout, lo: int, hi: int) -> list[np.ndarray]:
    """Views of a block's rows [lo, hi) per layer: each section's K layers then its V layers.
    Each layer owns a fixed region sized for a full block, so a block's rows never move when
    it is partly used."""
    capacity = (len(block) - _BLOCK_HEADER.size - layout.state_bytes) // layout.bytes_per_token
    views, offset = [], _BLOCK_HEADER.size
    for section in layout.sections:
        for row_bytes in section.k_row_bytes + section.v_row_bytes:
            views.append(block[offset + lo * row_bytes: offset + hi * row_bytes]
                         .reshape(hi - lo, row_bytes))
            offset += capacity * row_bytes
    return views
