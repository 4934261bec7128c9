"""How many KV cells of a unified llama.cpp context are in use, counting shared cells once.

llama.cpp keeps a cell while any sequence holds it and exposes no count of used cells. The engine
tells this ledger what it does to the context, and the ledger mirrors the cell sets:
- Cells are made in runs: each run is computed (or loaded) by one sequence, its owner, at
  consecutive positions, and only the owner appends to it.
- `share` gives a sequence the first n positions of another, run by run, so every holder of a
  run holds a leading part of it. The run's live cells are the longest part anyone holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class _Run:
    owner: int
    held: dict[int, int] = field(default_factory=dict)  # sequence -> leading cells it holds

    @property
    def size(self) -> int:
        return max(self.held.values(), default=0)


class CellLedger:
    def __init__(self, n_cells: int) -> None:
        self.n_cells = n_cells
        self.used = 0
        self._runs: dict[int, list[_Run]] = {}  # per sequence, in position order

    @property
    def free(self) -> int:
        return self.n_cells - self.used

    def held(self, seq: int) -> int:
        """Positions the sequence holds (all from 0)."""
        return sum(run.held[seq] for run in self._runs.get(seq, []))

    def add(self, seq: int, n: int) -> None:
        """The sequence computed or loaded n new cells after its last one."""
        if n <= 0:
            return
        runs = self._runs.setdefault(seq, [])
        if runs and runs[-1].owner == seq and runs[-1].held[seq] == runs[-1].size:
            run = runs[-1]
        else:
            run = _Run(owner=seq, held={seq: 0})
            runs.append(run)
        self.used += n
        run.held[seq] += n

    def share(self, src: int, dst: int, n: int) -> None:
        """`dst`, holding nothing, now holds the cells of src's first n positions."""
        assert not self._runs.get(dst), "sharing into a sequence that holds cells"
        runs = self._runs[dst] = []
        for run in self._runs.get(src, []):
            if n <= 0:
                break
            take = min(n, run.held[src])
            run.held[dst] = take
            runs.append(run)
            n -= take

    def forget(self, seq: int) -> None:
        for run in self._runs.pop(seq, []):
            before = run.size
            del run.held[seq]
            self.used -= before - run.size
