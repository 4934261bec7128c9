"""What identifies the model whose KV a block holds.

KV bytes are only meaningful to the weights that computed them, so a block is tagged with a
fingerprint of the GGUF: a hash of all of it, the header (version, metadata, the name, shape,
type and offset of every tensor, walked and checked) and the tensor data. Two checkpoints
converted the same way have equal headers; only their data tells them apart, and serving one's
KV for the other would answer silently wrong. xxh3 hashes at memory speed, and llama.cpp has
just read the same pages, so this costs a pass over the page cache at start (0.1 s for the
default model). The file name plays no part: copies of one model share their cache.

Walking the header in Python is what costs (a vocabulary is tens of thousands of strings: most
of a second for SmolLM2 on a busy machine), and a model loaded again (models swapped, a worker
replaced) would pay it at each load: a file's fingerprint is kept for as long as its identity
and times (device, inode, size, mtime, ctime) stay, as git trusts its index, and only for a
file last changed well before it was hashed (a change within the clock's granularity of the
hash could leave those times equal).
"""

from __future__ import annotations

import os
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import xxhash

# https://github.com/ggml-org/ggml/blob/master/docs/gguf.md: metadata value types of fixed size
_FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING = 8
_ARRAY = 9
_VERSIONS = (2, 3)  # version 1 had 32-bit counts and lengths
_CHUNK = 1 << 20
_SETTLED_NS = 2_000_000_000  # a file changed less than this before its hash is hashed again

_known: dict[str, tuple[tuple[int, ...], str]] = {}  # resolved path: (its stat, fingerprint)
_known_lock = threading.Lock()


def gguf_fingerprint(path: str | Path) -> str:
    """Hex xxh3-128 of a whole GGUF, its header checked on the way, and of its size; kept
    for a file that has not changed since (the module's docstring)."""
    key = os.path.realpath(path)
    st = os.stat(key)
    identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    with _known_lock:
        known = _known.get(key)
    if known is not None and known[0] == identity:
        return known[1]
    fingerprint = _hash(Path(path))
    if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > _SETTLED_NS:
        with _known_lock:
            _known[key] = identity, fingerprint
    return fingerprint


def _hash(path: Path) -> str:
    with open(path, "rb") as f:
        reader = _HashingReader(f, path, os.fstat(f.fileno()).st_size)
        if reader.size < 4 or reader.take(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        (version,) = reader.unpack("<I")
        if version not in _VERSIONS:
            raise ValueError(f"{path}: GGUF version {version} is not supported ({_VERSIONS})")
        n_tensors, n_kv = reader.unpack("<QQ")
        for _ in range(n_kv):
            reader.skip_string()  # the key
            reader.skip_value(reader.unpack("<I")[0])
        for _ in range(n_tensors):
            reader.skip_string()  # the name
            (n_dims,) = reader.unpack("<I")
            reader.skip(8 * n_dims + 4 + 8)  # dims, type, offset
        reader.skip(reader.size - reader.pos)  # the tensor data
    reader.hasher.update(struct.pack("<Q", reader.size))
    return reader.hasher.hexdigest()


@dataclass
class _HashingReader:
    """Walks a GGUF header in order, hashing every byte it passes."""

    file: BinaryIO
    path: Path
    size: int
    pos: int = 0
    hasher: xxhash.xxh3_128 = field(default_factory=xxhash.xxh3_128)

    def take(self, n: int) -> bytes:
        # Checked against the size first: a corrupt length must not become a huge allocation.
        if n > self.size - self.pos:
            raise self._truncated(n)
        data = self.file.read(n)
        if len(data) != n:  # the file shrank under us
            raise self._truncated(n)
        self.hasher.update(data)
        self.pos += n
        return data

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def skip(self, n: int) -> None:
        """Hash n bytes without keeping them; in one read unless they are large."""
        if n > self.size - self.pos:
            raise self._truncated(n)
        while n > 0:
            n -= len(self.take(min(n, _CHUNK)))

    def skip_string(self) -> None:
        self.skip(self.unpack("<Q")[0])

    def skip_value(self, value_type: int) -> None:
        if value_type in _FIXED_SIZES:
            self.skip(_FIXED_SIZES[value_type])
        elif value_type == _STRING:
            self.skip_string()
        elif value_type == _ARRAY:
            element_type, count = self.unpack("<IQ")
            if element_type in _FIXED_SIZES:
                self.skip(count * _FIXED_SIZES[element_type])
            elif element_type in (_STRING, _ARRAY):
                for _ in range(count):  # variable sizes: each must be walked
                    self.skip_value(element_type)
            else:
                raise self._bad_type(element_type)
        else:
            raise self._bad_type(value_type)

    def _truncated(self, n: int) -> ValueError:
        return ValueError(f"{self.path}: truncated GGUF header (needs {n} bytes at offset "
                          f"{self.pos}, the file has {self.size})")

    def _bad_type(self, value_type: int) -> ValueError:
        return ValueError(f"{self.path}: unknown GGUF value type {value_type} before offset "
                          f"{self.pos}")
