"""Stored responses (`store`, true by default on /v1/responses): what GET, DELETE and
`input_items` read, and what `previous_response_id` continues from.

A response belongs to its tenant, the owner of the key that made it (another key, even one whose
prefixes share a cache namespace with it, never sees it; without keys there is one anonymous
owner), and is kept with the conversation as
chat messages up to and including its own answer, and the exact tokens its sequence held: its
prompt's and the ones it generated, with the text they render as. A turn that continues it with
the same instructions and tools starts from those very tokens, so its whole history loads from
the prefix cache instead of being rendered and tokenized again (which may tokenize an answer
differently from how it was generated).

Bounded by entries' total size and age (--response-store-mb, --response-store-hours): the
oldest go first. With --cache-dir they are written there at shutdown (owner-only, as the prefix
cache's snapshot: they hold whole conversations) and read back at start, if they were made with
this very model (its GGUF fingerprint: their token ids mean nothing to another). Another
replica does not know them (not in Redis yet).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from pydantic import ValidationError

from cache.persistence import private_file
from gateway.protocol import Message

log = logging.getLogger(__name__)

FILE_NAME = "responses.json"
VERSION = 2  # 1 kept the cache namespace, which tenants of a shared group have alike


@dataclass
class StoredResponse:
    id: str
    owner: str  # the tenant whose key made it ("" without keys): the only one who sees it
    body: dict  # the response object, as it was returned
    input_items: list[dict]  # this turn's input, each with its id
    messages: list[Message]  # the conversation, with this response's answer last
    instructions: str | None
    tools_text: str  # what the tools rendered as: a continuation with other tools re-renders
    text: str  # the prompt's rendered text and the answer's, which `tokens` hold
    tokens: list[int]
    created: float = field(default_factory=time.time)

    def to_json(self) -> dict:
        return {"id": self.id, "owner": self.owner, "body": self.body,
                "input_items": self.input_items,
                "messages": [m.model_dump(exclude_none=True) for m in self.messages],
                "instructions": self.instructions, "tools_text": self.tools_text,
                "text": self.text, "tokens": self.tokens, "created": self.created}

    @classmethod
    def from_json(cls, data: dict) -> StoredResponse:
        messages = [Message.model_validate_json(orjson.dumps(m)) for m in data["messages"]]
        return cls(**{**data, "messages": messages})

    @property
    def size(self) -> int:
        """Bytes it holds, roughly: its texts and 4 per token id."""
        return sys.getsizeof(self.text) + 4 * len(self.tokens) + len(repr(self.body)) \
            + len(repr(self.input_items)) + sum(len(m.text()) for m in self.messages)


class ResponseStore:
    def __init__(self, max_bytes: int, max_age_seconds: float) -> None:
        self.max_bytes = max_bytes
        self.max_age = max_age_seconds
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self._sizes: dict[str, int] = {}
        self._bytes = 0
        self._lock = threading.Lock()  # stores happen on the event loop, reads on threads too
        self.evictions = 0

    def put(self, entry: StoredResponse) -> None:
        with self._lock:
            self._entries[entry.id] = entry
            self._sizes[entry.id] = entry.size
            self._bytes += self._sizes[entry.id]
            self._trim()

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
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None or entry.owner != owner:
                return False
            self._forget(entry)
            return True

    def save(self, directory: Path, fingerprint: str) -> int:
        """Writes every stored response; returns how many."""
        with self._lock:
            entries = list(self._entries.values())
        with private_file(directory, FILE_NAME) as f:
            f.write(orjson.dumps({"version": VERSION, "fingerprint": fingerprint,
                                  "responses": [e.to_json() for e in entries]}))
        return len(entries)

    def load(self, directory: Path, fingerprint: str) -> int:
        """Reads back what `save` wrote, if this model wrote it; returns how many were
        kept (the store's bounds apply as to any other). A file that does not parse whole is
        refused with a log line."""
        path = directory / FILE_NAME
        if not path.exists():
            return 0
        try:
            data = orjson.loads(path.read_bytes())
            if data.get("version") != VERSION or data.get("fingerprint") != fingerprint:
                raise ValueError("written by another version or for another model")
            entries = [StoredResponse.from_json(e) for e in data["responses"]]
        except (OSError, ValueError, KeyError, TypeError, ValidationError) as exc:
            log.error("not loading the stored responses %s: %s", path, exc)
            return 0
        for entry in entries:  # oldest first, as saved
            self.put(entry)
        return self.stats[0]

    @property
    def stats(self) -> tuple[int, int]:
        """(entries, bytes)."""
        with self._lock:
            return len(self._entries), self._bytes

    def _trim(self) -> None:
        too_old = time.time() - self.max_age
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if self._bytes <= self.max_bytes and oldest.created >= too_old:
                return
            self._forget(oldest)
            self.evictions += 1

    def _forget(self, entry: StoredResponse) -> None:
        del self._entries[entry.id]
        self._bytes -= self._sizes.pop(entry.id)
