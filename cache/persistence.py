"""The pool's blocks on disk across restarts (`--cache-dir`).

At shutdown, once the workers have stopped, every cached block is written with the tokens of its
path and its namespace to `<dir>/prefix-cache.bin`: through a temporary file, fsync'd, then
renamed over the old one, so a crash mid-write leaves the previous snapshot whole. At start the
file is checked whole (its header against this gateway's fingerprint and block shape, every
length, a digest of everything) before a single block is adopted: a truncated, corrupted or
mismatched snapshot is refused with a log line, never half-loaded.

Layout: a JSON header line, then per block `u32 namespace length, u32 path tokens`, the
namespace, the path's tokens (int32) and the slot's bytes; last, the xxh3-128 of all before it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import stat
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import numpy as np
import xxhash

from cache.arena import BlockArena
from cache.index import CacheIndex

log = logging.getLogger(__name__)

FILE_NAME = "prefix-cache.bin"
VERSION = 1
_ENTRY = struct.Struct("<II")
_DIGEST = 16


class SnapshotError(ValueError):
    pass


@contextmanager
def private_file(directory: Path, name: str) -> Iterator[BinaryIO]:
    """`directory/name` replaced whole by what is written, readable by its owner only (every
    tenant's tokens are in such files, as in the arena): written under a name nobody can guess,
    created here (O_EXCL) and never through a planted symlink, fsync'd, then renamed over it,
    so a crash mid-write leaves the previous file whole. A write that fails (a full disk, an
    error while the caller writes) removes what it wrote and leaves the previous file as it
    was."""
    private_directory(directory)
    partial = directory / f".{name}.{secrets.token_hex(8)}"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with open(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, directory / name)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise
    # The rename itself outlives a crash once the directory is on disk.
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def private_directory(directory: Path) -> None:
    """Makes `directory` (and its missing parents) if needed, open to its owner only. One that
    exists and is ours is tightened to 0700: a `--cache-dir` made by hand under a umask of 022
    lets anyone list it, and one writable by others lets them swap in a snapshot of their own,
    which every tenant would then be answered from. One that is not ours is left as it is, with
    a warning."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = directory.stat()
    mode = stat.S_IMODE(st.st_mode)
    if not mode & 0o077:
        return
    if st.st_uid == os.geteuid():
        os.chmod(directory, 0o700)
        log.info("%s was open to others (mode %o): made it owner-only (700)", directory, mode)
    else:
        log.warning("%s is open to others (mode %o) and not ours to make owner-only: whoever "
                    "may write to it may replace what is saved there", directory, mode)


def save(directory: Path, index: CacheIndex, arena: BlockArena) -> int:
    """Writes every cached block; returns how many."""
    header = arena.header
    digest = xxhash.xxh3_128()
    with private_file(directory, FILE_NAME) as f, index.frozen() as blocks:
        def write(data: bytes | memoryview) -> None:
            f.write(data)
            digest.update(data)

        write(json.dumps({"version": VERSION, "fingerprint": header.fingerprint,
                          "block_size": header.block_size, "slot_bytes": header.slot_bytes,
                          "blocks": len(blocks)}).encode() + b"\n")
        for namespace, tokens, slot in blocks:
            write(_ENTRY.pack(len(namespace), len(tokens)))
            write(namespace)
            write(tokens.astype("<i4").tobytes())
            write(memoryview(arena.block(slot)))
        f.write(digest.digest())
    return len(blocks)


def header(directory: Path) -> dict | None:
    """The snapshot's header line (its fingerprint, block_size, slot_bytes: the arena it was
    saved from), read alone; None when there is none this version wrote. Not checked: `load`
    checks the whole file."""
    try:
        with open(directory / FILE_NAME, "rb") as f:
            found = json.loads(f.readline())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and found.get("version") == VERSION else None


def load(directory: Path, index: CacheIndex, arena: BlockArena) -> int:
    """Adopts the snapshot's blocks into an empty index; returns how many. Refuses (with a log
    line, loading nothing) a snapshot that does not verify."""
    path = directory / FILE_NAME
    if not path.exists():
        return 0
    start = time.perf_counter()
    slot_bytes = arena.header.slot_bytes
    try:
        data = path.read_bytes()
        entries = _parse(data, arena)
    except (OSError, ValueError, struct.error) as exc:
        log.error("not loading the prefix-cache snapshot %s: %s", path, exc)
        return 0
    offsets = {(namespace, tokens.tobytes()): offset for namespace, tokens, offset in entries}
    # A block's bytes go from the file's to the arena's without a copy between: views into
    # the one buffer read (a slice of bytes is a copy: with the whole body's, those copies
    # took as long as reading the file, before a reloaded model served).
    view = memoryview(data)
    for namespace, tokens, _ in entries:  # least recently used first, as saved

        def block_bytes(_begin: int, end: int, namespace=namespace, tokens=tokens):
            offset = offsets.get((namespace, tokens[:end].tobytes()))
            return None if offset is None else view[offset: offset + slot_bytes]

        index.adopt(tokens, namespace.decode(), block_bytes, arena)
    log.info("loaded %d cached blocks from %s in %.2f s", len(entries), path,
             time.perf_counter() - start)
    return len(entries)


def _parse(data: bytes, arena: BlockArena) -> list[tuple[bytes, np.ndarray, int]]:
    """(namespace, path tokens, offset of the block's bytes) per block, all checked."""
    if len(data) < _DIGEST + 2:
        raise SnapshotError("truncated")
    body = memoryview(data)[: len(data) - _DIGEST]  # not a copy
    if xxhash.xxh3_128(body).digest() != data[len(data) - _DIGEST:]:
        raise SnapshotError("its digest does not match: truncated or corrupted")
    end_of_header = data.find(b"\n", 0, len(body))
    header = json.loads(data[:end_of_header])
    expected = {"version": VERSION, "fingerprint": arena.header.fingerprint,
                "block_size": arena.header.block_size, "slot_bytes": arena.header.slot_bytes}
    for key, value in expected.items():
        if header.get(key) != value:
            raise SnapshotError(f"it was written for another {key} ({header.get(key)!r})")
    entries, offset = [], end_of_header + 1
    for _ in range(header["blocks"]):
        n_namespace, n_tokens = _ENTRY.unpack_from(body, offset)
        offset += _ENTRY.size
        namespace = bytes(body[offset: offset + n_namespace])
        offset += n_namespace
        tokens = np.frombuffer(body, "<i4", n_tokens, offset).astype(np.int32)
        offset += 4 * n_tokens
        entries.append((namespace, tokens, offset))
        offset += arena.header.slot_bytes
        if offset > len(body):
            raise SnapshotError("an entry runs past the end")
    if offset != len(body):
        raise SnapshotError("bytes left after the last entry")
    return entries
