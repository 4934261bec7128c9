"""Property-based tests of the radix tree and block pool under random operation sequences."""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cache.block_pool import BlockPool
from cache.radix_tree import Match, RadixTree

BLOCK = 4
SLOTS = 12
token_lists = st.lists(st.integers(0, 3), min_size=1, max_size=6 * BLOCK)
namespaces = st.sampled_from([b"", b"tenant-a", b"tenant-b"])


class Blocks:
    """A pool and its tree, with block bytes in a plain array: each block holds its tokens."""

    def __init__(self, n_slots: int, namespace_share: float = 1.0) -> None:
        self.pool = BlockPool(n_slots, BLOCK)
        self.tree = RadixTree(self.pool, namespace_share=namespace_share)
        self.bytes = np.zeros((n_slots, BLOCK * 4), np.uint8)

    def insert(self, tokens: np.ndarray, namespace: bytes = b"") -> tuple[Match, bool]:
        def fill(start: int, end: int) -> int | None:
            slot = self.tree.allocate(namespace)
            if slot is not None:
                self.bytes[slot] = 0
                self.bytes[slot, : (end - start) * 4] = np.frombuffer(
                    tokens[start:end].tobytes(), np.uint8)
            return slot
        return self.tree.insert(tokens, fill, namespace)

    def block(self, slot: int) -> np.ndarray:
        return self.bytes[slot]


def block_content(node) -> bytes:
    return node.tokens.astype(np.int32).tobytes().ljust(BLOCK * 4, b"\0")


class TreeAndPool(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = Blocks(SLOTS, namespace_share=0.5)
        self.pool, self.tree = self.blocks.pool, self.blocks.tree
        self.held: list[tuple[Match, list[bytes]]] = []
        self.inserted: dict[bytes, list[np.ndarray]] = {}  # what each namespace ever stored
        self.pinned: list = []  # blocks pinned at some point

    def _hold(self, match: Match) -> None:
        self.held.append((match, [bytes(self.blocks.block(n.slot)) for n in match.nodes]))

    @rule(tokens=token_lists, namespace=namespaces)
    def insert(self, tokens, namespace):
        arr = np.array(tokens, np.int32)
        used_before = self.pool.n_used
        match, complete = self.blocks.insert(arr, namespace)
        self.inserted.setdefault(namespace, []).append(arr)
        self._check_blocks(match, arr)
        if complete:
            assert match.n_tokens == len(arr)
        else:  # only when everything left was in use
            assert self.pool.n_free == 0 or used_before == self.pool.n_slots
        self._hold(match)

    @rule(tokens=token_lists, namespace=namespaces)
    def pin(self, tokens, namespace):
        arr = np.array(tokens, np.int32)
        self.tree.pin(arr, namespace, until=self.tree.clock() + 3600)
        self.pinned += self.tree._walk(arr, namespace)[0]  # what it pinned, to watch

    @invariant()
    def pinned_blocks_stay_within_the_budget_and_in_the_tree(self):
        in_tree = set(map(id, self.tree.nodes()))
        still_pinned = [n for n in self.pinned if n.pinned_until > self.tree.clock()]
        assert self.tree.n_pinned <= self.tree.pin_budget
        # Never evicted while pinned (a longer copy that replaces a block takes over its pin,
        # and the budget may end a pin early: both leave the block unpinned).
        assert all(id(node) in in_tree for node in still_pinned)

    @rule(tokens=token_lists, namespace=namespaces)
    def match(self, tokens, namespace):
        arr = np.array(tokens, np.int32)
        expected_length = self.tree.matched_length(arr, namespace)
        m = self.tree.match(arr, namespace)
        assert m.n_tokens == expected_length
        # Only what this namespace stored: another tenant's identical prompt never matches.
        n = m.n_tokens
        assert n == 0 or any(len(x) >= n and np.array_equal(x[:n], arr[:n])
                             for x in self.inserted.get(namespace, []))
        self._check_blocks(m, arr)
        self._hold(m)

    def _check_blocks(self, m: Match, arr: np.ndarray) -> None:
        got = [self.blocks.block(slot)[: n * 4].view(np.int32) for slot, n in m.blocks()]
        assert np.array_equal(np.concatenate(got) if got else arr[:0], arr[: m.n_tokens])

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data):
        match, _ = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.tree.release(match)

    @invariant()
    def counts_match_owners(self):
        nodes = self.tree.nodes()
        expected = np.zeros(self.pool.n_slots, np.int64)
        for node in nodes:
            expected[node.slot] += 1
        for match, _ in self.held:
            for node in match.nodes:
                expected[node.slot] += 1
        assert (self.pool.refcounts >= 0).all()
        assert np.array_equal(self.pool.refcounts, expected)
        assert self.pool.n_used <= self.pool.n_slots
        assert self.pool.n_used == int((expected > 0).sum())
        # The tree's own check (the debug endpoint's) agrees.
        held: dict[int, int] = {}
        for match, _ in self.held:
            for node in match.nodes:
                held[node.slot] = held.get(node.slot, 0) + 1
        assert self.tree.problems(held) == []

    @invariant()
    def held_blocks_are_never_evicted_or_written(self):
        in_tree = {id(n) for n in self.tree.nodes()}
        for match, contents in self.held:
            for node, content in zip(match.nodes, contents, strict=True):
                assert id(node) in in_tree
                assert bytes(self.blocks.block(node.slot)) == content == block_content(node)

    @invariant()
    def keys_are_unique_and_chained(self):
        nodes = self.tree.nodes()
        assert len({n.key for n in nodes}) == len(nodes)
        assert len({n.slot for n in nodes}) == len(nodes)
        for node in nodes:
            assert self.tree._key(node.parent, node.tokens) == node.key
            assert node in node.parent.children[int(node.tokens[0])]

    @invariant()
    def no_unheld_leaf_is_a_strict_prefix_of_a_sibling(self):
        held = {id(n) for match, _ in self.held for n in match.nodes}
        for node in self.tree.nodes():
            if node.children or id(node) in held:
                continue
            n = len(node.tokens)
            for sibling in node.parent.children[int(node.tokens[0])]:
                assert not (len(sibling.tokens) > n
                            and np.array_equal(sibling.tokens[:n], node.tokens))

    @invariant()
    def idle_blocks_belong_to_the_tree_exactly_once(self):
        if not self.held:
            used = self.pool.refcounts[self.pool.refcounts > 0]
            assert (used == 1).all() and len(used) == len(self.tree)


TreeAndPool.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                         deadline=None)
test_tree_and_pool = TreeAndPool.TestCase


def test_lru_leaf_is_evicted_first_and_recent_prefixes_survive():
    blocks = Blocks(4)
    tree = blocks.tree
    prompts = [np.array([p] * BLOCK * 2, np.int32) for p in range(3)]
    for arr in prompts[:2]:
        match, complete = blocks.insert(arr)
        tree.release(match)
        assert complete
    tree.release(tree.match(prompts[0]))  # prompt 0 is now more recent than prompt 1
    match, complete = blocks.insert(prompts[2])
    tree.release(match)
    assert complete and tree.evictions == 2
    assert tree.match(prompts[0]).n_tokens == 8  # survived
    assert tree.match(prompts[1]).n_tokens == 0  # evicted, leaf first, then its parent


def test_a_shorter_copy_stored_after_the_longer_one_reuses_it():
    # The review's case: A stores prompt P and its answer, then B, with the same P, stores P.
    blocks = Blocks(4)
    pool, tree = blocks.pool, blocks.tree
    p_and_answer = np.arange(8, dtype=np.int32)  # two full blocks
    prompt = p_and_answer[:6]  # one full block and two tokens of the second
    for tokens in (p_and_answer, prompt):
        match, complete = blocks.insert(tokens)
        assert complete and match.n_tokens == len(tokens)
        tree.release(match)
    assert pool.n_used == len(tree) == 2
    match = tree.match(prompt)
    assert match.n_tokens == 6 and [n for _, n in match.blocks()] == [4, 2]
    tree.release(match)


def test_a_shorter_copy_held_while_the_longer_one_is_stored_goes_on_release():
    blocks = Blocks(4)
    pool, tree = blocks.pool, blocks.tree
    p_and_answer = np.arange(8, dtype=np.int32)
    prompt = p_and_answer[:6]
    held, _ = blocks.insert(prompt)
    longer, _ = blocks.insert(p_and_answer)
    tree.release(longer)
    assert pool.n_used == len(tree) == 3  # the shorter copy is still in use
    tree.release(held)
    assert pool.n_used == len(tree) == 2
    assert tree.match(prompt).n_tokens == 6


def test_everything_held_means_uncached_not_evicted():
    blocks = Blocks(2)
    tree = blocks.tree
    a = np.arange(8, dtype=np.int32)
    held, complete = blocks.insert(a)
    assert complete
    b = np.arange(8, 16, dtype=np.int32)
    partial, complete = blocks.insert(b)
    assert not complete and partial.nodes == [] and tree.evictions == 0
    assert tree.match(a).n_tokens == 8


def test_a_pin_moves_to_the_longer_copy_that_replaces_its_block():
    # The case hypothesis found: a pinned partial block superseded by its longer copy, then the
    # budget ending that pin: nothing stays pinned outside the tree, and the budget holds.
    blocks = Blocks(4)
    tree = blocks.tree
    tree.pin_budget = 2
    short, longer = np.arange(6, dtype=np.int32), np.arange(7, dtype=np.int32)
    held, _ = blocks.insert(short)
    tree.pin(short, b"", until=tree.clock() + 3600)
    tree.release(blocks.insert(longer)[0])
    tree.release(held)  # the short copy goes; its pin moves to the longer one
    assert tree.n_pinned == 2 and tree.matched_length(short) == 6
    for i in range(3):  # a flood: only the pinned path survives
        tree.release(blocks.insert(np.full(8, 10 + i, np.int32))[0])
    assert tree.matched_length(longer) == 7
    assert tree.problems({}) == []


def test_past_its_share_a_tenant_evicts_its_own_leaves_and_others_take_from_it_first():
    """A flood from one tenant cannot empty the pool of another's prefixes (before, with one
    LRU across tenants, the flood evicted tenant b's prompt)."""
    pool = BlockPool(8, BLOCK)
    tree = RadixTree(pool, namespace_share=0.5)  # 4 blocks each before their own go first

    def store(tokens: np.ndarray, namespace: bytes) -> None:
        tree.release(tree.insert(tokens, lambda *_: tree.allocate(namespace), namespace)[0])

    kept = np.arange(2 * BLOCK, dtype=np.int32)
    store(kept, b"b")
    for i in range(20):  # 40 blocks of tenant a, more recent than b's prompt
        store(np.full(2 * BLOCK, 100 + i, np.int32), b"a")
    assert tree.matched_length(kept, b"b") == 2 * BLOCK
    assert pool.n_free == 0  # a still used every free slot
    # An allocation of b's takes from a, past its share, although b's own prompt is older.
    store(np.full(BLOCK, 7, np.int32), b"b")
    assert tree.matched_length(kept, b"b") == 2 * BLOCK
    assert tree.problems({}) == []


def test_plain_lru_across_tenants_lets_a_flood_evict_everyone():
    pool = BlockPool(8, BLOCK)
    tree = RadixTree(pool, namespace_share=1.0)
    kept = np.arange(2 * BLOCK, dtype=np.int32)
    tree.release(tree.insert(kept, lambda *_: tree.allocate(b"b"), b"b")[0])
    for i in range(20):
        tree.release(tree.insert(np.full(2 * BLOCK, 100 + i, np.int32),
                                 lambda *_: tree.allocate(b"a"), b"a")[0])
    assert tree.matched_length(kept, b"b") == 0


def test_a_block_matched_only_in_part_is_not_refreshed():
    """Prompts that share only their first tokens (a chat template's opening) partly match the
    oldest first block. Before, each such match refreshed it, so it outlived every flood."""
    pool = BlockPool(4, BLOCK)
    tree = RadixTree(pool)

    def store(tokens: np.ndarray) -> None:
        tree.release(tree.insert(tokens, lambda *_: tree.allocate())[0])

    def prompt(k: int) -> np.ndarray:  # 3 shared tokens, then its own
        return np.concatenate([[1, 2, 3], np.full(BLOCK - 3, 100 + k)]).astype(np.int32)

    store(prompt(0))
    for k in range(1, 9):
        partial = tree.match(prompt(k))
        assert 0 < partial.n_tokens < BLOCK  # the opening, from another prompt's block
        tree.release(partial)
        store(prompt(k))
    assert tree.matched_length(prompt(0)) == 3  # prompt 0's own block is gone
    assert tree.matched_length(prompt(8)) == BLOCK
    assert tree.problems({}) == []


def test_a_namespace_holding_no_block_leaves_nothing_behind():
    """Cache salts come and go without bound (Dynamo's frontend passes on whatever its clients
    send): a namespace's root and its queues go with its last block, and a lookup in one that
    holds nothing leaves none behind, so the tree stays as large as what the pool holds. A
    block stored while making room for it evicted its namespace's last other block hangs from
    the namespace's root as any other."""
    pool = BlockPool(4, BLOCK)
    tree = RadixTree(pool)

    def store(tokens: np.ndarray, space: bytes) -> None:
        tree.release(tree.insert(tokens, lambda *_: tree.allocate(space), space)[0])

    for i in range(200):
        space, tokens = f"salt-{i}".encode(), np.full(BLOCK, i % 7, np.int32)
        tree.release(tree.match(tokens, space))
        tree.report(tokens, space)
        tree.chain_keys(tokens, space)
        store(tokens, space)
        if i % 3 == 0:  # past the budget of one pinned block, pins fall back to LRU
            tree.pin(tokens, space, until=tree.clock() + 3600)
    assert len(tree) == 4 and tree.problems({}) == []
    assert len(tree._roots) == 4 and set(tree._eviction_queue) <= set(tree._roots)
    assert set(tree._pin_queue) <= set(tree._roots) and set(+tree._blocks) == set(tree._roots)
    tree.release(tree.match(np.arange(BLOCK, dtype=np.int32), b"never-stored"))
    assert b"never-stored" not in tree._roots

    one = RadixTree(BlockPool(1, BLOCK))
    first, second = np.zeros(BLOCK, np.int32), np.ones(BLOCK, np.int32)
    for tokens in (first, second):  # the second evicts the first: the namespace's last block
        one.release(one.insert(tokens, lambda *_: one.allocate(b"t"), b"t")[0])
    assert one.evictions == 1 and one.matched_length(second, b"t") == BLOCK
    assert one.problems({}) == []
    assert one.drop_unheld() == 1 and not one._roots and not one._eviction_queue
