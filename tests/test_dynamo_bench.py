"""loadtest.dynamo_bench without its servers (a run takes ~20 minutes): the workload every
configuration gets, and the targets' verdicts."""

from __future__ import annotations

from collections import defaultdict

import pytest

from engine.llama import Model
from loadtest.dynamo_bench import NODES, TENANTS, Measured, Sizes, verdicts, workload
from loadtest.stats import RequestRecord

SIZES = Sizes(system_tokens=40, turn_tokens=8)


@pytest.fixture(scope="module")
def model(model_path) -> Model:
    model = Model(str(model_path), vocab_only=True)
    yield model
    model.close()


def test_the_workload_is_seeded_and_each_session_grows_turn_by_turn(model):
    turns = workload(model, SIZES)
    assert turns == workload(model, SIZES)
    assert len(turns) == SIZES.sessions * SIZES.turns
    last: dict[int, tuple[dict, ...]] = {}
    for turn in turns:  # each turn resends the session's history, its new message last
        before = last.get(turn.session, turn.messages[:1])  # the first: the system prompt
        assert turn.messages[:len(before)] == before and turn.messages[-1]["role"] == "user"
        assert len(turn.messages) == len(before) + (2 if turn.session in last else 1)
        last[turn.session] = turn.messages
    # Both tenants take every system prompt: the same text in two namespaces.
    systems = defaultdict(set)
    for turn in turns:
        systems[turn.messages[0]["content"]].add(turn.tenant)
    assert len(systems) == SIZES.systems and all(t == set(TENANTS) for t in systems.values())


def test_a_round_robin_sends_a_sessions_next_turn_elsewhere(model):
    """Sessions interleave at random: request i going to node i % 3, most of a session's
    turns land on another node than its turn before (in a fixed order they could all stay)."""
    turns = workload(model, SIZES)
    node: dict[int, int] = {}
    moved = stayed = 0
    for i, turn in enumerate(turns):
        if turn.session in node:
            moved += node[turn.session] != i % NODES
            stayed += node[turn.session] == i % NODES
        node[turn.session] = i % NODES
    assert moved > 1.5 * stayed


def measured(name: str, computed: float, ttft: float, redis: tuple[int, int] | None = None
             ) -> Measured:
    record = RequestRecord(start=0.0, chunk_times=[ttft], prompt_tokens=100)
    return Measured(name, [record], [computed], *(redis or (None, None)))


def test_the_verdicts_say_met_or_missed_and_by_how_much():
    results = [measured("one node", 100, 1.0), measured("(a) front", 110, 0.4, (90, 10)),
               measured("(b) dynamo kv", 120, 0.6), measured("(c) dynamo rr", 300, 1.0),
               measured("(d) replicas", 105, 0.8, (100, 900))]
    assert verdicts(results, 100) == [
        "- (a) prompt tokens computed / one node's: 1.10x (target <= 1.15x): met",
        "- (a) TTFT p50 / (c)'s: 0.40x (target <= 0.5x): met",
        "- (b) prompt tokens computed / one node's: 1.20x (target <= 1.15x): MISSED",
        "- (b) TTFT p50 / (c)'s: 0.60x (target <= 0.5x): MISSED",
        "- (a) bytes through Redis / (d)'s: 0.10x (target <= 0.1x): met",
        "- of which read (Redis out): (a) / (d) = 0.01x"]
