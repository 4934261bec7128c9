"""The shared-memory file that holds KV block bytes.

The gateway creates the arena and is the only process that manages block metadata (kept outside
the file); workers attach to read and write the bytes of the slots they are given. The file is a
JSON `ArenaHeader` zero-padded to HEADER_BYTES, then n_slots slots of slot_bytes each.

The creator holds an exclusive flock on the file for as long as it lives. That lock, not a pid, is
what tells a live arena from one left by a killed gateway: pids say nothing across containers that
share /dev/shm, while the kernel drops a lock the moment its holder dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
HEADER_BYTES = 4096
ARENA_PREFIX = "prefixgate-"

# Each retry means another process removed the file we had just created; a few in a row would
# mean something keeps sweeping live files, which retrying will not fix.
_CREATE_ATTEMPTS = 5


class ArenaInUse(RuntimeError):
    """The path belongs to an arena whose owner is alive."""


class ArenaMismatch(RuntimeError):
    """The file is not an arena of the expected model, or its size disagrees with its header."""


@dataclass(frozen=True)
class ArenaHeader:
    fingerprint: str
    slot_bytes: int
    n_slots: int
    block_size: int  # tokens per block

    def __post_init__(self) -> None:
        if min(self.slot_bytes, self.n_slots, self.block_size) < 1:
            raise ValueError(f"an arena needs positive sizes, not {self}")

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + self.n_slots * self.slot_bytes


class BlockArena:
    """A mapped arena; `create` makes the owner's, `attach` another process's view of it."""

    def __init__(self, path: Path, header: ArenaHeader, mapped: mmap.mmap,
                 lock_fd: int | None) -> None:
        self.path = path
        self.header = header
        self._map = mapped
        self._lock_fd = lock_fd  # only the owner has one
        self._slots: np.ndarray | None = np.frombuffer(
            mapped, np.uint8, count=header.n_slots * header.slot_bytes, offset=HEADER_BYTES,
        ).reshape(header.n_slots, header.slot_bytes)

    @classmethod
    def create(cls, path: Path, header: ArenaHeader) -> BlockArena:
        """A new arena at path, owned (locked) by this process until close().

        A file left at path by a dead owner is replaced; one with a live owner raises ArenaInUse.
        """
        encoded = json.dumps(asdict(header)).encode()
        if len(encoded) > HEADER_BYTES:
            raise ValueError(f"an arena header must fit in {HEADER_BYTES} bytes: {header}")
        fd = _create_locked(path)
        try:
            os.ftruncate(fd, header.file_bytes)  # zero-filled, so the header comes out padded
            mapped = mmap.mmap(fd, header.file_bytes)
        except BaseException:
            path.unlink(missing_ok=True)
            os.close(fd)
            raise
        mapped[: len(encoded)] = encoded
        return cls(path, header, mapped, fd)

    @classmethod
    def attach(cls, path: Path, fingerprint: str) -> BlockArena:
        """Map an arena another process created; raises ArenaMismatch if it is not for us."""
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise ArenaMismatch(f"{path} is {size} bytes, too short for an arena")
            mapped = mmap.mmap(fd, size)
        finally:
            os.close(fd)  # the mapping keeps the file; an attached arena holds no lock
        try:
            header = _parse_header(path, mapped, fingerprint)
        except BaseException:
            mapped.close()
            raise
        return cls(path, header, mapped, None)

    @property
    def capacity_bytes(self) -> int:
        return self.header.n_slots * self.header.slot_bytes

    def block(self, slot: int) -> np.ndarray:
        """A writable uint8 view of one slot's bytes."""
        if self._slots is None:
            raise ValueError(f"arena {self.path} is closed")
        if not 0 <= slot < self.header.n_slots:
            raise IndexError(f"slot {slot} is outside arena of {self.header.n_slots} slots")
        return self._slots[slot]

    def close(self) -> None:
        """Unmap; the owner also removes the file. Safe to call twice."""
        self._slots = None
        # Views handed out by block() that are still referenced pin the mapping; it is then
        # released when they are collected, which is all we could do anyway.
        with contextlib.suppress(BufferError):
            self._map.close()
        if self._lock_fd is not None:
            # Unlink before unlocking: once unlocked, another create() may replace the file at
            # path with its own live arena, which our unlink would then remove.
            self.path.unlink(missing_ok=True)
            os.close(self._lock_fd)
            self._lock_fd = None


def default_arena_path() -> Path:
    """A fresh arena path; a uuid, since pids repeat across containers sharing SHM_DIR."""
    return SHM_DIR / f"{ARENA_PREFIX}{uuid.uuid4().hex}"


def remove_stale_arenas(directory: Path = SHM_DIR) -> list[Path]:
    """Remove the arenas in directory whose owner died; returns the paths removed."""
    removed = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if not entry.name.startswith(ARENA_PREFIX) or not entry.is_file(follow_symlinks=False):
                continue
            path = Path(entry.path)
            try:
                if _unlink_if_unlocked(path):
                    removed.append(path)
            except BlockingIOError:
                continue  # a live owner holds it
            except PermissionError:
                continue  # another user's arena: we can neither judge nor remove it
    return removed


def _create_locked(path: Path) -> int:
    """Create path exclusively and lock it; the fd of a locked file that path names."""
    for _ in range(_CREATE_ATTEMPTS):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            try:
                _unlink_if_unlocked(path)
            except BlockingIOError:
                raise ArenaInUse(f"{path} belongs to a live arena") from None
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # Someone probing for stale arenas locked our fresh file first and will remove it.
            os.close(fd)
            continue
        # A prober may have locked and removed the file between our open and our flock; then we
        # hold the lock of an unlinked file, and path names nothing or someone else's arena.
        if _names(path, fd):
            return fd
        os.close(fd)
    raise ArenaInUse(f"{path} was removed by another process {_CREATE_ATTEMPTS} times while "
                     "being created")


def _unlink_if_unlocked(path: Path) -> bool:
    """Unlink path if no one holds its lock; True if it did. BlockingIOError if someone does."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # The file we locked may have been replaced at path since we opened it; unlinking then
        # would remove a file we never judged.
        if not _names(path, fd):
            return False
        path.unlink(missing_ok=True)
        return True
    finally:
        os.close(fd)  # which also drops our lock


def _names(path: Path, fd: int) -> bool:
    """Whether path still names the file open at fd."""
    try:
        at_path = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (at_path.st_dev, at_path.st_ino) == (opened.st_dev, opened.st_ino)


def _parse_header(path: Path, mapped: mmap.mmap, fingerprint: str) -> ArenaHeader:
    try:
        header = ArenaHeader(**json.loads(mapped[:HEADER_BYTES].rstrip(b"\0")))
    except (ValueError, TypeError) as e:  # not JSON, not an object, or wrong fields
        raise ArenaMismatch(f"{path} has no valid arena header: {e}") from None
    if header.fingerprint != fingerprint:
        raise ArenaMismatch(f"{path} holds KV of model {header.fingerprint}, not {fingerprint}")
    if len(mapped) != header.file_bytes:
        raise ArenaMismatch(f"{path} is {len(mapped)} bytes, its header says {header.file_bytes}")
    return header
