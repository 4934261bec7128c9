"""Turns generated token bytes into text deltas, ending the text at the first stop string.

Text that might be the start of a stop string is held back until the next token decides it, so a
stop string split across tokens is never streamed to the client.

The stop strings are matched by one automaton over all of them (Aho-Corasick), fed each
character once: a token costs the same whatever the number or length of the stop strings, so a
request carrying many cannot slow the engine thread that every stream shares.
"""

from __future__ import annotations

import codecs
from collections import deque


class StopMatcher:
    """Aho-Corasick over the stop strings. A state is a prefix of some stop string: the longest
    one the text read so far ends with, so its length is how much text must be held back."""

    def __init__(self, stops: list[str]) -> None:
        self._next: list[dict[str, int]] = [{}]  # state -> character -> state
        self.depth = [0]  # state -> length of its prefix
        self._found: list[str | None] = [None]  # the longest stop string a state ends with
        for stop in stops:
            state = 0
            for char in stop:
                if char not in self._next[state]:
                    self._next[state][char] = len(self._next)
                    self._next.append({})
                    self.depth.append(self.depth[state] + 1)
                    self._found.append(None)
                state = self._next[state][char]
            if self._found[state] is None:  # a duplicate keeps the first's place
                self._found[state] = stop
        self._fail = [0] * len(self._next)
        queue = deque(self._next[0].values())
        while queue:  # breadth first: a state's fallback is shallower, so already complete
            state = queue.popleft()
            for char, child in self._next[state].items():
                fallback = self._fail[state]
                while fallback and char not in self._next[fallback]:
                    fallback = self._fail[fallback]
                self._fail[child] = self._next[fallback].get(char, 0)
                if self._found[child] is None:  # a shorter stop string ending here
                    self._found[child] = self._found[self._fail[child]]
                queue.append(child)

    def step(self, state: int, char: str) -> int:
        while state and char not in self._next[state]:
            state = self._fail[state]
        return self._next[state].get(char, 0)

    def found(self, state: int) -> str | None:
        return self._found[state]


class TextStream:
    def __init__(self, stop: list[str]) -> None:
        self._matcher = StopMatcher([s for s in stop if s])
        self._state = 0  # the matcher's; its depth is the length of `_held`
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""
        self.stop_string: str | None = None  # the stop string that ended the text

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def push(self, piece: bytes) -> str:
        """Feed one token's bytes; returns the text that is now safe to emit. After a stop string
        is seen, `stopped` is True and further input is ignored. Of several stop strings in one
        piece, the one that starts first ends the text."""
        if self.stopped:
            return ""
        text = self._held + self._decoder.decode(piece)
        cut = None
        for i in range(len(self._held), len(text)):
            self._state = self._matcher.step(self._state, text[i])
            stop = self._matcher.found(self._state)
            if stop is not None and (cut is None or i + 1 - len(stop) < cut):
                cut, self.stop_string = i + 1 - len(stop), stop
        if cut is not None:
            self._held = ""
            return text[:cut]
        keep = self._matcher.depth[self._state]
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The held-back text, once generation has ended for another reason."""
        if self.stopped:
            return ""
        text = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return text
