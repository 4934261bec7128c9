"""One engine worker process started ahead of need, for the next model to load.

A worker is a fresh Python process (spawned: the gateway is threaded, no fork): its interpreter
and its imports (llama-cpp-python, numpy) take a few tenths of a second before llama.cpp reads
the model, on every load. When models load and unload as they are used (several models and
`--models-max`, `--models-memory-mb` or `--idle-unload-seconds`), one process is kept started
with those imports done, waiting on its connection for the worker it is to be (`engine.process
.run_when_asked`): the next load takes it, and a new one is started once that load is over
and nothing runs (gateway/core/models.py `Models._refill_spare_if_idle`): not during the load,
nor beside the requests it was for, whose cores it would take. Under traffic that never pauses,
a load finds no spare and starts its worker as before. It costs an idle interpreter (~25 MiB PSS).

A spare whose gateway dies sees its connection close and exits."""

from __future__ import annotations

import logging
import threading
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext, SpawnProcess

from engine import process as worker_process

log = logging.getLogger(__name__)


class Spare:
    def __init__(self, context: SpawnContext) -> None:
        self._context = context
        self._lock = threading.Lock()
        self._wanted = False
        self._ready: tuple[SpawnProcess, Connection] | None = None
        self.taken = 0  # workers started from a spare

    def want(self) -> None:
        """From now on a spare is kept (started now, and again after each is taken)."""
        with self._lock:
            self._wanted = True
        self.refill()

    @property
    def missing(self) -> bool:
        """A spare is wanted and none waits (a hint, read without the lock)."""
        ready = self._ready
        return self._wanted and (ready is None or not ready[0].is_alive())

    def refill(self) -> None:
        """Starts a spare if one is wanted and none waits."""
        with self._lock:
            if not self._wanted or (self._ready is not None and self._ready[0].is_alive()):
                return
            ours, theirs = self._context.Pipe(duplex=True)
            process = self._context.Process(target=worker_process.run_when_asked,
                                            args=(theirs,), name="prefixgate-worker-spare",
                                            daemon=True)
            process.start()
            theirs.close()
            self._ready = process, ours
        log.info("started a spare engine worker (pid %d) for the next model to load",
                 process.pid)

    def take(self) -> tuple[SpawnProcess, Connection] | None:
        """The spare, now the caller's (None if there is none alive)."""
        with self._lock:
            ready, self._ready = self._ready, None
        if ready is None:
            return None
        if not ready[0].is_alive():
            ready[1].close()
            return None
        self.taken += 1
        return ready

    def close(self) -> None:
        with self._lock:
            self._wanted = False
            ready, self._ready = self._ready, None
        if ready is not None:
            ready[1].close()  # it reads end of file and exits
            ready[0].join(5)
            if ready[0].is_alive():
                ready[0].kill()
