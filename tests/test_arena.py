from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from cache import arena
from cache.arena import (
    ARENA_PREFIX,
    HEADER_BYTES,
    SHM_DIR,
    ArenaHeader,
    ArenaInUse,
    ArenaMismatch,
    BlockArena,
    default_arena_path,
    remove_stale_arenas,
)

ROOT = Path(__file__).resolve().parents[1]
HEADER = ArenaHeader(fingerprint="model-a", slot_bytes=64, n_slots=4, block_size=16)
# A gateway that dies without closing its arena: SIGKILL, so not even interpreter exit runs.
KILLED_OWNER = f"""
import os, signal, sys
from pathlib import Path
from cache.arena import ArenaHeader, BlockArena
arena = BlockArena.create(Path(sys.argv[1]), ArenaHeader(**{asdict(HEADER)!r}))
arena.block(0)[:] = 9
os.kill(os.getpid(), signal.SIGKILL)
"""
# A gateway that stays alive, holding its arena, until the test closes its stdin.
LIVE_OWNER = f"""
import sys
from pathlib import Path
from cache.arena import ArenaHeader, BlockArena
arena = BlockArena.create(Path(sys.argv[1]), ArenaHeader(**{asdict(HEADER)!r}))
print("ready", flush=True)
sys.stdin.read()
"""


def killed_owner(path: Path) -> None:
    """Leave a stale arena at path, as a killed gateway would."""
    done = subprocess.run([sys.executable, "-c", KILLED_OWNER, str(path)], cwd=ROOT, timeout=60)
    assert done.returncode == -signal.SIGKILL and path.exists()


def test_create_and_attach_share_the_bytes(tmp_path: Path):
    path = tmp_path / f"{ARENA_PREFIX}round-trip"
    owner = BlockArena.create(path, HEADER)
    try:
        assert path.stat().st_size == HEADER_BYTES + 4 * 64 and owner.capacity_bytes == 4 * 64
        owner.block(1)[:] = 7
        worker = BlockArena.attach(path, "model-a")
        assert worker.header == HEADER
        assert (worker.block(1) == 7).all() and not worker.block(0).any()
        worker.block(2)[:3] = [1, 2, 3]
        assert owner.block(2)[:4].tolist() == [1, 2, 3, 0]
        assert owner.block(3).dtype == np.uint8 and owner.block(3).shape == (64,)
        with pytest.raises(IndexError):
            owner.block(4)
        with pytest.raises(IndexError):
            owner.block(-1)
        worker.close()
    finally:
        owner.close()


def test_file_is_private_to_its_owner(tmp_path: Path):
    previous = os.umask(0)  # the most permissive umask: the mode must not rely on it
    try:
        owner = BlockArena.create(tmp_path / f"{ARENA_PREFIX}private", HEADER)
    finally:
        os.umask(previous)
    try:
        assert owner.path.stat().st_mode & 0o777 == 0o600
    finally:
        owner.close()


def test_create_over_a_live_arena_raises_and_leaves_it_intact(tmp_path: Path):
    path = tmp_path / f"{ARENA_PREFIX}live"
    owner = BlockArena.create(path, HEADER)
    try:
        owner.block(0)[:] = 5
        inode = path.stat().st_ino
        with pytest.raises(ArenaInUse, match=re.escape(str(path))):
            BlockArena.create(path, ArenaHeader("model-b", 128, 2, 16))
        assert path.stat().st_ino == inode and path.stat().st_size == HEADER.file_bytes
        worker = BlockArena.attach(path, "model-a")
        assert (worker.block(0) == 5).all()
        worker.close()
        assert remove_stale_arenas(tmp_path) == [] and path.exists()
    finally:
        owner.close()


def test_arena_of_a_killed_owner_is_removed_by_the_sweep(tmp_path: Path):
    stale = tmp_path / f"{ARENA_PREFIX}stale"
    killed_owner(stale)
    others = [tmp_path / "other-file", tmp_path / f"{ARENA_PREFIX}dir"]
    others[0].write_bytes(b"not ours")
    others[1].mkdir()
    live = BlockArena.create(tmp_path / f"{ARENA_PREFIX}live", HEADER)
    try:
        assert remove_stale_arenas(tmp_path) == [stale]
        assert not stale.exists() and live.path.exists() and all(p.exists() for p in others)
    finally:
        live.close()


def test_create_replaces_the_arena_of_a_killed_owner(tmp_path: Path):
    path = tmp_path / f"{ARENA_PREFIX}reused"
    killed_owner(path)
    owner = BlockArena.create(path, ArenaHeader("model-b", 32, 8, 16))
    try:
        assert path.stat().st_size == HEADER_BYTES + 8 * 32
        assert not owner.block(0).any()  # a fresh file, not the dead owner's bytes
        worker = BlockArena.attach(path, "model-b")
        assert worker.header.slot_bytes == 32
        worker.close()
    finally:
        owner.close()


def test_arena_of_a_live_child_process_is_kept_until_it_dies(tmp_path: Path):
    path = tmp_path / f"{ARENA_PREFIX}child"
    child = subprocess.Popen([sys.executable, "-c", LIVE_OWNER, str(path)], cwd=ROOT,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        assert remove_stale_arenas(tmp_path) == [] and path.exists()
        with pytest.raises(ArenaInUse):
            BlockArena.create(path, HEADER)
        child.stdin.close()  # it exits without closing the arena, so leaves it stale
        assert child.wait(timeout=60) == 0
        assert remove_stale_arenas(tmp_path) == [path] and not path.exists()
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("race", ["removed", "replaced", "locked"])
def test_create_survives_a_sweeper_between_open_and_lock(tmp_path: Path, monkeypatch, race):
    path = tmp_path / f"{ARENA_PREFIX}race"
    real_flock = fcntl.flock
    sweeper_fds = []

    def sweep_first(fd: int, operation: int) -> None:
        """Before the creator's first flock, another process acts on its fresh file."""
        if not sweeper_fds:
            sweeper_fds.append(os.open(path, os.O_RDONLY))
            if race == "locked":  # a sweeper that has locked it and not yet let go
                real_flock(sweeper_fds[0], fcntl.LOCK_EX | fcntl.LOCK_NB)
            path.unlink()
            if race == "replaced":  # and a killed gateway's file has taken its place
                path.write_bytes(b"stale")
        real_flock(fd, operation)

    monkeypatch.setattr(arena.fcntl, "flock", sweep_first)
    try:
        owner = BlockArena.create(path, HEADER)
    finally:
        os.close(sweeper_fds[0])
    try:
        # The owner locked the file that path names, not the one removed under it.
        owner.block(3)[:] = 4
        worker = BlockArena.attach(path, "model-a")
        assert (worker.block(3) == 4).all()
        worker.close()
        assert remove_stale_arenas(tmp_path) == [] and path.exists()
    finally:
        owner.close()


def test_attach_rejects_another_model_or_size(tmp_path: Path):
    path = tmp_path / f"{ARENA_PREFIX}mismatch"
    owner = BlockArena.create(path, HEADER)
    try:
        with pytest.raises(ArenaMismatch, match="model-b"):
            BlockArena.attach(path, "model-b")
        os.truncate(path, HEADER.file_bytes + 64)
        with pytest.raises(ArenaMismatch, match="bytes"):
            BlockArena.attach(path, "model-a")
    finally:
        owner.close()
    garbage = tmp_path / f"{ARENA_PREFIX}garbage"
    garbage.write_bytes(b"\xff" * HEADER_BYTES)
    with pytest.raises(ArenaMismatch, match="no valid arena header"):
        BlockArena.attach(garbage, "model-a")
    garbage.write_bytes(b"short")
    with pytest.raises(ArenaMismatch, match="too short"):
        BlockArena.attach(garbage, "model-a")
    with pytest.raises(FileNotFoundError):
        BlockArena.attach(tmp_path / f"{ARENA_PREFIX}missing", "model-a")
    with pytest.raises(ValueError, match="positive"):
        ArenaHeader("model-a", slot_bytes=0, n_slots=4, block_size=16)


def test_only_the_owner_close_removes_the_file(tmp_path: Path):
    owner = BlockArena.create(tmp_path / f"{ARENA_PREFIX}close", HEADER)
    worker = BlockArena.attach(owner.path, "model-a")
    kept = worker.block(0)  # a view still referenced when its arena closes
    worker.close()
    worker.close()
    assert owner.path.exists()
    with pytest.raises(ValueError, match="closed"):
        worker.block(0)
    held = owner.block(0)
    owner.close()
    owner.close()
    assert not owner.path.exists()
    held[:] = 1  # the mapping outlives close() while views of it are alive
    assert (kept == 1).all()


def test_default_path_in_shared_memory(tmp_path: Path):
    path = default_arena_path()
    assert path.parent == SHM_DIR and path.name.startswith(ARENA_PREFIX)
    assert default_arena_path() != path
    owner = BlockArena.create(path, HEADER)
    try:
        worker = BlockArena.attach(path, "model-a")
        owner.block(2)[:] = 3
        assert (worker.block(2) == 3).all()
        worker.close()
        assert path.exists()
    finally:
        owner.close()
    assert not path.exists()
