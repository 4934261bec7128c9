"""Stored responses (`store`, true by default on /v1/responses): what GET, DELETE and
`input_items` read, and what `previous_response_id` continues from.

A response belongs to its tenant, the owner of the key that made it (another key, even one whose
prefixes share a cache namespace with it, never sees it; without keys there is one anonymous
owner), and is kept with the conversation as chat messages up to and including its own answer,
and the exact tokens its sequence held: its prompt's and the ones it generated, with the text
they render as. A turn that continues it with the same instructions and tools starts from those
very tokens, so its whole history loads from the prefix cache instead of being rendered and
tokenized again (which may tokenize an answer differently from how it was generated).

Such a turn is kept as its parent (the stored response it continued) plus what it adds: the
tokens, text and messages past the parent's, so a conversation of n turns costs what its last
turn holds, not n copies of its history. A parent evicted or deleted is no longer listed (GET
404s, no new turn continues it), but its data stays as long as a kept child needs it as
history: each entry counts the references to it (its listing, and each child whose data is
kept), and its bytes are released, with its own parent's reference, when none is left. So a
child never loses its history, and deleting or evicting the last kept turn of a conversation
frees all of it.

Entries are kept compactly and counted as they sit in memory: token ids in an `array('i')`
(4 bytes each), the response object, its input items and its messages as JSON bytes, and each
entry's size is `sys.getsizeof` of what it holds plus its bookkeeping
(loadtest/response_store_memory.py compares the count with the process's memory).

Bounded by the entries' total size and age (--response-store-mb, --response-store-hours), as
the prefix cache's pool is bounded per tenant (--tenant-cache-share): a tenant past its share
of the store makes room from its own oldest responses, and another tenant's stores take from
those past their share before anyone else; below that, the oldest go first. With --cache-dir
they are written there at shutdown (owner-only, as the prefix cache's snapshot: they hold
whole conversations) and read back at start. Each keeps the fingerprint of the model that made
it: its token ids mean nothing to another, so a continuation on another model renders the
conversation afresh from its messages. With --redis-url and --redis-key every
replica reads them through Redis as well, encrypted (gateway/responses/shared_store.py); without the
key they are never put in Redis.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from pydantic import TypeAdapter, ValidationError

from cache.persistence import private_file
from gateway.core.conversation import Message

log = logging.getLogger(__name__)

FILE_NAME = "responses.json"
# 1 kept the cache namespace, which tenants of a shared group have alike; 2 kept every turn
# whole; 3 was one model's file
VERSION = 4
TOKEN_TYPE = "i"  # array('i'): 4-byte token ids
# What an entry costs beyond its fields' objects: its places in the store's two indexes (an
# OrderedDict node and a dict slot each), its creation time and counters (measured by
# loadtest/response_store_memory.py).
BOOKKEEPING_BYTES = 320
_MESSAGES = TypeAdapter(list[Message])


@dataclass(eq=False, slots=True)
class StoredResponse:
    """One stored response: what it adds to its parent's conversation (the stored response it
    continued, whose tokens, text and messages its own start with), or all of it without one.
    Immutable but for the store's bookkeeping."""

    id: str
    owner: str  # the tenant whose key made it ("" without keys): the only one who sees it
    body: bytes  # the response object as it was returned, JSON
    input_items: bytes  # this turn's input, each with its id: a JSON list
    messages: bytes  # the conversation's messages past the parent's: a JSON list
    instructions: str | None
    tools_text: str  # what the tools rendered as: a continuation with other tools re-renders
    text: str  # the rendered text past the parent's (prompt's and answer's), that `tokens` hold
    tokens: array  # the token ids past the parent's
    fingerprint: str  # the GGUF's whose token ids `tokens` holds (a chain has one model)
    parent: StoredResponse | None = None
    created: float = field(default_factory=time.time)
    n_tokens: int = 0  # in the whole conversation: the parent's and its own
    n_chars: int = 0
    n_messages: int = 0
    size: int = 0  # bytes it holds itself (not its parent's)
    refs: int = 0  # the store's: its listing and its kept children

    def __post_init__(self) -> None:
        up = self.parent
        self.n_tokens = len(self.tokens) + (up.n_tokens if up else 0)
        self.n_chars = len(self.text) + (up.n_chars if up else 0)
        self.n_messages = len(orjson.loads(self.messages)) + (up.n_messages if up else 0)
        self.size = self._measure()

    @classmethod
    def make(cls, response_id: str, owner: str, body: dict, input_items: list[dict],
             messages: list[Message], instructions: str | None, tools_text: str, text: str,
             tokens: list[int], parent: StoredResponse | None = None, *, fingerprint: str
             ) -> StoredResponse:
        """A stored response from the whole conversation (`messages`, `text`, `tokens`): with a
        `parent`, whose own they start with, only what comes past the parent's is kept."""
        if parent is not None:
            messages = messages[parent.n_messages:]
            text, tokens = text[parent.n_chars:], tokens[parent.n_tokens:]
            if instructions == parent.instructions:  # one string for the whole chain
                instructions = parent.instructions
            if tools_text == parent.tools_text:
                tools_text = parent.tools_text
        return cls(response_id, owner, _json(body), _json(input_items),
                   _MESSAGES.dump_json(messages, exclude_none=True), instructions, tools_text,
                   text, array(TOKEN_TYPE, tokens), fingerprint, parent)

    def _measure(self) -> int:
        """Bytes of what it holds itself; a string its parent holds too is its parent's."""
        up = self.parent
        size = BOOKKEEPING_BYTES + sum(map(sys.getsizeof, (
            self, self.id, self.owner, self.body, self.input_items, self.messages, self.text,
            self.tokens)))
        if self.instructions is not None and (up is None
                                              or self.instructions is not up.instructions):
            size += sys.getsizeof(self.instructions)
        if up is None or self.tools_text is not up.tools_text:
            size += sys.getsizeof(self.tools_text)
        return size

    def chain(self) -> list[StoredResponse]:
        """The conversation's stored turns, the first first and this one last."""
        turns, turn = [], self
        while turn is not None:
            turns.append(turn)
            turn = turn.parent
        return turns[::-1]

    def all_tokens(self) -> list[int]:
        tokens: list[int] = []
        for turn in self.chain():
            tokens.extend(turn.tokens)
        return tokens

    def all_text(self) -> str:
        return "".join(turn.text for turn in self.chain())

    def conversation(self) -> list[Message]:
        """The conversation as chat messages, this response's answer last."""
        return [m for turn in self.chain() for m in _MESSAGES.validate_json(turn.messages)]

    def listed_items(self) -> list[dict]:
        return orjson.loads(self.input_items)

    def to_json(self, whole: bool = True) -> dict:
        """What Redis keeps of it: the whole conversation, for another replica may know no
        parent (`whole`); or, for the --cache-dir file, its own part, its parent written
        before it."""
        turns = self.chain() if whole else [self]
        return {"id": self.id, "owner": self.owner, "body": orjson.Fragment(self.body),
                "input_items": orjson.Fragment(self.input_items),
                "messages": orjson.Fragment(_joined([t.messages for t in turns])),
                "instructions": self.instructions, "tools_text": self.tools_text,
                "text": "".join(t.text for t in turns),
                "tokens": [token for t in turns for token in t.tokens],
                "fingerprint": self.fingerprint, "created": self.created}

    @classmethod
    def from_json(cls, data: dict, parent: StoredResponse | None = None) -> StoredResponse:
        """Raises ValueError, KeyError, TypeError or ValidationError for what is not one."""
        messages = _json(data["messages"])
        _MESSAGES.validate_json(messages)
        if not all(isinstance(data[name], str) for name in ("id", "owner", "text",
                                                             "fingerprint")):
            raise TypeError("id, owner, text and fingerprint are strings")
        instructions, tools_text = data["instructions"], data["tools_text"]
        if parent is not None:  # one string for the whole chain, as `make` keeps them
            instructions = parent.instructions if instructions == parent.instructions \
                else instructions
            tools_text = parent.tools_text if tools_text == parent.tools_text else tools_text
        return cls(data["id"], data["owner"], _json(data["body"]),
                   _json(data["input_items"]), messages, instructions, tools_text,
                   data["text"], array(TOKEN_TYPE, data["tokens"]), data["fingerprint"], parent,
                   float(data["created"]))


def _json(value: object) -> bytes:
    """`value` as JSON, in bytes of its own size: orjson's own output keeps the capacity its
    writer grew to (~40% more resident memory for a 10 kB document)."""
    return bytes(memoryview(orjson.dumps(value)))


def _joined(lists: list[bytes]) -> bytes:
    """JSON lists, one after the other, as one list."""
    inner = [items[1:-1] for items in lists if items != b"[]"]
    return b"[" + b",".join(inner) + b"]"


class ResponseStore:
    def __init__(self, max_bytes: int, max_age_seconds: float,
                 tenant_share: float = 1.0) -> None:
        self.max_bytes = max_bytes
        self.max_age = max_age_seconds
        self.tenant_quota = tenant_share * max_bytes  # past it a tenant makes room from its own
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # listed, oldest first
        self._by_owner: dict[str, OrderedDict[str, StoredResponse]] = {}  # the same, by owner
        self._owner_bytes: dict[str, int] = {}  # listed or kept as a listed one's history
        self._bytes = 0
        self._lock = threading.Lock()  # stores happen on the event loop, reads on threads too
        self.evictions = 0

    def put(self, entry: StoredResponse) -> None:
        with self._lock:
            if entry.id in self._entries:
                self._unlist(self._entries[entry.id])
            self._entries[entry.id] = entry
            self._by_owner.setdefault(entry.owner, OrderedDict())[entry.id] = entry
            self._hold(entry)
            self._trim(entry.owner)

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The response, if it is this tenant's and still kept."""
        with self._lock:
            self._trim()
            entry = self._entries.get(response_id)
            if entry is None or entry.owner != owner:
                return None
            # The trim looks at the oldest stored; one stored late with an old age (read back
            # from disk, say) is checked here.
            return entry if entry.created >= time.time() - self.max_age else None

    def delete(self, response_id: str, owner: str) -> bool:
        """Unlists it; its data stays while a kept later turn needs it as history."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None or entry.owner != owner:
                return False
            self._unlist(entry)
            return True

    def save(self, directory: Path) -> int:
        """Writes every stored response, each turn's own part once; returns how many are
        listed."""
        with self._lock:
            listed = list(self._entries.values())
        places: dict[StoredResponse, int] = {}  # parents before their children
        for entry in listed:
            unseen = [turn for turn in entry.chain() if turn not in places]
            for turn in unseen:
                places[turn] = len(places)
        listed_now = set(listed)
        records = [{**turn.to_json(whole=False), "listed": turn in listed_now,
                    "parent": places[turn.parent] if turn.parent else -1} for turn in places]
        with private_file(directory, FILE_NAME) as f:
            f.write(orjson.dumps({"version": VERSION, "responses": records}))
        return len(listed)

    def load(self, directory: Path) -> int:
        """Reads back what `save` wrote; returns how many were
        kept (the store's bounds apply as to any other). A file that does not parse whole is
        refused with a log line."""
        path = directory / FILE_NAME
        if not path.exists():
            return 0
        try:
            data = orjson.loads(path.read_bytes())
            if data.get("version") != VERSION:
                raise ValueError("written by another version")
            turns: list[StoredResponse] = []
            listed = []
            for record in data["responses"]:
                place = record["parent"]
                if not isinstance(place, int) or not -1 <= place < len(turns):
                    raise ValueError("a response's parent comes after it")
                turns.append(StoredResponse.from_json(record,
                                                      turns[place] if place >= 0 else None))
                if record["listed"]:
                    listed.append(turns[-1])
        except (OSError, ValueError, KeyError, TypeError, ValidationError) as exc:
            log.error("not loading the stored responses %s: %s", path, exc)
            return 0
        for entry in listed:  # oldest first, as saved
            self.put(entry)
        return self.stats[0]

    @property
    def stats(self) -> tuple[int, int]:
        """(entries listed, bytes held)."""
        with self._lock:
            return len(self._entries), self._bytes

    def owner_bytes(self, owner: str) -> int:
        with self._lock:
            return self._owner_bytes.get(owner, 0)

    def _trim(self, owner: str | None = None) -> None:
        too_old = time.time() - self.max_age
        while self._entries and next(iter(self._entries.values())).created < too_old:
            self._evict(next(iter(self._entries.values())))
        while self._bytes > self.max_bytes:
            victim = self._victim(owner)
            if victim is None:
                return
            self._evict(victim)

    def _victim(self, owner: str | None) -> StoredResponse | None:
        """The storing tenant's oldest when it is at its share, else the oldest of a tenant
        past its share, else the oldest of all."""
        if owner is not None and self._owner_bytes.get(owner, 0) >= self.tenant_quota \
                and self._by_owner.get(owner):
            return next(iter(self._by_owner[owner].values()))
        over = [next(iter(self._by_owner[o].values())) for o, held in self._owner_bytes.items()
                if held > self.tenant_quota and self._by_owner.get(o)]
        if over:
            return min(over, key=lambda entry: entry.created)
        return next(iter(self._entries.values()), None)

    def _evict(self, entry: StoredResponse) -> None:
        self._unlist(entry)
        self.evictions += 1

    def _unlist(self, entry: StoredResponse) -> None:
        del self._entries[entry.id]
        mine = self._by_owner[entry.owner]
        del mine[entry.id]
        if not mine:
            del self._by_owner[entry.owner]
        self._release(entry)

    def _hold(self, entry: StoredResponse | None) -> None:
        """One more reference to `entry`; one held for the first time (a parent read from
        Redis, or evicted while its child was being answered) is counted, and holds its own
        parent in turn."""
        while entry is not None:
            entry.refs += 1
            if entry.refs > 1:
                return
            self._count(entry, entry.size)
            entry = entry.parent

    def _release(self, entry: StoredResponse | None) -> None:
        while entry is not None:
            entry.refs -= 1
            if entry.refs:
                return
            self._count(entry, -entry.size)
            entry = entry.parent

    def _count(self, entry: StoredResponse, size: int) -> None:
        self._bytes += size
        held = self._owner_bytes.get(entry.owner, 0) + size
        if held:
            self._owner_bytes[entry.owner] = held
        else:
            self._owner_bytes.pop(entry.owner, None)
