"""The node's KV as Dynamo's KV events, so that Dynamo's KV router scores exactly what a request
sent here would not compute: the blocks of its radix tree (their KV in the pool) and the blocks
of the prompts its requests in flight hold in their cells, which a request of the same namespace
shares while they run (engine/batching.py `_live_prefix`; in the default engine mode a prompt's
blocks join the pool only when its request ends). A block is `stored` when the first of the two
takes it and `removed` when the last lets it go.

Dynamo's router hashes each stored block's tokens itself (xxh3-64 over the block's token ids,
with the cache salt): only full blocks are published, as its hashing drops a partial one. A
tenant's namespace is the cache salt, so that the router never scores one tenant's blocks for
another's requests; the empty namespace (no API keys) is none. The block ids are the tree's
own keys (a live block's is the key it would have there), cut to Dynamo's signed 64 bits, and
chain each block to its parent."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from cache.radix_tree import Node


@dataclass(frozen=True)
class Block:
    key: bytes  # the radix tree's key of the block
    tokens: np.ndarray
    parent: bytes | None  # the key of the block before it; None for a prompt's first
    namespace: str


def block_id(key: bytes) -> int:
    return int.from_bytes(key[:8], "little", signed=True)


def prompt_blocks(tokens: np.ndarray, keys: list[bytes], block_size: int,
                  namespace: str) -> list[Block]:
    """The blocks of `tokens` (full ones only), `keys` their tree keys (cache.index
    `chain_keys`)."""
    return [Block(key, tokens[i * block_size: (i + 1) * block_size], keys[i - 1] if i else None,
                  namespace) for i, key in enumerate(keys)]


class KvEvents:
    """A BlockListener (cache/radix_tree.py) for the tree, and `live` for the requests in
    flight, publishing to a Dynamo KvEventPublisher."""

    def __init__(self, publisher: Any, block_size: int) -> None:
        self.publisher = publisher
        self.block_size = block_size
        self._holders: Counter[bytes] = Counter()  # the tree and the live prompts, per block
        self._live: dict[bytes, Block] = {}
        # The tree tells of its changes under the cache index's lock, from every worker's
        # reader thread; the live blocks come from the event loop.
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """Publishes nothing more: the publisher's runtime is gone, and the tree, which calls
        this under its lock, must not meet its errors."""
        with self._lock:
            self._closed = True

    def added(self, node: Node) -> None:
        if len(node.tokens) == self.block_size:
            parent = node.parent.key if node.parent is not None \
                and node.parent.parent is not None else None
            with self._lock:
                self._hold(Block(node.key, node.tokens, parent, node.namespace.decode()))

    def removed(self, node: Node) -> None:
        if len(node.tokens) == self.block_size:
            with self._lock:
                self._let_go(node.key)

    def live(self, blocks: list[Block]) -> None:
        """The blocks the requests in flight hold now: those new are held, those gone let go
        (parents before children and children before parents, as the router chains them)."""
        now = {b.key: b for b in blocks}
        with self._lock:
            for key in reversed([k for k in self._live if k not in now]):
                self._let_go(key)
            for key, block in now.items():
                if key not in self._live:
                    self._hold(block)
            self._live = now

    def _hold(self, block: Block) -> None:
        self._holders[block.key] += 1
        # The publisher only queues the event.
        if self._holders[block.key] == 1 and not self._closed:
            self.publisher.publish_stored(
                block.tokens.tolist(), [self.block_size], [block_id(block.key)],
                parent_hash=None if block.parent is None else block_id(block.parent),
                cache_salt=block.namespace or None)

    def _let_go(self, key: bytes) -> None:
        self._holders[key] -= 1
        if not self._holders[key]:
            del self._holders[key]
            if not self._closed:
                self.publisher.publish_removed([block_id(key)])
