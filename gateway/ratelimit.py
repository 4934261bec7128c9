"""Per-key rate limits: requests and tokens per minute, over a sliding window of 60 s.

A request is admitted when its key has made fewer than `--rate-limit-rpm` requests and spent
fewer than `--rate-limit-tpm` tokens (prompt tokens when admitted, completion tokens when done)
in the last minute; otherwise it gets a 429 with the seconds until that is true again.
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

    def admit(self, key: str, prompt_tokens: int) -> int | None:
        """None when admitted (and charged for its prompt), else the seconds to wait."""
        now = time.monotonic()
        spent = self._window(key, now)
        waits = []
        rpm, tpm = self.limits.requests_per_minute, self.limits.tokens_per_minute
        if rpm:
            requests = [s for s in spent if s.request]
            if len(requests) >= rpm:  # until the oldest that keeps it at the limit expires
                waits.append(requests[len(requests) - rpm].at + WINDOW - now)
        if tpm:
            excess = sum(s.tokens for s in spent) + prompt_tokens - tpm
            for s in spent if excess > 0 else ():
                excess -= s.tokens
                if excess <= 0:
                    waits.append(s.at + WINDOW - now)
                    break
            else:
                if excess > 0:  # more than a minute's tokens in one request
                    waits.append(WINDOW)
        if waits:
            return max(1, math.ceil(max(waits)))
        spent.append(_Spent(now, prompt_tokens, True))
        return None

    def charge(self, key: str, completion_tokens: int) -> None:
        self._window(key, time.monotonic()).append(
            _Spent(time.monotonic(), completion_tokens, False))

    def _window(self, key: str, now: float) -> deque[_Spent]:
        spent = self._windows.setdefault(key, deque())
        while spent and spent[0].at <= now - WINDOW:
            spent.popleft()
        return spent
