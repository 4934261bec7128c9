"""Fixed-size KV blocks in one shared-memory arena, with reference counts.

The arena is a file under /dev/shm, mmap'd: a JSON header (name, model/KV-layout fingerprint, slot
size and count) so that another process can attach and a mismatched model never reads it, then the
reference counts (int32 per slot), then the slots. The pool never holds more than its byte budget:
the slot count is fixed when it is created.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
from pathlib import Path

import numpy as np

HEADER_BYTES = 4096
SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")


class PoolMismatch(RuntimeError):
    pass


class BlockPool:
    def __init__(self, name: str, slot_bytes: int, budget_bytes: int, fingerprint: str,
                 block_size: int) -> None:
        n_slots = (budget_bytes - HEADER_BYTES) // (slot_bytes + 4)
        if n_slots < 1:
            raise ValueError(f"a budget of {budget_bytes} bytes holds no {slot_bytes}-byte block")
        self.path = SHM_DIR / f"prefixgate-{name}"
        remove_orphans()
        header = {"name": name, "fingerprint": fingerprint, "slot_bytes": slot_bytes,
                  "n_slots": n_slots, "block_size": block_size}
        size = HEADER_BYTES + n_slots * 4 + n_slots * slot_bytes
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        encoded = json.dumps(header).encode()
        self._map[: len(encoded)] = encoded
        self._init_views(header)
        self._free = list(range(n_slots - 1, -1, -1))  # pop() hands out low slots first

    @classmethod
    def attach(cls, name: str, fingerprint: str) -> BlockPool:
        """Open an arena another process created, read-only for blocks it does not own."""
        path = SHM_DIR / f"prefixgate-{name}"
        with open(path, "r+b") as f:
            mapped = mmap.mmap(f.fileno(), 0)
        header = json.loads(bytes(mapped[:HEADER_BYTES]).rstrip(b"\0"))
        if header["fingerprint"] != fingerprint:
            mapped.close()
            raise PoolMismatch(f"pool {name} holds KV of another model or layout")
        pool = cls.__new__(cls)
        pool.path, pool._map, pool._free = path, mapped, []
        pool._init_views(header)
        return pool

    def _init_views(self, header: dict) -> None:
        self.name: str = header["name"]
        self.fingerprint: str = header["fingerprint"]
        self.slot_bytes: int = header["slot_bytes"]
        self.n_slots: int = header["n_slots"]
        self.block_size: int = header["block_size"]
        self.refcounts = np.frombuffer(self._map, np.int32, self.n_slots, HEADER_BYTES)
        self._slots = np.frombuffer(self._map, np.uint8, self.n_slots * self.slot_bytes,
                                    HEADER_BYTES + 4 * self.n_slots
                                    ).reshape(self.n_slots, self.slot_bytes)

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_used(self) -> int:
        return self.n_slots - len(self._free)

    @property
    def capacity_bytes(self) -> int:
        return self.n_slots * self.slot_bytes

    def allocate(self) -> int | None:
        """A free slot with one reference, or None when the pool is full."""
        if not self._free:
            return None
        slot = self._free.pop()
        self.refcounts[slot] = 1
        return slot

    def retain(self, slot: int) -> None:
        assert self.refcounts[slot] > 0, "retaining a free block"
        self.refcounts[slot] += 1

    def release(self, slot: int) -> None:
        assert self.refcounts[slot] > 0, "releasing a free block"
        self.refcounts[slot] -= 1
        if self.refcounts[slot] == 0:
            self._free.append(slot)

    def block(self, slot: int) -> np.ndarray:
        return self._slots[slot]

    def close(self, unlink: bool = True) -> None:
        if unlink:
            self.path.unlink(missing_ok=True)
        del self.refcounts, self._slots
        # Block views still held elsewhere keep the mapping alive until they are collected.
        with contextlib.suppress(BufferError):
            self._map.close()


def remove_orphans() -> None:
    """Unlink arenas named after a process id that no longer runs (a crashed gateway's)."""
    for path in SHM_DIR.glob("prefixgate-*"):
        pid = path.name.removeprefix("prefixgate-")
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)
