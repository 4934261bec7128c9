"""What identifies the model whose KV a block holds.

KV bytes are only meaningful to the weights that computed them, so a block is tagged with a
fingerprint of the GGUF: a hash of all of it, the header (version, metadata, the name, shape,
type and offset of every tensor, walked and checked) and the tensor data. Two checkpoints
converted the same way have equal headers; only their data tells them apart, and serving one's
KV for the other would answer silently wrong. xxh3 hashes at memory speed, and llama.cpp has
just read the same pages, so this costs a pass over the page cache at start (0.1 s for the
default model). The file name plays no part: copies of one model share their cache.
"""

from __future__ import annotations

import os
import struct
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


def gguf_fingerprint(path: str | Path) -> str:
    """Hex xxh3-128 of a whole GGUF, its header checked on the way, and of its size."""
    path = Path(path)
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
