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
  such a leaf in turn. Touching a path moves the leaf first, so ancestors stay more recent than
  their descendants and the LRU order meets leaves first.
- No block only the tree references is a strict prefix of a sibling: its longer copy serves it.
- A pinned block (`prompt_cache_retention`) is never evicted before its pin expires; pins cover
  whole paths, so a pinned leaf's ancestors are pinned too, and at most `pin_budget` blocks are
  pinned at once. Past it, pins fall back to plain LRU from the namespace holding the most,
  those expiring first, leaf first: what stays pinned is always a prefix.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import xxhash

from cache.block_pool import BlockPool
from cache.tokens import common_prefix

# Given the token range [start, end) of a block the tree lacks, returns a slot holding its KV
# with one reference, which the tree takes over, or None when there is none.
BlockFiller = Callable[[int, int], int | None]


@dataclass(eq=False)
class Node:
    tokens: np.ndarray
    key: bytes
    slot: int
    parent: Node | None
    namespace: bytes = b""
    children: dict[int, list[Node]] = field(default_factory=dict)  # by first token
    hits: int = 0  # matches that used this block
    last_used: float = 0.0  # wall-clock time of the last match or store
    pinned_until: float = 0.0  # wall-clock time until which eviction passes it by

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


class RadixTree:
    def __init__(self, pool: BlockPool, pin_budget: int | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.pin_budget = pool.n_slots // 4 if pin_budget is None else pin_budget
        self.clock = clock
        self.pin_fallbacks = 0  # pins dropped to stay within the budget
        self._pins: dict[Node, None] = {}
        self._roots: dict[bytes, Node] = {}
        self._index: dict[bytes, Node] = {}
        self._lru: OrderedDict[Node, None] = OrderedDict()
        self.evictions = 0

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
        keys, key = [], self.root(namespace).key
        for start in range(0, len(tokens), self.block_size):
            key = _block_key(key, tokens[start: start + self.block_size])
            keys.append(key)
        return keys

    def root(self, namespace: bytes) -> Node:
        root = self._roots.get(namespace)
        if root is None:
            key = xxhash.xxh3_128(b"prefixgate\0" + namespace).digest()
            root = self._roots[namespace] = Node(np.empty(0, np.int32), key, -1, None,
                                                 namespace)
        return root

    def match(self, tokens: np.ndarray, namespace: bytes = b"") -> Match:
        """The longest cached prefix of `tokens`, retained for the caller."""
        path, n = self._walk(tokens, namespace)
        for node in path:
            self.pool.retain(node.slot)
            node.hits += 1
        self._touch(path)
        return Match(path, n)

    def matched_length(self, tokens: np.ndarray, namespace: bytes = b"") -> int:
        """How much of `tokens` is cached, without using (or refreshing) any block."""
        return self._walk(tokens, namespace)[1]

    def _walk(self, tokens: np.ndarray, namespace: bytes) -> tuple[list[Node], int]:
        node, path, n = self.root(namespace), [], 0
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
            raise
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
        match.nodes = []

    def _new_node(self, parent: Node, chunk: np.ndarray, start: int,
                  fill: BlockFiller) -> Node | None:
        key = self._key(parent, chunk)
        if key in self._index:  # a hash collision: never let it alias another prefix
            return None
        slot = fill(start, start + len(chunk))
        if slot is None:
            return None
        node = Node(chunk.copy(), key, slot, parent, parent.namespace)
        self.pool.retain(slot)  # one reference for the tree, one for the inserting caller
        parent.children.setdefault(int(chunk[0]), []).append(node)
        self._index[key] = node
        self._lru[node] = None
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
            longer.pinned_until = shorter.pinned_until
            self._pins[longer] = None
        shorter.pinned_until = 0.0  # the pin lives on in the longer copy
        self._remove(shorter)

    def allocate(self) -> int | None:
        """A free slot with one reference, evicting least recently used blocks to make room."""
        slot = self.pool.allocate()
        while slot is None and self._evict_one():
            slot = self.pool.allocate()
        return slot

    def pin(self, tokens: np.ndarray, namespace: bytes, until: float) -> int:
        """Pins the cached blocks of `tokens` until `until` (a later pin of a block extends it).
        Returns how many pins fell back to LRU to stay within the budget."""
        path, _ = self._walk(tokens, namespace)
        for node in path:
            node.pinned_until = max(node.pinned_until, until)
            self._pins[node] = None
        now, dropped = self.clock(), 0
        for node in [n for n in self._pins if n.pinned_until <= now]:
            self._unpin(node)
        while len(self._pins) > self.pin_budget:
            self._unpin(self._pin_to_give_up())
            dropped += 1
        self.pin_fallbacks += dropped
        return dropped

    def _pin_to_give_up(self) -> Node:
        """Past the budget: a pin of the namespace that holds the most (one tenant's pins
        cannot push out every other's), expiring first, and the deepest of its path first,
        so that what stays pinned is a prefix: a pinned leaf under unpinned ancestors would
        keep the whole path from eviction, since only leaves are evicted."""
        per_namespace = Counter(node.namespace for node in self._pins)
        return min(self._pins, key=lambda n: (-per_namespace[n.namespace], n.pinned_until,
                                              self._has_pinned_child(n)))

    def _has_pinned_child(self, node: Node) -> bool:
        return any(child in self._pins for siblings in node.children.values()
                   for child in siblings)

    @property
    def n_pinned(self) -> int:
        now = self.clock()
        return sum(1 for node in self._pins if node.pinned_until > now)

    def _unpin(self, node: Node) -> None:
        node.pinned_until = 0.0
        self._pins.pop(node, None)

    def _pinned(self, node: Node) -> bool:
        return node.pinned_until > self.clock()

    def _evict_one(self) -> bool:
        for node in self._lru:
            if self._evictable(node) and not self._pinned(node):
                self._remove(node)
                self.evictions += 1
                return True
        return False

    def _evictable(self, node: Node) -> bool:
        return not node.children and self.pool.refcounts[node.slot] == 1

    def _remove(self, node: Node) -> None:
        siblings = node.parent.children[int(node.tokens[0])]
        siblings.remove(node)
        if not siblings:
            del node.parent.children[int(node.tokens[0])]
        del self._index[node.key]
        del self._lru[node]
        self._pins.pop(node, None)
        self.pool.release(node.slot)

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
        for slot, n in held.items():
            expected[slot] += n
        for slot in np.flatnonzero(expected != self.pool.refcounts):
            found.append(f"slot {slot}: {self.pool.refcounts[slot]} references, expected "
                         f"{expected[slot]}")
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


def _block_key(parent_key: bytes, chunk: np.ndarray) -> bytes:
    return xxhash.xxh3_128(parent_key + chunk.astype(np.int32).tobytes()).digest()
