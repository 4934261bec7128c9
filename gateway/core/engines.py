"""Who runs a planned generation: the seam between the one generation path (generation.py) and
the engines. Two implementations: the engine worker processes of this machine
(gateway/workers/supervisor.py `Workers`), and, in a front with no engine of its own, the
prefixgate nodes of a Dynamo deployment behind its KV router (gateway/dynamo/front.py)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

import numpy as np

from engine.messages import GenerationRequest

if TYPE_CHECKING:
    from gateway.formats.prompts import Pin
    from gateway.workers.handles import GenerationHandle
    from gateway.workers.shared_pool import SharedPool, TierHits
    from gateway.workers.supervisor import WorkerView


class Engines(Protocol):
    pool: SharedPool | None  # this process's block pool; None: none here
    seq_len: int  # tokens one request may hold

    @property
    def n_in_flight(self) -> int: ...

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """On a thread of its own; returns once a request can be served, or raises why not."""

    def submit_group(self, requests: list[GenerationRequest], cache_key: str | None = None,
                     pool_cached: int | None = None, pins: tuple[Pin, ...] = ()
                     ) -> list[GenerationHandle]:
        """Requests on one prompt (a request's n choices). `pins`: for an engine whose pool is
        not this process's (the caller pins `pool` itself). Raises Overloaded (a 429) or
        EngineUnavailable (a 503)."""

    def live_match(self, prompt: np.ndarray, namespace: str) -> tuple[int, np.ndarray | None]:
        """The longest prefix of `prompt` a request in flight here holds, and its prompt."""

    async def drain(self, seconds: float) -> None: ...

    def stop(self) -> None: ...

    def states(self) -> list[dict]:
        """What /health lists: each engine (a worker, a node) with its `state`."""

    def views(self) -> list[WorkerView]: ...

    def tier_hits(self) -> TierHits: ...

    def problems(self) -> list[str]: ...
