"""prompt_cache_key affinity: requests that name one key go to the worker that served it last,
so that their shared prefix stays in one worker's cells. Keys are a tenant's own: the same
string from two tenants names two things (and must not tell one where the other's ran)."""

from __future__ import annotations

from collections import OrderedDict

KEY_OWNERS = 10_000  # keys remembered, least recently used forgotten first


class CacheKeyAffinity:
    def __init__(self, capacity: int = KEY_OWNERS) -> None:
        self._owners: OrderedDict[tuple[str, str], int] = OrderedDict()  # -> worker id
        self._capacity = capacity
        self.requests = 0  # a count only: keys are unbounded, never a label

    def owner(self, namespace: str, key: str) -> int | None:
        return self._owners.get((namespace, key))

    def record(self, namespace: str, key: str, worker_id: int) -> None:
        self.requests += 1
        self._owners[namespace, key] = worker_id
        self._owners.move_to_end((namespace, key))
        if len(self._owners) > self._capacity:
            self._owners.popitem(last=False)
