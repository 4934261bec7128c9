"""The node's KV events (gateway/dynamo/events.py) against a recording publisher: a block is
stored once while the radix tree or a prompt in flight holds it, and removed once neither does,
with the tree's keys and chaining, and each tenant's namespace as the cache salt."""

from __future__ import annotations

import numpy as np

from cache.index import CacheIndex
from cache.radix_tree import Node
from gateway.dynamo.events import KvEvents, block_id, prompt_blocks

BLOCK = 4


class Recorder:
    """Dynamo's KvEventPublisher, as far as KvEvents uses it."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def publish_stored(self, tokens: list[int], sizes: list[int], ids: list[int],
                       parent_hash: int | None, cache_salt: str | None) -> None:
        self.events.append(("stored", ids[0], parent_hash, tuple(tokens), cache_salt))

    def publish_removed(self, ids: list[int]) -> None:
        self.events.append(("removed", ids[0]))


def tree_path(index: CacheIndex, tokens: np.ndarray, namespace: str = "") -> list[Node]:
    """The tree's nodes for the full blocks of `tokens`, made by hand with the tree's keys."""
    parent, nodes = index.tree.root(namespace.encode()), []
    for i, key in enumerate(index.chain_keys(tokens, namespace)):
        parent = Node(tokens[i * BLOCK: (i + 1) * BLOCK], key, i, parent, namespace.encode())
        nodes.append(parent)
    return nodes


def live(index: CacheIndex, tokens: np.ndarray, namespace: str = ""):
    return prompt_blocks(tokens, index.chain_keys(tokens, namespace), BLOCK, namespace)


def test_a_block_is_published_once_while_the_tree_or_a_live_prompt_holds_it():
    index, recorder = CacheIndex(16, BLOCK), Recorder()
    events = KvEvents(recorder, BLOCK)
    tokens = np.arange(100, 112, dtype=np.int32)  # three blocks
    first, second, third = tree_path(index, tokens)
    # A prompt in flight first: its blocks chained as the tree would chain them.
    events.live(live(index, tokens[:8]))
    assert recorder.events == [("stored", block_id(first.key), None, (100, 101, 102, 103), None),
                               ("stored", block_id(second.key), block_id(first.key),
                                (104, 105, 106, 107), None)]
    recorder.events.clear()
    for node in (first, second, third):  # the request ends: its blocks join the tree
        events.added(node)
    events.live([])
    assert recorder.events == [("stored", block_id(third.key), block_id(second.key),
                                (108, 109, 110, 111), None)]
    recorder.events.clear()
    events.live(live(index, tokens))  # another request on the whole prompt
    events.removed(third)  # evicted while the request holds it
    events.removed(second)
    assert recorder.events == []
    events.live([])  # the request ends: the tree holds only the first block now
    assert recorder.events == [("removed", block_id(third.key)),
                               ("removed", block_id(second.key))]


def test_a_tenants_live_blocks_carry_its_namespace_and_partial_blocks_none():
    index, recorder = CacheIndex(16, BLOCK), Recorder()
    events = KvEvents(recorder, BLOCK)
    tokens = np.arange(7, dtype=np.int32)
    events.live(live(index, tokens[:4], "tenant:a"))
    (kind, key, _, _, salt), = recorder.events
    assert (kind, salt) == ("stored", "tenant:a")
    assert key != block_id(index.chain_keys(tokens[:4], "")[0])  # another namespace's key
    partial = Node(tokens[4:], b"\1" * 16, 1, None)
    events.added(partial)
    events.removed(partial)
    assert len(recorder.events) == 1


def test_nothing_is_published_once_closed():
    """After the node left Dynamo's runtime (lost or stopped), the tree still changes."""
    index, recorder = CacheIndex(16, BLOCK), Recorder()
    events = KvEvents(recorder, BLOCK)
    tokens = np.arange(8, dtype=np.int32)
    events.close()
    events.live(live(index, tokens))
    for node in tree_path(index, tokens):
        events.added(node)
        events.removed(node)
    events.live([])
    assert recorder.events == []
