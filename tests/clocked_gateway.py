"""The gateway with a clock its test moves: pins are set and expire by it (SharedPool.clock in
gateway/workers/shared_pool.py), so a pin outlives a flood however long a busy machine takes over
it, and expires when the test moves the clock past it. Only the tests start it (`python -m
tests.clocked_gateway --clock FILE <gateway flags>`); the production entry point (`python -m
gateway`, the image) has no flag, no environment variable and no code that sets the clock.

FILE holds the clock's time in seconds. The clock stands still between the test's moves.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from gateway.cli import main
from gateway.workers.shared_pool import SharedPool
from loadtest.gateway_process import GatewayProcess


class FileClock:
    """The gateway's side: the time FILE holds (read at every look: the test moves it)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self) -> float:
        return float(self.path.read_text())


class TestClock:
    """The test's side: starts at the wall clock's time, moves only by `advance`."""

    __test__ = False  # not a test class, whatever pytest's name rule says

    def __init__(self, path: Path) -> None:
        self.path = path
        self._set(time.time())

    def now(self) -> float:
        return float(self.path.read_text())

    def advance(self, seconds: float) -> None:
        self._set(self.now() + seconds)

    def gateway(self, model_path: Path, *args: str) -> GatewayProcess:
        """The real gateway, with its pins on this clock."""
        return GatewayProcess(model_path, "--clock", str(self.path), *args,
                              module="tests.clocked_gateway")

    def _set(self, seconds: float) -> None:
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(repr(seconds))
        os.replace(partial, self.path)  # the gateway never reads half a number


def run(argv: list[str]) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    p.add_argument("--clock", type=Path, required=True)
    args, rest = p.parse_known_args(argv)
    SharedPool.clock = FileClock(args.clock)
    main(rest)


if __name__ == "__main__":  # not when a spawned worker process imports it
    run(sys.argv[1:])
