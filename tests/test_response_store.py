"""The response store on its own: what it counts is what it holds, a chained turn holds what it
adds to its parent's conversation (and keeps that history when the parent goes), each tenant
has its share, and the --cache-dir file keeps the chains."""

from __future__ import annotations

import gc
import random
import time
import tracemalloc

from gateway.core.conversation import Message
from gateway.responses import store as response_store
from gateway.responses.store import ResponseStore, StoredResponse
from loadtest.response_store_memory import Load


def entry(i: int, owner: str = "", created: float | None = None, tokens: int = 100,
          parent: StoredResponse | None = None) -> StoredResponse:
    """A response adding a question, an answer and `tokens` tokens to `parent`'s."""
    before = (parent.conversation(), parent.all_text(), parent.all_tokens()) if parent \
        else ([], "", [])
    messages = [*before[0], Message(role="user", content=f"question {i}"),
                Message(role="assistant", content=f"answer {i}")]
    made = StoredResponse.make(f"resp_{i}", owner, {"id": f"resp_{i}"}, [], messages, None, "",
                               before[1] + "x" * 1000, before[2] + [1000 + i] * tokens, parent,
                               fingerprint="model")
    if created is not None:
        made.created = created
    return made


def test_the_store_is_bounded_by_size_and_age():
    now = time.time()
    store = ResponseStore(max_bytes=5000 * 4, max_age_seconds=60)
    for i in range(10):
        store.put(entry(i, created=now))
    entries, size = store.stats
    assert size <= 5000 * 4 and 1 <= entries < 10
    assert store.get("resp_9", "") is not None and store.get("resp_0", "") is None  # oldest go
    assert store.get("resp_9", "tenant-other") is None
    store.put(entry(99, created=now - 120))  # past its age: gone at the next look
    assert store.get("resp_99", "") is None


def test_what_the_store_counts_is_what_it_holds():
    """Python's own count of what 100 stored 2,048-token responses allocate is the store's,
    within 10% (it counted 4 bytes a token for lists of ints, ~36 each: less than half)."""
    load = Load(response_store, Message)
    rng = random.Random(3)
    gc.collect()
    tracemalloc.start()
    try:
        store = ResponseStore(1 << 40, 10**9)
        for _ in range(100):
            store.put(load.entry(rng, None, 1790, 248)[0])
        gc.collect()
        traced = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    counted = store.stats[1]
    assert 0.9 < counted / traced < 1.1, (counted, traced)


def test_a_chained_turn_holds_what_it_adds():
    """A conversation of 40 turns costs about what its last turn's conversation costs stored
    whole, not 40 growing copies of it."""
    store = ResponseStore(1 << 30, 3600)
    turn = None
    for i in range(40):
        turn = entry(i, parent=turn)
        store.put(turn)
    # The same conversation in one entry: 40 turns' text and tokens.
    whole = StoredResponse.make("resp_whole", "", {}, [], turn.conversation(), None, "",
                                turn.all_text(), turn.all_tokens(), fingerprint="model")
    assert len(whole.tokens) == 40 * 100 and whole.n_messages == 80
    assert store.stats[1] < 2 * whole.size


def test_a_child_keeps_its_history_when_its_parent_goes():
    """Deleting or evicting a turn unlists it; a later turn kept still has all of its history
    (the parent's data is held while a child needs it), and the bytes go when the last turn
    holding them does."""
    store = ResponseStore(1 << 30, 3600)
    first = entry(1)
    second = entry(2, parent=first)
    third = entry(3, parent=second)
    for turn in (first, second, third):
        store.put(turn)
    held = store.stats[1]
    assert held == first.size + second.size + third.size
    tokens, text, conversation = third.all_tokens(), third.all_text(), third.conversation()
    assert store.delete("resp_2", "")
    assert store.get("resp_2", "") is None and store.stats == (2, held)
    continued = store.get("resp_3", "")
    assert continued.all_tokens() == tokens and continued.all_text() == text
    assert continued.conversation() == conversation and len(conversation) == 6
    fourth = entry(4, parent=continued)
    store.put(fourth)
    assert fourth.all_tokens()[:len(tokens)] == tokens
    for name in ("resp_1", "resp_3"):
        assert store.delete(name, "")
    assert store.stats == (1, held + fourth.size)  # all of it is the fourth's history
    assert store.delete("resp_4", "")
    assert store.stats == (0, 0)

    # A parent evicted while its child was being answered is held again by the child.
    small = ResponseStore(2 * first.size + 100, 3600)
    for turn in (first, entry(5), entry(7)):  # the first is evicted
        small.put(turn)
    assert small.get("resp_1", "") is None and first.refs == 0
    child = entry(6, parent=first)
    small.put(child)  # evicts the others: the first is held as the child's history
    assert small.stats == (1, first.size + child.size)
    assert small.get("resp_6", "").all_tokens() == [1001] * 100 + [1006] * 100


def test_each_tenant_has_its_share_of_the_store():
    """Past its share (--tenant-cache-share) a tenant's stores evict its own oldest: another
    tenant's responses stay while one floods the store."""
    size = entry(0).size
    store = ResponseStore(max_bytes=20 * size, max_age_seconds=3600, tenant_share=0.5)
    for i in range(5):
        store.put(entry(i, owner="quiet"))
    for i in range(100, 200):
        store.put(entry(i, owner="busy"))
    assert all(store.get(f"resp_{i}", "quiet") is not None for i in range(5))
    assert store.get("resp_199", "busy") is not None and store.get("resp_100", "busy") is None
    assert store.stats[1] <= 20 * size
    assert store.owner_bytes("busy") <= 16 * size  # the rest of the store, not all of it
    # Under its share, a tenant's stores take from the one past it.
    for i in range(5, 9):
        store.put(entry(i, owner="quiet"))
    assert all(store.get(f"resp_{i}", "quiet") is not None for i in range(9))
    assert store.owner_bytes("busy") <= 12 * size


def test_the_file_keeps_the_chains(tmp_path):
    store = ResponseStore(1 << 30, 3600)
    first = entry(1, owner="a")
    second = entry(2, owner="a", parent=first)
    third = entry(3, owner="a", parent=second)
    for turn in (first, second, third):
        store.put(turn)
    store.delete("resp_2", "a")
    assert store.save(tmp_path) == 2
    again = ResponseStore(1 << 30, 3600)
    assert again.load(tmp_path) == 2
    assert again.stats == store.stats
    assert again.get("resp_2", "a") is None and again.get("resp_3", "b") is None
    loaded = again.get("resp_3", "a")
    assert loaded.all_tokens() == third.all_tokens() and loaded.all_text() == third.all_text()
    assert loaded.conversation() == third.conversation()
    assert loaded.listed_items() == [] and loaded.body == third.body
    assert loaded.fingerprint == "model"
