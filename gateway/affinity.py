"""prompt_cache_key affinity: requests that name one key go to the worker that served it last,
so that their shared prefix stays in one worker's cells."""

from __future__ import annotations

from collections import OrderedDict

KEY_OWNERS = 10_000  # keys remembered, least recently used forgotten first


class CacheKeyAffinity:
    def __init__(self, capacity: int = KEY_OWNERS) -> None:
        self._owners: OrderedDict[str, int] = OrderedDict()  # key -> worker id
        self._capacity = capacity
        self.requests = 0  # a count only: keys are unbounded, never a label

    def owner(self, key: str) -> int | None:
        return self._owners.get(key)

    def record(self, key: str, worker_id: int) -> None:
        self.requests += 1
        self._owners[key] = worker_id
        self._owners.move_to_end(key)
        if len(self._owners) > self._capacity:
            self._owners.popitem(last=False)
