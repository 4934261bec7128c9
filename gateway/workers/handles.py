"""The asyncio side of a request in flight: the queue its outputs arrive on."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from engine.messages import Output


class GenerationHandle:
    """Iterate `outputs()`, call `cancel()` to abandon the request."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_cancel: Callable[[], None]) -> None:
        self._loop = loop
        self._on_cancel = on_cancel
        self._queue: asyncio.Queue[Output] = asyncio.Queue()
        self.cancelled = False
        self.finished = False

    def deliver(self, output: Output) -> None:
        """Called from any thread."""
        deliver_soon(self._loop, [(self, output)])

    def put(self, output: Output) -> None:
        """Called on the event loop."""
        self._queue.put_nowait(output)

    async def outputs(self) -> AsyncIterator[Output]:
        while not self.finished:
            output = await self._queue.get()
            self.finished = output.last
            yield output

    def cancel(self) -> None:
        if not self.finished and not self.cancelled:
            self.cancelled = True
            self._on_cancel()


def deliver_soon(loop: asyncio.AbstractEventLoop,
                 outputs: list[tuple[GenerationHandle, Output]]) -> None:
    """Hands outputs to their requests' queues on the event loop: one wake-up for them all."""
    def put_all() -> None:
        for handle, output in outputs:
            handle.put(output)

    # A closed loop (RuntimeError) means nobody is listening any more.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(put_all)
