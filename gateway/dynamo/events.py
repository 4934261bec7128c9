"""The node's radix tree as Dynamo's KV events: a block is `stored` when it joins the tree (its
KV written to the pool) and `removed` when it leaves it (evicted, dropped, superseded), so
that Dynamo's KV router scores exactly what this node's pool holds.

Dynamo's router hashes each stored block's tokens itself (xxh3-64 over the block's token ids,
with the cache salt): only full blocks are published, as its hashing drops a partial one. A
tenant's namespace is the cache salt, so that the router never scores one tenant's blocks for
another's requests; the empty namespace (no API keys) is none. The block ids are the tree's
own keys, cut to Dynamo's signed 64 bits, and chain each block to its parent."""

from __future__ import annotations

from typing import Any

from cache.radix_tree import Node


def block_id(node: Node) -> int:
    return int.from_bytes(node.key[:8], "little", signed=True)


class KvEvents:
    """A BlockListener (cache/radix_tree.py) publishing to a Dynamo KvEventPublisher. Called
    under the cache index's lock: the publisher only queues the event."""

    def __init__(self, publisher: Any, block_size: int) -> None:
        self.publisher = publisher
        self.block_size = block_size

    def added(self, node: Node) -> None:
        if len(node.tokens) != self.block_size:
            return
        parent = node.parent if node.parent is not None and node.parent.parent is not None \
            else None
        self.publisher.publish_stored(
            node.tokens.tolist(), [self.block_size], [block_id(node)],
            parent_hash=None if parent is None else block_id(parent),
            cache_salt=node.namespace.decode() or None)

    def removed(self, node: Node) -> None:
        if len(node.tokens) == self.block_size:
            self.publisher.publish_removed([block_id(node)])
