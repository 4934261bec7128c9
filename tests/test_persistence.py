"""A restarted gateway answers its hot prefixes warm (--cache-dir); a snapshot that does not
verify is refused whole."""

from __future__ import annotations

import errno
import shutil
import stat
import threading

import numpy as np
import pytest

from cache import persistence
from cache.arena import SHM_DIR, ArenaHeader, BlockArena, default_arena_path
from cache.index import CacheIndex
from loadtest.gateway_process import GatewayProcess
from tests.conftest import openai_client
from tests.test_fingerprint import flipped
from tests.test_prefix_cache import ask, system_chat

SYSTEM = "You are the archivist of the lighthouse on Bengtskär. Answer in one sentence. " * 8
QUESTION = "When was the lighthouse built?"


def test_a_restart_keeps_the_hot_prefixes(model_path, model_name, tmp_path):
    tmp_path = tmp_path / "cache"  # made by the gateway
    # Without flash attention the warm answer equals the cold one token for token (see
    # tests/test_prefix_cache.py): restored blocks are compared by what they produce.
    args = ("--parallel", "2", "--ctx-size", "2048", "--no-flash-attn", "--cache-dir",
            str(tmp_path))
    first = GatewayProcess(model_path, *args)
    try:
        text, usage = ask(openai_client(first), model_name, system_chat(QUESTION, SYSTEM))
        assert usage.prompt_tokens_details.cached_tokens < 8
    finally:
        first.stop()  # SIGTERM: the blocks are written at shutdown
    snapshot = tmp_path / "prefix-cache.bin"
    assert snapshot.stat().st_size > 0
    # Every tenant's prompt tokens are in it: owner-only, and no temporary file left behind.
    assert stat.S_IMODE(snapshot.stat().st_mode) == 0o600
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o700
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prefix-cache.bin", "responses.json"]
    second = GatewayProcess(model_path, *args)
    try:
        warm, usage = ask(openai_client(second), model_name, system_chat(QUESTION, SYSTEM))
        assert usage.prompt_tokens_details.cached_tokens > 100
        assert warm == text
        second.settled()
    finally:
        second.stop()
    # Cut short (a full disk, a copy interrupted): refused with a log line, nothing half-loaded.
    data = snapshot.read_bytes()
    snapshot.write_bytes(data[: len(data) // 2])
    third = GatewayProcess(model_path, *args)
    try:
        _, usage = ask(openai_client(third), model_name, system_chat(QUESTION, SYSTEM))
        assert usage.prompt_tokens_details.cached_tokens < 8
        assert "not loading the prefix-cache snapshot" in third.log_path.read_text()
        third.settled()
    finally:
        third.stop()


def test_a_snapshot_of_another_model_layout_is_refused(model_path, model_name, tmp_path):
    first = GatewayProcess(model_path, "--parallel", "2", "--ctx-size", "2048", "--cache-dir",
                           str(tmp_path))
    try:
        ask(openai_client(first), model_name, system_chat(QUESTION, SYSTEM))
    finally:
        first.stop()
    arenas = set(SHM_DIR.glob("prefixgate-*"))
    other = GatewayProcess(model_path, "--parallel", "2", "--ctx-size", "2048", "--kv-type",
                           "q8_0", "--cache-dir", str(tmp_path))
    try:
        _, usage = ask(openai_client(other), model_name, system_chat(QUESTION, SYSTEM))
        assert usage.prompt_tokens_details.cached_tokens < 8
        assert "written for another fingerprint" in other.log_path.read_text()
        # The pool read from the snapshot while the worker loaded was given up for a new one.
        assert len(set(SHM_DIR.glob("prefixgate-*")) - arenas) == 1
    finally:
        other.stop()
    assert not set(SHM_DIR.glob("prefixgate-*")) - arenas


def test_a_snapshot_read_for_workers_that_never_start_leaves_no_arena(model_path, model_name,
                                                                      tmp_path):
    """The snapshot's pool is made while the workers load the model: if none becomes ready,
    it goes with them, and the snapshot stays as it was."""
    args = ("--parallel", "2", "--ctx-size", "2048", "--cache-dir", str(tmp_path))
    first = GatewayProcess(model_path, *args)
    try:
        ask(openai_client(first), model_name, system_chat(QUESTION, SYSTEM))
    finally:
        first.stop()
    snapshot = (tmp_path / "prefix-cache.bin").read_bytes()
    arenas = set(SHM_DIR.glob("prefixgate-*"))
    with pytest.raises(RuntimeError, match="exited"):  # no such device: the worker exits
        GatewayProcess(model_path, *args, "--device", "Vulkan7")
    assert not set(SHM_DIR.glob("prefixgate-*")) - arenas
    assert (tmp_path / "prefix-cache.bin").read_bytes() == snapshot


def test_a_snapshot_of_other_weights_with_the_same_header_is_refused(model_path, model_name,
                                                                     tmp_path):
    """One byte of tensor data flipped: the same header, other weights. (Before, only the header
    was hashed, and the copy adopted the original's KV.)"""
    other = tmp_path / "other" / model_path.name
    other.parent.mkdir()
    shutil.copyfile(model_path, other)
    args = ("--parallel", "2", "--ctx-size", "2048", "--cache-dir", str(tmp_path / "cache"))
    first = GatewayProcess(model_path, *args)
    try:
        ask(openai_client(first), model_name, system_chat(QUESTION, SYSTEM))
    finally:
        first.stop()
    with flipped(other, other.stat().st_size - 100):
        second = GatewayProcess(other, *args)
        try:
            _, usage = ask(openai_client(second), model_name, system_chat(QUESTION, SYSTEM))
            assert usage.prompt_tokens_details.cached_tokens < 8
            assert "written for another fingerprint" in second.log_path.read_text()
        finally:
            second.stop()


def test_the_snapshot_holds_the_bytes_of_the_blocks_it_lists(tmp_path):
    """An adoption from Redis arriving while the snapshot is written (it evicts the least
    recently used block and rewrites its slot) waits until the copy is done. (Before, blocks
    were listed under the index's lock but copied outside it: a prefix got another's bytes.)"""
    header = ArenaHeader("fp", slot_bytes=16, n_slots=2, block_size=4)
    arena, fresh = BlockArena.create(default_arena_path(), header), None
    try:
        index = CacheIndex(2, 4)

        def filled(value: int):
            return lambda _start, _end: bytes([value]) * 16

        index.adopt(np.arange(4, dtype=np.int32), "", filled(1), arena)
        index.adopt(np.arange(100, 104, dtype=np.int32), "", filled(2), arena)  # pool full
        copy, racing = arena.block, []

        def block(slot: int):  # the first copy lets an adoption race it
            if not racing:
                racing.append(threading.Thread(target=index.adopt, args=(
                    np.arange(200, 204, dtype=np.int32), "", filled(3), arena)))
                racing[0].start()
                racing[0].join(timeout=0.5)
            return copy(slot)

        arena.block = block
        assert persistence.save(tmp_path, index, arena) == 2
        racing[0].join()
        arena.block = copy
        fresh, loaded = BlockArena.create(default_arena_path(), header), CacheIndex(2, 4)
        assert persistence.load(tmp_path, loaded, fresh) == 2
        for first, value in ((0, 1), (100, 2)):
            lease = loaded.match(0, np.arange(first, first + 4, dtype=np.int32), "")
            (slot, used), = lease.blocks
            assert used == 4 and set(fresh.block(slot).tolist()) == {value}
    finally:
        arena.close()
        if fresh is not None:
            fresh.close()


def test_a_snapshot_is_read_into_the_arena_without_copies_between(tmp_path):
    """Each block's bytes are a view into the one buffer the file was read into: copying the
    body, then each block, took as long as the read itself while a reloaded model waited."""
    header = ArenaHeader("fp", slot_bytes=16, n_slots=2, block_size=4)
    arena, fresh = BlockArena.create(default_arena_path(), header), None
    try:
        index = CacheIndex(2, 4)
        for value in (1, 2):
            index.adopt(np.arange(4, dtype=np.int32) + 100 * value, "",
                        lambda _start, _end, value=value: bytes([value]) * 16, arena)
        persistence.save(tmp_path, index, arena)
        fresh, loaded, given = BlockArena.create(default_arena_path(), header), \
            CacheIndex(2, 4), []
        adopt = loaded.adopt

        def adopting(tokens, namespace, block_bytes, arena_):
            def kept(start: int, end: int):
                given.append(block_bytes(start, end))
                return given[-1]
            return adopt(tokens, namespace, kept, arena_)

        loaded.adopt = adopting  # type: ignore[method-assign]
        assert persistence.load(tmp_path, loaded, fresh) == 2
        assert len(given) == 2 and all(isinstance(b, memoryview) for b in given)
        assert given[0].obj is given[1].obj  # the file's bytes, read once
        assert sorted(set(b.tobytes()) for b in given) == [{1}, {2}]
    finally:
        arena.close()
        if fresh is not None:
            fresh.close()


@pytest.mark.parametrize("fails_in", ["the caller's write", "fsync"])
def test_a_failed_write_leaves_the_previous_file_whole_and_nothing_beside_it(
        tmp_path, monkeypatch, fails_in):
    with persistence.private_file(tmp_path, "snapshot") as f:
        f.write(b"the previous snapshot")
    full = OSError(errno.ENOSPC, "No space left on device")

    def no_room(_fd: int) -> None:
        raise full

    if fails_in == "fsync":
        monkeypatch.setattr(persistence.os, "fsync", no_room)
    with pytest.raises(OSError, match="No space"), \
            persistence.private_file(tmp_path, "snapshot") as f:
        f.write(b"half of the next")
        if fails_in == "the caller's write":
            raise full
    assert [p.name for p in tmp_path.iterdir()] == ["snapshot"]
    assert (tmp_path / "snapshot").read_bytes() == b"the previous snapshot"


def test_an_existing_cache_dir_open_to_others_is_made_owner_only(tmp_path):
    directory = tmp_path / "cache"
    directory.mkdir()
    directory.chmod(0o755)  # as `mkdir` under the usual umask leaves it
    with persistence.private_file(directory, "snapshot") as f:
        f.write(b"tokens")
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE((directory / "snapshot").stat().st_mode) == 0o600
