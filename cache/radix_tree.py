"""A radix tree over token ids whose nodes are KV blocks in a BlockPool.

Each node holds the tokens of one block: up to `block_size` consecutive positions, starting at a
multiple of the block size. Matching is token-granular: a match may end inside a node, and the
matching part of that block is reused. A partial tail block and its longer versions are siblings;
extending a block never writes it, it stores a copy (copy-on-write). Storing a shorter version of a
stored block reuses the longer one, which already holds the KV of those positions.

Invariants (checked by the property tests):
- Every node's slot is referenced once by the tree, plus once per holder of a Match or insert
  path that contains it. A slot with a reference other than the tree's is never evicted or written.
- A node's key is xxh3-128(parent key + its tokens), and each namespace (a tenant's, chosen by
  the server per request) has a root of its own keyed by its name, so equal keys mean equal
  prefixes in one namespace and no prefix is ever matched across namespaces; stored tokens are
  still compared on every hit, so a hash collision can never serve another prompt's KV. No two
  nodes share a key.
- Eviction takes the least recently used leaf that only the tree references; its parent may become
  such a leaf in turn. Touching a path stamps the leaf first, so ancestors stay more recent than
  their descendants. Every such leaf that is not pinned waits in its namespace's eviction queue
  under its latest stamp, so that eviction never scans past blocks in use or pinned (the role
  of vLLM's free-block queue; a heap, because a parent that becomes a leaf keeps its old place).
- A block a match uses only in part (often no more than a chat template's opening, which every
  prompt shares) is not refreshed: else the first such block would stay the most recent for
  every prompt that starts alike, and never be evicted.
- A namespace's root, and what the tree keeps per namespace (its block count, its eviction and
  pin queues), lives only while the namespace holds a block: namespaces come and go (Dynamo's
  frontend hands a node any cache salt its clients choose), and a namespace a lookup merely
  names leaves nothing behind.
- A namespace past its share of the pool (`namespace_share`) makes room from its own leaves
  first, and an allocation of any other namespace takes from those past their share before
  anyone else: one tenant's flood cannot empty the pool of every other tenant's prefixes,
  while free slots stay usable by whoever needs them.
- No block only the tree references is a strict prefix of a sibling: its longer copy serves it.
- A pinned block (`prompt_cache_retention`) is never evicted before its pin expires; pins cover
  whole paths, so a pinned leaf's ancestors are pinned too, and at most `pin_budget` blocks are
  pinned at once. Past it, pins fall back to plain LRU from the namespace holding the most,
  those expiring first, leaf first: what stays pinned is always a prefix.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import xxhash

from cache.block_pool import BlockPool
from cache.tokens import common_prefix


class BlockListener(Protocol):
    """Told of every block as it joins the tree (its KV written) and as it leaves it, under
    the lock of whoever changes the tree: what mirrors the tree elsewhere (Dynamo's KV
    events) keeps up without ever walking it again."""

    def added(self, node: Node) -> None: ...

    def removed(self, node: Node) -> None: ...


# Given the token range [start, end) of a block the tree lacks, returns a slot holding its KV
# with one reference, which the tree takes over, or None when there is none.
BlockFiller = Callable[[int, int], int | None]

# Told of a block the moment LRU eviction picks it, before its slot goes back to the free list:
# its bytes are intact until the call returns, and the slot may be reused right after (under
# the lock of whoever allocates). What writes blocks back at eviction (the Redis tier's
# `--redis-write evict`) copies them here.
EvictedHook = Callable[["Node"], None]


@dataclass(eq=False)
class Node:
    tokens: np.ndarray
    key: bytes
    slot: int
    parent: Node | None
    namespace: bytes = b""
    depth: int = 0  # blocks from the root
    children: dict[int, list[Node]] = field(default_factory=dict)  # by first token
    hits: int = 0  # matches that used this block
    last_used: float = 0.0  # wall-clock time of the last match or store
    pinned_until: float = 0.0  # wall-clock time until which eviction passes it by
    stamp: int = 0  # recency order: a later touch gives a larger stamp
    queued: int = 0  # the stamp it waits under in the eviction queue, 0 when it does not

    def path_tokens(self) -> np.ndarray:
        """Every token from the root to the end of this block."""
        parts, node = [], self
        while node is not None:
            parts.append(node.tokens)
            node = node.parent
        return np.concatenate(parts[::-1])


@dataclass
class Match:
    """A matched prefix, holding a reference on each of its blocks until released."""

    nodes: list[Node]
    n_tokens: int

    def blocks(self) -> list[tuple[int, int]]:
        """(slot, tokens used) per block; only the last block may be used partly."""
        used = [len(n.tokens) for n in self.nodes]
        if used:
            used[-1] = self.n_tokens - sum(used[:-1])
        return [(n.slot, u) for n, u in zip(self.nodes, used, strict=True)]


@dataclass(frozen=True)
class PathReport:
    """How a prompt meets the cached paths, for explaining a miss (nothing is used or touched)."""

    n_tokens: int  # the longest cached prefix
    pinned_tokens: int  # of those, in pinned blocks
    following: np.ndarray  # what the cache holds where the prompt leaves it (maybe nothing)


class RadixTree:
    def __init__(self, pool: BlockPool, pin_budget: int | None = None,
                 clock: Callable[[], float] = time.time, namespace_share: float = 1.0) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.pin_budget = pool.n_slots // 4 if pin_budget is None else pin_budget
        self.namespace_quota = math.ceil(namespace_share * pool.n_slots)  # blocks
        self.clock = clock
        self.pin_fallbacks = 0  # pins dropped to stay within the budget
        self.evictions = 0
        self._roots: dict[bytes, Node] = {}
        self._index: dict[bytes, Node] = {}
        self._lru: OrderedDict[Node, None] = OrderedDict()  # every block, for listings
        self._stamps = itertools.count(1)
        self._blocks: Counter[bytes] = Counter()  # per namespace
        self._eviction_queue: dict[bytes, list[tuple[int, Node]]] = {}  # heaps by stamp
        self._pins: dict[Node, None] = {}
        self._pins_per_namespace: Counter[bytes] = Counter()
        # Heaps by (pin end, deepest first): the order in which pins expire or give way.
        self._pin_queue: dict[bytes, list[tuple[float, int, int, Node]]] = {}
        self.listener: BlockListener | None = None
        self.on_evicted: EvictedHook | None = None

    def __len__(self) -> int:
        return len(self._index)

    def nodes(self) -> list[Node]:
        return list(self._index.values())

    def leaves(self) -> list[Node]:
        """Blocks that end a cached path, most recently used first."""
        return [node for node in reversed(self._lru) if not node.children]

    def drop_unheld(self, namespace: bytes | None = None) -> int:
        """Removes every block nobody but the tree holds (pinned or not), leaves first, in one
        namespace or all; returns how many."""
        dropped = 0
        while True:
            doomed = [n for n in self._lru if self._evictable(n)
                      and (namespace is None or n.namespace == namespace)]
            if not doomed:
                return dropped
            for node in doomed:
                self._remove(node)
            dropped += len(doomed)

    def by_recency(self) -> list[Node]:
        """Every block, least recently used first: each after its descendants."""
        return list(self._lru)

    def chain_keys(self, tokens: np.ndarray, namespace: bytes = b"") -> list[bytes]:
        """The key each block of `tokens` has (or would have) in the tree, block by block."""
        keys, key = [], _root_key(namespace)
        for start in range(0, len(tokens), self.block_size):
            key = _block_key(key, tokens[start: start + self.block_size])
            keys.append(key)
        return keys

    def root(self, namespace: bytes) -> Node:
        """The namespace's root, made if it has none (kept only while it holds a block)."""
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = _new_root(namespace)
        return root

    def _prune(self, space: bytes) -> None:
        """Forgets a namespace that holds no block any more: its root and what the tree keeps
        for it."""
        root = self._roots.get(space)
        if root is None or root.children:
            return
        del self._roots[space]
        self._blocks.pop(space, None)
        self._eviction_queue.pop(space, None)
        self._pin_queue.pop(space, None)

    def match(self, tokens: np.ndarray, namespace: bytes = b"") -> Match:
        """The longest cached prefix of `tokens`, retained for the caller."""
        path, n = self._walk(tokens, namespace)
        for node in path:
            self.pool.retain(node.slot)
            node.hits += 1
        partial = bool(path) and n < sum(len(node.tokens) for node in path)
        self._touch(path[:-1] if partial else path)
        return Match(path, n)

    def matched_length(self, tokens: np.ndarray, namespace: bytes = b"") -> int:
        """How much of `tokens` is cached, without using (or refreshing) any block."""
        return self._walk(tokens, namespace)[1]

    def report(self, tokens: np.ndarray, namespace: bytes = b"", following: int = 32
               ) -> PathReport:
        """The longest cached prefix of `tokens`, how much of it is pinned, and up to
        `following` tokens the cache holds after it: the rest of a block the prompt left
        inside, then the most recently used path on."""
        path, n = self._walk(tokens, namespace)
        now, start, pinned = self.clock(), 0, 0
        for node in path:
            used = min(len(node.tokens), n - start)
            pinned += used if node.pinned_until > now else 0
            start += len(node.tokens)
        node = path[-1] if path else self._roots.get(namespace) or _new_root(namespace)
        held = [node.tokens[len(node.tokens) - (start - n):]] if start > n else []
        while sum(map(len, held)) < following and node.children:
            node = max((c for group in node.children.values() for c in group),
                       key=lambda child: child.stamp)
            held.append(node.tokens)
        after = np.concatenate(held)[:following] if held else np.empty(0, np.int32)
        return PathReport(n, pinned, after)

    def _walk(self, tokens: np.ndarray, namespace: bytes) -> tuple[list[Node], int]:
        node, path, n = self._roots.get(namespace), [], 0
        if node is None:  # nothing cached there: looking leaves no root behind
            return path, n
        while n < len(tokens):
            chunk = tokens[n: n + self.block_size]
            child = self._child(node, chunk)
            if child is None:
                child, used = self._longest_common(node, chunk)
                if used:
                    path.append(child)
                    n += used
                break
            path.append(child)
            n += len(chunk)
            node = child
        return path, n

    def insert(self, tokens: np.ndarray, fill: BlockFiller,
               namespace: bytes = b"") -> tuple[Match, bool]:
        """Store every block of `tokens` the tree lacks, `fill` providing each one. Returns
        the path, retained for the caller, and whether all of it fitted in the pool. The path's
        last block may hold more than `tokens`; the match covers only what was asked for."""
        node, path, n, complete = self.root(namespace), [], 0, True
        try:
            for start in range(0, len(tokens), self.block_size):
                chunk = tokens[start: start + self.block_size]
                child = self._child(node, chunk) or self._longer_copy(node, chunk)
                if child is None:
                    child = self._new_node(node, chunk, start, fill)
                    if child is None:
                        complete = False
                        break
                else:
                    self.pool.retain(child.slot)
                path.append(child)  # retained as we go, so making room never evicts the path
                n += len(chunk)
                node = child
        except BaseException:  # a failed fill: the caller gets nothing to release
            self.release(Match(path, n))
            self._prune(namespace)
            raise
        if not path:  # nothing fitted: no root stays for a namespace holding nothing
            self._prune(namespace)
        self._touch(path)
        return Match(path, n), complete

    def release(self, match: Match) -> None:
        for node in match.nodes:
            self.pool.release(node.slot)
            # A block held when its longer copy was stored has outlived its use.
            longer = self._longer_copy(node.parent, node.tokens) if self._evictable(node) \
                else None
            if longer is not None:
                self._supersede(node, longer)
            else:
                self._offer(node)
        match.nodes = []

    def _new_node(self, parent: Node, chunk: np.ndarray, start: int,
                  fill: BlockFiller) -> Node | None:
        key = self._key(parent, chunk)
        if key in self._index:  # a hash collision: never let it alias another prefix
            return None
        slot = fill(start, start + len(chunk))
        if parent.parent is None:  # making room may have evicted its namespace's last block
            self._roots[parent.namespace] = parent
        if slot is None:
            return None
        node = Node(chunk.copy(), key, slot, parent, parent.namespace, parent.depth + 1,
                    stamp=next(self._stamps))
        self.pool.retain(slot)  # one reference for the tree, one for the inserting caller
        parent.children.setdefault(int(chunk[0]), []).append(node)
        self._index[key] = node
        self._lru[node] = None
        self._blocks[node.namespace] += 1
        if self.listener is not None:
            self.listener.added(node)
        self._drop_superseded(parent, node)
        return node

    def _drop_superseded(self, parent: Node, node: Node) -> None:
        """A shorter sibling whose tokens all begin `node` is redundant once nobody holds it."""
        for sibling in list(parent.children[int(node.tokens[0])]):
            n = len(sibling.tokens)
            if (n < len(node.tokens) and self._evictable(sibling)
                    and np.array_equal(sibling.tokens, node.tokens[:n])):
                self._supersede(sibling, node)

    def _supersede(self, shorter: Node, longer: Node) -> None:
        """Drops `shorter` for the copy that holds all of it; its pin moves along."""
        if shorter.pinned_until > longer.pinned_until:
            self._pin(longer, shorter.pinned_until)
        shorter.pinned_until = 0.0  # the pin lives on in the longer copy
        self._remove(shorter)

    def allocate(self, namespace: bytes = b"") -> int | None:
        """A free slot with one reference, evicting least recently used blocks to make room
        for a block of `namespace`."""
        slot = self.pool.allocate()
        while slot is None and self._evict_one(namespace):
            slot = self.pool.allocate()
        return slot

    def pin(self, tokens: np.ndarray, namespace: bytes, until: float) -> int:
        """Pins the cached blocks of `tokens` until `until` (a later pin of a block extends it).
        Returns how many pins fell back to LRU to stay within the budget."""
        path, _ = self._walk(tokens, namespace)
        for node in path:
            self._pin(node, until)
        self._expire_pins()
        dropped = 0
        while len(self._pins) > self.pin_budget:
            self._unpin(self._pin_to_give_up())
            dropped += 1
        self.pin_fallbacks += dropped
        return dropped

    def _pin(self, node: Node, until: float) -> None:
        if node in self._pins and node.pinned_until >= until:
            return
        if node not in self._pins:
            self._pins[node] = None
            self._pins_per_namespace[node.namespace] += 1
        node.pinned_until = until
        queue = self._pin_queue.setdefault(node.namespace, [])
        heapq.heappush(queue, (until, -node.depth, next(self._stamps), node))
        if len(queue) > 2 * self._pins_per_namespace[node.namespace] + 64:
            queue[:] = [e for e in queue if self._pin_entry_valid(e)]
            heapq.heapify(queue)

    def _pin_entry_valid(self, entry: tuple[float, int, int, Node]) -> bool:
        return entry[3] in self._pins and entry[3].pinned_until == entry[0]

    def _next_pin(self, namespace: bytes) -> Node | None:
        """The namespace's pin that expires first, deepest first among equals."""
        queue = self._pin_queue.get(namespace, [])
        while queue and not self._pin_entry_valid(queue[0]):
            heapq.heappop(queue)
        return queue[0][3] if queue else None

    def _expire_pins(self) -> None:
        now = self.clock()
        for namespace in list(self._pin_queue):
            while (node := self._next_pin(namespace)) is not None and node.pinned_until <= now:
                self._unpin(node)

    def _pin_to_give_up(self) -> Node:
        """Past the budget: a pin of the namespace that holds the most (one tenant's pins
        cannot push out every other's), expiring first, and the deepest of its path first,
        so that what stays pinned is a prefix: a pinned leaf under unpinned ancestors would
        keep the whole path from eviction, since only leaves are evicted. (A pin covers its
        whole path and extends, never shortens, so an ancestor's pin never ends earlier.)"""
        namespace, _ = self._pins_per_namespace.most_common(1)[0]
        node = self._next_pin(namespace)
        assert node is not None
        return node

    @property
    def n_pinned(self) -> int:
        now = self.clock()
        return sum(1 for node in self._pins if node.pinned_until > now)

    def _unpin(self, node: Node) -> None:
        node.pinned_until = 0.0
        self._forget_pin(node)
        self._offer(node)

    def _forget_pin(self, node: Node) -> None:
        if self._pins.pop(node, 0) is None:
            self._pins_per_namespace[node.namespace] -= 1
            if not self._pins_per_namespace[node.namespace]:
                del self._pins_per_namespace[node.namespace]

    def _pinned(self, node: Node) -> bool:
        return node.pinned_until > self.clock()

    def _evict_one(self, namespace: bytes) -> bool:
        """Evicts the least recently used unpinned leaf nobody holds: `namespace`'s own when
        it is at its share, else one of a namespace past its share, else anyone's."""
        self._expire_pins()
        over = [n for n, count in self._blocks.items() if count > self.namespace_quota]
        victim = None
        if self._blocks[namespace] >= self.namespace_quota:
            victim = self._lru_leaf(namespace)
        if victim is None and over:
            victim = self._oldest_leaf(over)
        if victim is None:
            victim = self._oldest_leaf(list(self._eviction_queue))
        if victim is None:
            return False
        if self.on_evicted is not None:
            self.on_evicted(victim)
        self._remove(victim)
        self.evictions += 1
        return True

    def _oldest_leaf(self, namespaces: list[bytes]) -> Node | None:
        leaves = [leaf for n in namespaces if (leaf := self._lru_leaf(n)) is not None]
        return min(leaves, key=lambda leaf: leaf.stamp, default=None)

    def _lru_leaf(self, namespace: bytes) -> Node | None:
        """The head of the namespace's eviction queue, after dropping what no longer belongs
        there: blocks touched since they were queued (queued again under their new stamp),
        removed, held again, given a child, or pinned (queued again when unpinned)."""
        queue = self._eviction_queue.get(namespace, [])
        while queue:
            stamp, node = queue[0]
            if stamp == node.stamp and self._index.get(node.key) is node \
                    and self._evictable(node) and not self._pinned(node):
                return node
            heapq.heappop(queue)
            if node.queued == stamp:
                node.queued = 0
        return None

    def _offer(self, node: Node) -> None:
        """Queues a block for eviction if it has just become a candidate."""
        if node.parent is None or node.queued == node.stamp or not self._evictable(node) \
                or self._pinned(node) or self._index.get(node.key) is not node:
            return
        node.queued = node.stamp
        queue = self._eviction_queue.setdefault(node.namespace, [])
        heapq.heappush(queue, (node.stamp, node))
        if len(queue) > 2 * self._blocks[node.namespace] + 64:  # drop entries gone stale
            queue[:] = [(s, n) for s, n in queue
                        if n.queued == s and self._index.get(n.key) is n]
            heapq.heapify(queue)

    def _evictable(self, node: Node) -> bool:
        return not node.children and self.pool.refcounts[node.slot] == 1

    def _remove(self, node: Node) -> None:
        siblings = node.parent.children[int(node.tokens[0])]
        siblings.remove(node)
        if not siblings:
            del node.parent.children[int(node.tokens[0])]
        del self._index[node.key]
        del self._lru[node]
        self._blocks[node.namespace] -= 1
        self._forget_pin(node)
        self.pool.release(node.slot)
        if self.listener is not None:
            self.listener.removed(node)
        if node.parent.parent is None:
            self._prune(node.namespace)
        else:
            self._offer(node.parent)

    def _child(self, parent: Node, chunk: np.ndarray) -> Node | None:
        node = self._index.get(self._key(parent, chunk))
        if node is not None and node.parent is parent and np.array_equal(node.tokens, chunk):
            return node
        return None

    def _longer_copy(self, parent: Node, chunk: np.ndarray) -> Node | None:
        if len(chunk) == self.block_size:  # nothing is longer than a full block: skip the scan
            return None
        return next((child for child in parent.children.get(int(chunk[0]), [])
                     if len(child.tokens) > len(chunk)
                     and np.array_equal(child.tokens[: len(chunk)], chunk)), None)

    def _longest_common(self, parent: Node, chunk: np.ndarray) -> tuple[Node | None, int]:
        best, best_len = None, 0
        for child in parent.children.get(int(chunk[0]), []):
            common = common_prefix(child.tokens, chunk)
            if common > best_len:
                best, best_len = child, common
        return best, best_len

    def _key(self, parent: Node, chunk: np.ndarray) -> bytes:
        return _block_key(parent.key, chunk)

    def problems(self, held: dict[int, int]) -> list[str]:
        """Violations of the invariants above, given how many references each slot has besides
        the tree's (`held`): empty when all hold. For tests and the debug endpoint."""
        found = []
        expected = np.zeros(self.pool.n_slots, np.int64)
        for node in self._index.values():
            expected[node.slot] += 1
            if node not in self._lru:
                found.append(f"block {node.slot} is missing from the LRU list")
            siblings = node.parent.children.get(int(node.tokens[0]), [])
            if node not in siblings:
                found.append(f"block {node.slot} is not among its parent's children")
            if self._evictable(node) and self._longer_copy(node.parent, node.tokens):
                found.append(f"block {node.slot} is an unheld strict prefix of a sibling")
            if self._evictable(node) and node not in self._pins and node.queued != node.stamp:
                found.append(f"block {node.slot} can be evicted but is not queued")
            if node.parent.parent is None and self._roots.get(node.namespace) is not node.parent:
                found.append(f"block {node.slot} hangs from a root its namespace lost")
        kept = {*self._blocks, *self._eviction_queue, *self._pin_queue, *self._roots}
        for space in sorted(kept):
            if space not in self._roots or not self._roots[space].children:
                found.append(f"namespace {space!r} holds no block but is kept")
        for slot, n in held.items():
            expected[slot] += n
        for slot in np.flatnonzero(expected != self.pool.refcounts):
            found.append(f"slot {slot}: {self.pool.refcounts[slot]} references, expected "
                         f"{expected[slot]}")
        if +self._blocks != Counter(node.namespace for node in self._index.values()):
            found.append("the per-namespace block counts are wrong")
        if len(self._lru) != len(self._index):
            found.append(f"{len(self._lru)} blocks in the LRU list, {len(self._index)} in the tree")
        if self.pool.n_used != int((self.pool.refcounts > 0).sum()):
            found.append("the free list disagrees with the reference counts")
        return found

    def _touch(self, path: list[Node]) -> None:
        now = self.clock()
        for node in reversed(path):
            self._lru.move_to_end(node)
            node.last_used = now
            node.stamp = next(self._stamps)


def _root_key(namespace: bytes) -> bytes:
    return xxhash.xxh3_128(b"prefixgate\0" + namespace).digest()


def _new_root(namespace: bytes) -> Node:
    return Node(np.empty(0, np.int32), _root_key(namespace), -1, None, namespace)


def _block_key(parent_key: bytes, chunk: np.ndarray) -> bytes:
    return xxhash.xxh3_128(parent_key + chunk.astype(np.int32).tobytes()).digest()
