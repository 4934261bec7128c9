"""The front's moves of a request to another node (gateway/dynamo/front.py `_serve`), against a
scripted stand-in for Dynamo's KvRouter: which node each attempt goes to, and what the client's
handles receive. tests/test_dynamo_retry.py runs the same with real nodes and real Dynamo."""

from __future__ import annotations

import asyncio

import pytest

from engine.messages import GenerationRequest, Output, Usage
from gateway.dynamo import codec
from gateway.dynamo.front import MAX_RETRIES, DynamoFront
from gateway.dynamo.requests import PLANNED
from gateway.dynamo.settings import DynamoSettings

DONE = Output(text="hi", finish_reason="stop", usage=Usage(3, 1))
FULL = Output(error="The server is at capacity (1 requests in flight, room for 1)",
              refused=True)


class Nodes:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def instance_ids(self) -> list[int]:
        return self.ids


class Router:
    """What each node does with each request sent to it, in turn (the last again once they
    run out): a list of outputs to stream, "wait" (send nothing until cancelled), or an
    exception to raise."""

    def __init__(self, scripts: dict[int, list], best: int = 1, loads_fail: bool = False
                 ) -> None:
        self.scripts, self.best, self.loads_fail = scripts, best, loads_fail
        self.sent: list[int] = []
        self.dropped: list[int] = []  # streams cancelled before their end

    async def best_worker(self, tokens, cache_namespace=None):
        return self.best, 0, 0

    async def get_potential_loads(self, tokens, cache_namespace=None):
        if self.loads_fail:
            raise RuntimeError("no loads")
        return [{"worker_id": n, "potential_prefill_tokens": 16 * n, "potential_decode_blocks": 0}
                for n in self.scripts]

    async def generate_from_request(self, request, response_buffer_size=100):
        node = request["routing"]["backend_instance_id"]
        calls = self.scripts[node]
        script = calls[min(self.sent.count(node), len(calls) - 1)]
        self.sent.append(node)
        return self._stream(node, script)

    async def _stream(self, node: int, script):
        try:
            if script == "wait":
                await asyncio.Event().wait()
            if isinstance(script, Exception):
                raise script
            for output in script:
                if isinstance(output, Exception):
                    raise output
                yield {"extra_args": {PLANNED: codec.encode(output)}}
        except asyncio.CancelledError:
            self.dropped.append(node)
            raise


def serve(router: Router, n: int = 1) -> list[list[Output]]:
    """A request of `n` choices through a front over `router`: each choice's outputs."""

    async def run():
        front = DynamoFront(DynamoSettings(), "model")
        front._loop, front._router, front.block_size = asyncio.get_running_loop(), router, 16
        front._nodes = Nodes(list(router.scripts))
        generation = GenerationRequest(prompt_tokens=[1, 2, 3], max_tokens=4)
        return [[o async for o in handle.outputs()]
                for handle in front.submit_group([generation] * n)]

    return asyncio.run(asyncio.wait_for(run(), 30))


def test_a_refused_request_goes_to_the_other_node():
    router = Router({1: [[FULL]], 2: [[DONE]]})
    assert serve(router) == [[DONE]] and router.sent == [1, 2]


def test_a_request_that_has_streamed_never_moves():
    from dynamo.llm.exceptions import Disconnected

    partial = Output(text="h")
    router = Router({1: [[partial, Disconnected("gone")]], 2: [[DONE]]})
    (outputs,) = serve(router)
    assert router.sent == [1]
    assert outputs[0] == partial and outputs[1].error and outputs[1].unavailable


def test_a_node_that_cannot_be_reached_is_left_for_another():
    router = Router({1: [ValueError("Unavailable: Stream ended before generation completed")],
                     2: [[DONE]]})
    assert serve(router) == [[DONE]] and router.sent == [1, 2]


def test_a_node_s_own_failure_is_answered_not_moved():
    router = Router({1: [[Output(error="generation failed")]], 2: [[DONE]]})
    (outputs,) = serve(router)
    assert router.sent == [1] and outputs[0].error == "generation failed"
    assert not outputs[0].unavailable and not outputs[0].refused


def test_a_group_moves_whole():
    """One choice waits on node 1, the other is refused there: both go to node 2, and the
    waiting one is dropped on node 1."""
    router = Router({1: ["wait", [FULL]], 2: [[DONE]]})
    assert serve(router, n=2) == [[DONE], [DONE]]
    assert sorted(router.sent) == [1, 1, 2, 2] and router.dropped == [1]


@pytest.mark.parametrize("loads_fail", [False, True])
def test_when_every_node_refuses_the_refusal_is_the_answer(loads_fail):
    """Each node is tried once, at most MAX_RETRIES others (or, when the router cannot weigh
    the others, the first only), and the last refusal is the client's 429."""
    router = Router({n: [[FULL]] for n in range(1, MAX_RETRIES + 3)}, loads_fail=loads_fail)
    assert serve(router) == [[FULL]]
    assert router.sent == ([1] if loads_fail else list(range(1, MAX_RETRIES + 2)))
