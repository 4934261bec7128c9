"""The gateway with a probe on its event loop, for loadtest/store_stall.py: a task wakes every
PERIOD and notes how late it woke, which is how long something held the loop (or the machine
did not run it). A thread appends each wake-up later than NOTED, as `<time.perf_counter()>
<seconds late>` lines, to the file PREFIXGATE_LOOP_PROBE names (perf_counter is the machine's
monotonic clock, which the load generator reads too).

    PYTHONPATH=loadtest/probe PREFIXGATE_LOOP_PROBE=FILE python -m prefixgate_loop_probe ARGS

Started from the checkout under test (its working directory), it runs that checkout's gateway,
whatever its age: the figures before a change too. Not a package module for that reason.
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
import time

PERIOD = 0.002  # seconds between wake-ups
NOTED = 0.001  # seconds late worth a line

_late: collections.deque[tuple[float, float]] = collections.deque()
_tasks: list[asyncio.Task] = []


async def _probe() -> None:
    while True:
        start = time.perf_counter()
        await asyncio.sleep(PERIOD)
        now = time.perf_counter()
        if now - start - PERIOD > NOTED:
            _late.append((now, now - start - PERIOD))


def _write(path: str) -> None:
    with open(path, "a") as out:
        while True:
            time.sleep(0.2)
            while _late:
                at, late = _late.popleft()
                out.write(f"{at:.6f} {late:.6f}\n")
            out.flush()


class _Probed(asyncio.DefaultEventLoopPolicy):
    """The first event loop made (the server's) gets the probe."""

    probed = False

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        loop = super().new_event_loop()
        if not _Probed.probed:
            _Probed.probed = True
            loop.call_soon(lambda: _tasks.append(loop.create_task(_probe())))
        return loop


if __name__ == "__main__":  # not when a spawned worker process imports it
    threading.Thread(target=_write, args=(os.environ["PREFIXGATE_LOOP_PROBE"],),
                     name="loop-probe", daemon=True).start()
    asyncio.set_event_loop_policy(_Probed())
    from gateway.cli import main

    main()
