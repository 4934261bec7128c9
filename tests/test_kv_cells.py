"""The cell ledger against a brute-force model of llama.cpp's cells: every cell an id, every
sequence the set of ids it holds, a cell in use while any sequence holds it."""

from __future__ import annotations

import itertools

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from engine.kv_cells import CellLedger

SEQUENCES = st.integers(0, 4)


class LedgerAgainstCells(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ledger = CellLedger(10_000)
        self.held: dict[int, list[int]] = {}  # sequence -> cell ids by position
        self.ids = itertools.count()

    @rule(seq=SEQUENCES, n=st.integers(1, 20))
    def compute(self, seq: int, n: int) -> None:
        self.ledger.add(seq, n)
        self.held.setdefault(seq, []).extend(next(self.ids) for _ in range(n))

    @rule(src=SEQUENCES, dst=SEQUENCES, data=st.data())
    def share(self, src: int, dst: int, data) -> None:
        if src == dst or self.held.get(dst):
            return
        n = data.draw(st.integers(0, len(self.held.get(src, []))))
        self.ledger.share(src, dst, n)
        self.held[dst] = self.held.get(src, [])[:n]

    @rule(seq=SEQUENCES)
    def forget(self, seq: int) -> None:
        self.ledger.forget(seq)
        self.held.pop(seq, None)

    @invariant()
    def counts_agree(self) -> None:
        assert self.ledger.used == len(set().union(*self.held.values()))
        for seq, cells in self.held.items():
            assert self.ledger.held(seq) == len(cells)


TestLedgerAgainstCells = LedgerAgainstCells.TestCase


def test_shared_prefix_counts_once_and_outlives_its_owner():
    ledger = CellLedger(100)
    ledger.add(0, 40)  # the prompt
    ledger.share(0, 1, 38)
    ledger.add(1, 5)
    ledger.add(0, 3)
    assert ledger.used == 40 + 5 + 3
    ledger.forget(0)  # the donor finishes: its shared part lives on in sequence 1
    assert ledger.used == 38 + 5 and ledger.free == 100 - 43
