"""Turns generated token bytes into text deltas, ending the text at the first stop string.

Text that might be the start of a stop string is held back until the next token decides it, so a
stop string split across tokens is never streamed to the client.
"""

from __future__ import annotations

import codecs


class TextStream:
    def __init__(self, stop: list[str]) -> None:
        self._stop = [s for s in stop if s]
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""
        self.stop_string: str | None = None  # the stop string that ended the text

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def push(self, piece: bytes) -> str:
        """Feed one token's bytes; returns the text that is now safe to emit. After a stop string
        is seen, `stopped` is True and further input is ignored."""
        if self.stopped:
            return ""
        text = self._held + self._decoder.decode(piece)
        found = [(i, s) for s in self._stop if (i := text.find(s)) >= 0]
        if found:
            cut, self.stop_string = min(found, key=lambda hit: hit[0])
            self._held = ""
            return text[:cut]
        keep = self._longest_stop_prefix_suffix(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The held-back text, once generation has ended for another reason."""
        if self.stopped:
            return ""
        text = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return text

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        best = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best
