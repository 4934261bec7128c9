"""Per-key rate limits: requests and tokens per minute, over a sliding window of 60 s.

A request is admitted, before any work is done for it, when its key has made fewer than
`--rate-limit-rpm` requests and spent fewer than `--rate-limit-tpm` tokens in the last minute;
its prompt, once tokenized, when its tokens fit too; what it generated is charged when it ends,
finished or not. Otherwise a 429 with the seconds until that is true again.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

WINDOW = 60.0


@dataclass(frozen=True)
class RateLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.requests_per_minute or self.tokens_per_minute)


@dataclass(frozen=True)
class _Spent:
    at: float
    tokens: int
    request: bool  # False: the completion tokens of an admitted request


class RateLimiter:
    """Only ever used on the event loop: no lock."""

    def __init__(self, limits: RateLimits) -> None:
        self.limits = limits
        self._windows: dict[str, deque[_Spent]] = {}

    def admit(self, key: str) -> int | None:
        """Before any work on the request: None when admitted (and counted), else the seconds
        to wait. A key whose tokens of the last minute are spent already waits too."""
        now = time.monotonic()
        spent = self._window(key, now)
        waits = [self._token_wait(spent, 0, now)]
        rpm = self.limits.requests_per_minute
        if rpm:
            requests = [s for s in spent if s.request]
            if len(requests) >= rpm:  # until the oldest that keeps it at the limit expires
                waits.append(requests[len(requests) - rpm].at + WINDOW - now)
        if any(w is not None for w in waits):
            return _seconds(waits)
        spent.append(_Spent(now, 0, True))
        return None

    def admit_prompt(self, key: str, prompt_tokens: int) -> int | None:
        """Once the prompt is tokenized: None when its tokens fit (and are charged)."""
        now = time.monotonic()
        spent = self._window(key, now)
        wait = self._token_wait(spent, prompt_tokens, now)
        if wait is not None:
            return _seconds([wait])
        spent.append(_Spent(now, prompt_tokens, False))
        return None

    def _token_wait(self, spent: deque[_Spent], more: int, now: float) -> float | None:
        """How long until `more` tokens fit in the key's minute; None if they fit now (with
        none more, the budget must not be spent already)."""
        tpm = self.limits.tokens_per_minute
        if not tpm:
            return None
        excess = sum(s.tokens for s in spent) + more - tpm
        if excess < 0 or excess == 0 and more:
            return None
        for s in spent:
            excess -= s.tokens
            if excess < 0 or excess == 0 and more:
                return s.at + WINDOW - now
        return WINDOW  # more than a minute's tokens in one request

    def charge(self, key: str, completion_tokens: int) -> None:
        """What a request generated, whether it finished, timed out or was abandoned."""
        self._window(key, time.monotonic()).append(
            _Spent(time.monotonic(), completion_tokens, False))

    def _window(self, key: str, now: float) -> deque[_Spent]:
        spent = self._windows.setdefault(key, deque())
        while spent and spent[0].at <= now - WINDOW:
            spent.popleft()
        return spent


def _seconds(waits: list[float | None]) -> int:
    return max(1, math.ceil(max(w for w in waits if w is not None)))
