"""The prefill speed requests see: prompt tokens computed per second of time to first token,
over the last requests that computed enough of their prompt to say (a few tokens measure the
queue and the step, not the prefill). What `POST /v1/cache/explain` predicts a TTFT from."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

MIN_TOKENS = 32  # computed prompt tokens for a request to count
WINDOW = 64  # requests kept: the speed follows the load


@dataclass
class PrefillSpeed:
    _samples: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, computed_tokens: int, seconds: float) -> None:
        if computed_tokens >= MIN_TOKENS and seconds > 0:
            with self._lock:
                self._samples.append((computed_tokens, seconds))

    def tokens_per_second(self) -> float | None:
        """Tokens over seconds, summed (a ratio of sums: one slow request weighs what it
        took); None before any request counted."""
        with self._lock:
            tokens = sum(n for n, _ in self._samples)
            seconds = sum(s for _, s in self._samples)
        return tokens / seconds if seconds else None
