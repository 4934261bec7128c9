"""The engine worker started ahead for the next model load (gateway/workers/spare.py): what
it becomes once taken, what happens to it when it dies first or is not needed."""

from __future__ import annotations

import asyncio
import multiprocessing

from engine.config import EngineConfig
from gateway.config import WorkersConfig
from gateway.workers.spare import Spare
from gateway.workers.supervisor import Workers


def workers_of(spare: Spare) -> Workers:
    """A supervisor of a model that is not there: its worker starts, then exits."""
    workers = Workers(WorkersConfig(model_path="missing.gguf", engine=EngineConfig()), spare)
    workers._loop = asyncio.new_event_loop()  # where its reader tells of the exit (not run)
    workers._stopping = True  # and no replacement
    return workers


def test_a_spare_becomes_the_worker_it_is_told_to_be_and_another_is_started_after():
    spare = Spare(multiprocessing.get_context("spawn"))
    spare.want()
    first = spare._ready[0]
    worker = workers_of(spare)._spawn(0)
    try:
        assert worker.process is first and spare.taken == 1 and spare._ready is None
        worker.process.join(60)  # it ran as the worker of a model that is not there
        assert worker.process.exitcode not in (None, 0)
        spare.refill()
        assert spare._ready is not None and spare._ready[0] is not first
    finally:
        spare.close()
    assert spare._ready is None


def test_a_spare_that_died_is_replaced_by_a_process_of_its_own():
    spare = Spare(multiprocessing.get_context("spawn"))
    spare.want()
    process, connection = spare._ready
    process.kill()
    process.join(10)
    taken = (process, connection)
    spare.take = lambda: taken  # it died between take() and being told what to be
    worker = workers_of(spare)._spawn(0)
    try:
        assert worker.process is not process and worker.process.pid != process.pid
        worker.process.join(60)
    finally:
        spare.close()


def test_an_unneeded_spare_exits_when_its_connection_closes():
    spare = Spare(multiprocessing.get_context("spawn"))
    spare.want()
    process = spare._ready[0]
    spare.close()
    assert not process.is_alive() and process.exitcode == 0
