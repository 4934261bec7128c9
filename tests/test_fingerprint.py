from __future__ import annotations

import contextlib
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import xxhash

from cache.fingerprint import gguf_fingerprint
from gateway.workers.model_store import default_model_path


@pytest.fixture(scope="module")
def model() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def copy(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One copy under another name, shared so that the tests write ~100 MB once, not per test."""
    target = tmp_path_factory.mktemp("copy") / "renamed.gguf"
    shutil.copyfile(model, target)
    return target


@contextlib.contextmanager
def flipped(path: Path, offset: int) -> Iterator[None]:
    """path with the byte at offset inverted, restored afterwards for the other tests."""
    with open(path, "r+b") as f:
        f.seek(offset)
        original = f.read(1)
        f.seek(offset)
        f.write(bytes([original[0] ^ 0xFF]))
    try:
        yield
    finally:
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(original)


def test_stable_and_independent_of_the_file_name(model: Path, copy: Path):
    first = gguf_fingerprint(model)
    assert len(first) == 32 and int(first, 16) >= 0
    assert gguf_fingerprint(str(model)) == first
    assert copy.name != model.name and gguf_fingerprint(copy) == first


def test_a_metadata_byte_changes_it(model: Path, copy: Path):
    head = copy.read_bytes()[:1 << 16]
    key = head.index(b"general.name")
    # key, then the u32 value type and the u64 string length, then the value itself
    value = key + len(b"general.name") + 4 + 8
    assert struct.unpack_from("<I", head, value - 12)[0] == 8
    with flipped(copy, value + 1):
        assert gguf_fingerprint(copy) != gguf_fingerprint(model)
    assert gguf_fingerprint(copy) == gguf_fingerprint(model)


def test_a_tensor_data_byte_changes_it_and_so_does_the_size(model: Path, copy: Path):
    """Two checkpoints converted alike differ only in their data (before, it was not hashed)."""
    size = copy.stat().st_size
    with flipped(copy, size - 100):
        assert gguf_fingerprint(copy) != gguf_fingerprint(model)
    assert gguf_fingerprint(copy) == gguf_fingerprint(model)
    with open(copy, "ab") as f:
        f.write(b"\0")
    try:
        assert gguf_fingerprint(copy) != gguf_fingerprint(model)
    finally:
        with open(copy, "r+b") as f:
            f.truncate(size)


def test_not_gguf_or_truncated_raises(model: Path, tmp_path: Path):
    text = tmp_path / "model.gguf"
    text.write_bytes(b"this is not a model\n" * 100)
    with pytest.raises(ValueError, match="not a GGUF"):
        gguf_fingerprint(text)
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(ValueError, match="not a GGUF"):
        gguf_fingerprint(tmp_path / "empty")
    truncated = tmp_path / "truncated.gguf"
    with open(model, "rb") as f:
        truncated.write_bytes(f.read(10_000))
    with pytest.raises(ValueError, match="truncated"):
        gguf_fingerprint(truncated)


def gguf_string(s: str) -> bytes:
    encoded = s.encode()
    return struct.pack("<Q", len(encoded)) + encoded


def synthetic_header(version: int = 3) -> bytes:
    """A GGUF header with one metadata value of each type and two tensor infos."""
    scalars = [(0, "<B", 7), (1, "<b", -7), (2, "<H", 700), (3, "<h", -700), (4, "<I", 70_000),
               (5, "<i", -70_000), (6, "<f", 0.5), (7, "<?", True), (10, "<Q", 1 << 40),
               (11, "<q", -(1 << 40)), (12, "<d", 0.25)]
    kvs = [gguf_string(f"test.type{t}") + struct.pack("<I", t) + struct.pack(fmt, v)
           for t, fmt, v in scalars]
    kvs.append(gguf_string("general.name") + struct.pack("<I", 8) + gguf_string("tiny"))
    words = ["a", "", "ünïcode", "x" * 300]
    kvs.append(gguf_string("tokenizer.tokens") + struct.pack("<IIQ", 9, 8, len(words))
               + b"".join(gguf_string(w) for w in words))
    kvs.append(gguf_string("test.u32s") + struct.pack("<IIQ", 9, 4, 3)
               + struct.pack("<3I", 1, 2, 3))
    inner = [struct.pack("<IQ", 8, 1) + gguf_string("nested"), struct.pack("<IQ", 5, 2)
             + struct.pack("<2i", -1, 1)]
    kvs.append(gguf_string("test.arrays") + struct.pack("<IIQ", 9, 9, len(inner)) + b"".join(inner))
    tensors = [gguf_string("token_embd.weight") + struct.pack("<I2QIQ", 2, 8, 4, 0, 0),
               gguf_string("output_norm.weight") + struct.pack("<I1QIQ", 1, 8, 0, 128)]
    return (b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs)) + b"".join(kvs)
            + b"".join(tensors))


def test_synthetic_gguf_with_every_value_type(tmp_path: Path):
    header = synthetic_header()
    path = tmp_path / "tiny.gguf"
    data = b"\0" * (-len(header) % 32) + bytes(range(256)) * 2
    path.write_bytes(header + data)
    # The whole file, then its size, once the parser walked every value type of the header.
    expected = xxhash.xxh3_128(header + data + struct.pack("<Q", len(header) + len(data))
                               ).hexdigest()
    assert gguf_fingerprint(path) == expected
    path.write_bytes(synthetic_header(version=2) + data)
    assert gguf_fingerprint(path) != expected


def test_synthetic_gguf_cut_anywhere_in_the_header_raises(tmp_path: Path):
    header = synthetic_header()
    path = tmp_path / "cut.gguf"
    for end in range(len(header)):
        path.write_bytes(header[:end])
        with pytest.raises(ValueError):
            gguf_fingerprint(path)


def test_unsupported_version_or_value_type_raises(tmp_path: Path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(synthetic_header(version=1))
    with pytest.raises(ValueError, match="version 1"):
        gguf_fingerprint(path)
    bad_type = gguf_string("test.bad") + struct.pack("<IB", 13, 0)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + bad_type)
    with pytest.raises(ValueError, match="value type 13"):
        gguf_fingerprint(path)
    bad_array = gguf_string("test.bad") + struct.pack("<IIQ", 9, 13, 0)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + bad_array)
    with pytest.raises(ValueError, match="value type 13"):
        gguf_fingerprint(path)


def test_kept_while_the_file_is_unchanged_and_hashed_again_once_it_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A model loaded again (models swapped) does not walk its header again: the
    fingerprint is kept for a file settled when hashed, and a changed file is hashed anew."""
    from cache import fingerprint

    walks: list[Path] = []
    hash_ = fingerprint._hash
    monkeypatch.setattr(fingerprint, "_hash", lambda path: walks.append(path) or hash_(path))
    path = tmp_path / "tiny.gguf"
    data = b"\0" * (-len(synthetic_header()) % 32) + bytes(range(256))
    path.write_bytes(synthetic_header() + data)
    changed = max(path.stat().st_mtime_ns, path.stat().st_ctime_ns)
    now = changed + 1  # hashed as soon as written: its times could hide a change to come
    monkeypatch.setattr(fingerprint, "time", SimpleNamespace(time_ns=lambda: now))
    first = gguf_fingerprint(path)
    assert gguf_fingerprint(path) == first and len(walks) == 2
    now = changed + 10 * fingerprint._SETTLED_NS  # hashed long after it was written
    assert gguf_fingerprint(path) == first and len(walks) == 3
    assert gguf_fingerprint(tmp_path / "." / "tiny.gguf") == first and len(walks) == 3
    path.write_bytes(synthetic_header(version=2) + data + bytes(32))
    assert gguf_fingerprint(path) != first and len(walks) == 4
