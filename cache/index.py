"""The prefix cache's index, in the gateway: radix tree, block allocation, reference counts, LRU.

This is the single writer of block metadata. Workers move block bytes in the shared arena at the
slots it hands out, through leases (blocks to load, referenced until released) and store plans
(fresh slots to fill, adopted into the tree on commit). Every lease and plan is owned by a
worker, so that a worker that dies loses nothing: `release_owner` returns all it held.

A plan's slots join the tree only once written, so no other worker can ever match a block whose
bytes are not there yet; the prefix before the plan stays referenced until the commit, so that
eviction cannot cut the path the new blocks hang from. Two workers storing the same blocks at
once both write them; the second commit finds them in the tree and frees its copies.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import xxhash

from cache.arena import BlockArena
from cache.block_pool import BlockPool
from cache.radix_tree import BlockListener, Match, Node, PathReport, RadixTree

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lease:
    """Matched blocks, referenced for the worker until it sends ReleaseLease(lease_id)."""

    lease_id: int
    n_tokens: int
    blocks: tuple[tuple[int, int], ...]  # (slot, tokens used); only the last may be partial


@dataclass(frozen=True)
class StorePlan:
    """Slots for the blocks of tokens[begin:end) the tree lacks, in block order. The worker
    writes them and answers CommitStore(plan_id); until then they belong to the plan."""

    plan_id: int
    begin: int
    end: int
    slots: tuple[int, ...]


@dataclass(frozen=True)
class IndexSnapshot:
    blocks_used: int
    blocks_free: int
    blocks_held: int  # referenced by a lease or plan, not only the tree
    evictions: int
    uncached_requests: int  # requests whose blocks did not fit: everything was in use
    blocks_pinned: int = 0
    pin_budget: int = 0  # blocks
    pin_fallbacks: int = 0  # pinned blocks that fell back to LRU to keep within the budget
    pinned_hit_tokens: int = 0  # prompt tokens matched in pinned blocks


@dataclass
class _Plan:
    owner: int
    tokens: np.ndarray
    namespace: bytes
    prefix: Match  # the cached blocks before `begin`, kept until the commit
    begin: int
    end: int
    slots: list[int]
    final: bool
    hold: bool


# Told of every block a worker stores, after the index's lock is released: (block key, tokens,
# slot, done). The slot stays referenced, so never evicted nor written, until `done()` is called
# (once, from any thread): until then the hook may read the block's bytes on a thread of its own.
StoredHook = Callable[[bytes, np.ndarray, int, Callable[[], None]], None]

# Told of every block LRU eviction takes, under the index's lock, before its slot is freed:
# (block key, tokens, slot). The slot's bytes are the block's until the hook returns and may
# be rewritten right after, so the hook copies what it keeps, and quickly: every caller of the
# index waits meanwhile. Blocks dropped otherwise (by the admin API, or for a longer copy of
# themselves) are not told of.
EvictedHook = Callable[[bytes, np.ndarray, int], None]


class CacheIndex:
    def __init__(self, n_slots: int, block_size: int,
                 on_stored: StoredHook | None = None, pin_budget: int | None = None,
                 namespace_share: float = 1.0, clock: Callable[[], float] = time.time,
                 on_evicted: EvictedHook | None = None) -> None:
        self.pool = BlockPool(n_slots, block_size)
        self.tree = RadixTree(self.pool, pin_budget, clock, namespace_share)
        self.block_size = block_size
        self._lock = threading.Lock()  # calls come from every worker's reader thread
        self._ids = itertools.count(1)
        self._leases: dict[int, tuple[int, Match]] = {}
        self._plans: dict[int, _Plan] = {}
        self._uncached_requests = 0
        self._pinned_hit_tokens = 0
        self._on_stored = on_stored
        self._told: dict[int, Node] = {}  # blocks held for on_stored until it is done
        if on_evicted is not None:
            self.tree.on_evicted = functools.partial(_tell_evicted, on_evicted)

    def client(self, owner: int) -> IndexClient:
        return IndexClient(self, owner)

    def cached_length(self, tokens: np.ndarray, namespace: str) -> int:
        with self._lock:
            return self.tree.matched_length(tokens, namespace.encode())

    def report(self, tokens: np.ndarray, namespace: str, following: int = 32) -> PathReport:
        """How the prompt meets the cached paths, touching nothing (explaining a miss, or
        finding an earlier answer to draft from)."""
        with self._lock:
            return self.tree.report(tokens, namespace.encode(), following)

    def namespace_named(self, hashed: str) -> str | None:
        """The namespace of the tree that the admin API calls `hashed`, if it holds any block."""
        with self._lock:
            return next((n.namespace.decode() for n in self.tree.nodes()
                         if namespace_hash(n.namespace) == hashed), None)

    def match(self, owner: int, tokens: np.ndarray, namespace: str) -> Lease:
        with self._lock:
            match = self.tree.match(tokens, namespace.encode())
            now = self.tree.clock()
            self._pinned_hit_tokens += sum(
                n for node, (_, n) in zip(match.nodes, match.blocks(), strict=True)
                if node.pinned_until > now)
            lease_id = next(self._ids)
            self._leases[lease_id] = (owner, match)
            return Lease(lease_id, match.n_tokens, tuple(match.blocks()))

    def release(self, lease_id: int) -> None:
        with self._lock:
            owner_match = self._leases.pop(lease_id, None)
            if owner_match is not None:
                self.tree.release(owner_match[1])

    def plan_store(self, owner: int, tokens: np.ndarray, namespace: str, final: bool,
                   hold: bool) -> StorePlan:
        """Slots for the blocks of `tokens` from the first one the tree lacks, as many as the
        pool can free by evicting unreferenced leaves."""
        bs, space = self.block_size, namespace.encode()
        with self._lock:
            cached = self.tree.matched_length(tokens, space)
            begin = len(tokens) if cached == len(tokens) else cached // bs * bs
            prefix = self.tree.match(tokens[:begin], space)
            slots = []
            for _ in range(math.ceil((len(tokens) - begin) / bs)):
                slot = self.tree.allocate(space)
                if slot is None:
                    break
                slots.append(slot)
            end = min(len(tokens), begin + len(slots) * bs)
            plan_id = next(self._ids)
            self._plans[plan_id] = _Plan(owner, tokens, space, prefix, begin, end, slots, final,
                                         hold)
            return StorePlan(plan_id, begin, end, tuple(slots))

    def commit_store(self, plan_id: int, written: bool) -> None:
        """Adopts a plan's written slots into the tree. With `hold` the stored path stays
        referenced as a lease with the plan's id. The on_stored hook hears of the new blocks
        after the lock is released, each held until the hook is done with it: what it does
        with their bytes (Redis: a copy, a hash) never holds up another caller of the index."""
        told: list[tuple[Node, int]] = []
        with self._lock:
            self._commit_store(plan_id, written, told)
        for node, hold in told:
            done = functools.partial(self._done_telling, hold)
            try:
                self._on_stored(node.key, node.tokens, node.slot, done)
            except Exception:
                log.exception("telling of a stored block failed")
                done()

    def _done_telling(self, hold: int) -> None:
        with self._lock:
            node = self._told.pop(hold, None)
            if node is not None:
                self.tree.release(Match([node], len(node.tokens)))

    def _commit_store(self, plan_id: int, written: bool, told: list[tuple[Node, int]]) -> None:
        """commit_store's work, under the lock: the blocks to tell of go to `told`, held."""
        plan = self._plans.pop(plan_id, None)
        if plan is None:  # its owner died meanwhile: everything was returned already
            return
        complete = False
        if written:
            unused = dict(enumerate(plan.slots))
            adopted: list[int] = []  # block indices of the path

            def fill(start: int, _end: int) -> int | None:
                if start < plan.begin:  # a block before the plan went missing meanwhile
                    return None
                slot = unused.pop((start - plan.begin) // self.block_size, None)
                if slot is not None:
                    adopted.append(start // self.block_size)
                return slot

            path, complete = self.tree.insert(plan.tokens[: plan.end], fill, plan.namespace)
            if self._on_stored is not None:
                for i in adopted:
                    node = path.nodes[i]
                    self.pool.retain(node.slot)
                    hold = next(self._ids)
                    self._told[hold] = node
                    told.append((node, hold))
            complete = complete and plan.end == len(plan.tokens)
            plan.slots = list(unused.values())
            if plan.hold:
                self._leases[plan_id] = (plan.owner, path)
            else:
                self.tree.release(path)
        if plan.final and not complete:
            self._uncached_requests += 1
        self._drop(plan)

    def adopt(self, tokens: np.ndarray, namespace: str,
              block_bytes: Callable[[int, int], np.ndarray | bytes | None],
              arena: BlockArena) -> int:
        """Stores blocks that come from outside the workers (a snapshot on disk, the Redis
        tier): `block_bytes(start, end)` gives the bytes of the block of tokens[start:end), or
        None to stop there. Returns how many tokens of `tokens` the tree holds afterwards."""
        space = namespace.encode()

        def fill(start: int, end: int) -> int | None:
            data = block_bytes(start, end)
            if data is None:
                return None
            slot = self.tree.allocate(space)
            if slot is not None:
                arena.block(slot)[:] = np.frombuffer(data, np.uint8)
            return slot

        with self._lock:
            path, _ = self.tree.insert(tokens, fill, space)
            n = path.n_tokens
            self.tree.release(path)
            return n

    def pin(self, tokens: np.ndarray, namespace: str, until: float) -> None:
        with self._lock:
            dropped = self.tree.pin(tokens, namespace.encode(), until)
        if dropped:
            log.warning("pin budget (%d blocks) full: %d pinned blocks fall back to LRU",
                        self.tree.pin_budget, dropped)

    def prefixes(self, limit: int) -> list[dict]:
        """The hottest cached paths, most recently used first (for the admin API)."""
        with self._lock:
            rows = []
            for leaf in self.tree.leaves()[:limit]:
                path, node = [], leaf
                while node.parent is not None:
                    path.append(node)
                    node = node.parent
                rows.append({"namespace": namespace_hash(leaf.namespace),
                             "tokens": leaf.path_tokens(), "blocks": len(path),
                             "hits": leaf.hits, "last_used": leaf.last_used,
                             "pinned_until": min(n.pinned_until for n in path) or None})
            return rows

    def drop(self, namespace_hashed: str | None) -> int:
        with self._lock:
            if namespace_hashed is None:
                return self.tree.drop_unheld()
            spaces = {n.namespace for n in self.tree.nodes()
                      if namespace_hash(n.namespace) == namespace_hashed}
            return sum(self.tree.drop_unheld(space) for space in spaces)

    def watch(self, listener: BlockListener) -> None:
        """Tells `listener` of every block the tree holds, each after its parent, then of every
        change: it starts from the tree as it is, with nothing in between missed."""
        with self._lock:
            for node in reversed(self.tree.by_recency()):
                listener.added(node)
            self.tree.listener = listener

    def chain_keys(self, tokens: np.ndarray, namespace: str) -> list[bytes]:
        with self._lock:
            return self.tree.chain_keys(tokens, namespace.encode())

    @contextlib.contextmanager
    def frozen(self) -> Iterator[list[tuple[bytes, np.ndarray, int]]]:
        """(namespace, tokens from the root to the block's end, slot) of every cached block,
        least recently used first (so that adopting them in this order restores the LRU), with
        the index locked until the caller is done with them: no store, adoption or eviction
        can rewrite one of those slots while it copies their bytes."""
        with self._lock:
            yield [(node.namespace, node.path_tokens(), node.slot)
                   for node in self.tree.by_recency()]

    def release_owner(self, owner: int) -> None:
        """Everything a worker held: it died, or stopped."""
        with self._lock:
            for lease_id in [i for i, (o, _) in self._leases.items() if o == owner]:
                self.tree.release(self._leases.pop(lease_id)[1])
            for plan_id in [i for i, p in self._plans.items() if p.owner == owner]:
                self._drop(self._plans.pop(plan_id))

    def _drop(self, plan: _Plan) -> None:
        for slot in plan.slots:
            self.pool.release(slot)
        self.tree.release(plan.prefix)

    def problems(self, live_owners: set[int]) -> list[str]:
        """Where the tree, the pool's counts, the leases and the plans disagree, and what is
        still held for a worker that no longer runs."""
        with self._lock:
            held: dict[int, int] = {}
            for _, match in self._leases.values():
                for node in match.nodes:
                    held[node.slot] = held.get(node.slot, 0) + 1
            for plan in self._plans.values():
                for node in plan.prefix.nodes:
                    held[node.slot] = held.get(node.slot, 0) + 1
                for slot in plan.slots:
                    held[slot] = held.get(slot, 0) + 1
            for node in self._told.values():
                held[node.slot] = held.get(node.slot, 0) + 1
            found = self.tree.problems(held)
            owners = {o for o, _ in self._leases.values()} | {p.owner for p in
                                                              self._plans.values()}
            found += [f"worker {o} holds leases or plans but does not run"
                      for o in sorted(owners - live_owners)]
            return found

    @property
    def n_leases(self) -> int:
        with self._lock:
            return len(self._leases) + len(self._plans)

    def snapshot(self) -> IndexSnapshot:
        with self._lock:
            return IndexSnapshot(self.pool.n_used, self.pool.n_free, self.pool.n_held,
                                 self.tree.evictions, self._uncached_requests,
                                 self.tree.n_pinned, self.tree.pin_budget,
                                 self.tree.pin_fallbacks, self._pinned_hit_tokens)


@dataclass(frozen=True)
class IndexClient:
    """The index as one worker sees it: the calls a worker's PrefixCache makes, bound to its
    owner id. A worker process reaches the same calls through `engine.process.RemoteIndex`."""

    index: CacheIndex
    owner: int

    def match(self, tokens: np.ndarray, namespace: str) -> Lease:
        return self.index.match(self.owner, tokens, namespace)

    def release(self, lease_id: int) -> None:
        self.index.release(lease_id)

    def plan_store(self, tokens: np.ndarray, namespace: str, final: bool,
                   hold: bool) -> StorePlan:
        return self.index.plan_store(self.owner, tokens, namespace, final, hold)

    def commit_store(self, plan_id: int, written: bool) -> None:
        self.index.commit_store(plan_id, written)


def _tell_evicted(hook: EvictedHook, node: Node) -> None:
    """An eviction goes ahead whatever the hook does: it only loses the block's copy."""
    try:
        hook(node.key, node.tokens, node.slot)
    except Exception:
        log.exception("telling of an evicted block failed")


def namespace_hash(namespace: bytes) -> str:
    """How the admin API names a namespace: tenants' names are not for its readers."""
    return xxhash.xxh3_64(namespace).hexdigest()
