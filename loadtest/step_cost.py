"""What a step costs llama.cpp beside other sequences, on a bare context (no server).

    python -m loadtest.step_cost [--repeats 5]

With 8 sequences of 300 cells in one unified F16 pool (flash attention, as the engine runs):
- 7 decodes and a prompt chunk of 16 to 256 tokens, in one llama_decode call or in two (the
  decodes, then the chunk): a call of 64 rows or more computes attention in tiles that skip
  only cells every row of the tile masks (engine/batching.py, FA_TILE_ROWS);
- a 272-token prompt computed in the pool, or in a context of its own with its KV moved in
  after: what the other sequences' cells cost a prompt;
- later turns' chunks of 81 tokens, one to six of them in one call: what packing prompts into
  a step saves a row (engine/batching.py, `_plan_batch`);
- 7 decodes right after another decode call or after a prompt call.

Prints the median of each, in ms, one table per question (docs/scheduler.md).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from engine.config import ContextShape
from engine.llama import Batch, Context, Model
from gateway.workers.model_store import default_model_path

SEQUENCES, CELLS_EACH, DECODES, PROMPT = 8, 300, 7, 272
CHUNKS = (16, 64, 128, 256)
TURN, PACKED = 81, (1, 2, 4, 6)


def pool_context(model: Model, n_ctx: int = 16384) -> Context:
    return Context(model, ContextShape(n_ctx=n_ctx, n_seq_max=SEQUENCES + 1, n_batch=512,
                                       n_threads=2, kv_type="f16", flash_attn=True))


def median_ms(repeats: int, run: Callable[[], float]) -> float:
    return 1000 * float(np.median([run() for _ in range(repeats)]))


class Pool:
    """A context holding SEQUENCES sequences of CELLS_EACH cells; the last one computes the
    prompt chunks, the others decode."""

    def __init__(self, model: Model) -> None:
        self.ctx = pool_context(model)
        self.batch = Batch(512)
        self.rng = np.random.default_rng(0)
        for seq in range(SEQUENCES):
            self.batch.clear()
            self.batch.add(self.tokens(CELLS_EACH), 0, seq, 0)
            self.ctx.decode(self.batch)

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(100, 40000, n).tolist()

    def step(self, chunk: int, calls: int) -> float:
        """Seconds for DECODES decodes and a chunk, in `calls` calls; then undoes them."""
        rows = [([self.tokens(1)[0]], seq) for seq in range(DECODES)]
        prompt = [(self.tokens(chunk), SEQUENCES - 1)] if chunk else []
        return self.timed([rows + prompt] if calls == 1 else [rows, prompt])

    def turns(self, n: int) -> float:
        """Seconds for n sequences' next TURN tokens in one call; then undoes them."""
        return self.timed([[(self.tokens(TURN), seq) for seq in range(n)]])

    def timed(self, calls: list[list[tuple[list[int], int]]]) -> float:
        """Seconds for the calls, each of (tokens, sequence) rows after the sequence's cells;
        then undoes them."""
        started = time.perf_counter()
        for part in calls:
            self.batch.clear()
            for tokens, seq in part:
                self.batch.add(tokens, CELLS_EACH, seq, 1)
            self.ctx.decode(self.batch)
        seconds = time.perf_counter() - started
        for seq in range(SEQUENCES):
            self.ctx.cut(seq, CELLS_EACH)
        return seconds

    def decodes_after(self, prompt_first: bool) -> float:
        """Seconds for DECODES decodes right after a call of a TURN-token chunk or of the same
        decodes; then undoes them."""
        if prompt_first:
            self.turns(1)
        else:
            self.step(0, 1)
        return self.step(0, 1)

    def prompt_in_pool(self) -> float:
        self.batch.clear()
        self.batch.add(self.tokens(PROMPT), 0, SEQUENCES, 1)
        started = time.perf_counter()
        self.ctx.decode(self.batch)
        seconds = time.perf_counter() - started
        self.ctx.forget(SEQUENCES)
        return seconds

    def prompt_apart(self, own: Context) -> tuple[float, float]:
        """(seconds in all, of which moving the KV in) for the prompt computed in `own`."""
        self.batch.clear()
        self.batch.add(self.tokens(PROMPT), 0, 0, 1)
        started = time.perf_counter()
        own.decode(self.batch)
        computed = time.perf_counter()
        self.ctx.load_sequence_state(SEQUENCES, own.sequence_state(0).copy())
        done = time.perf_counter()
        own.forget(0)
        self.ctx.forget(SEQUENCES)
        return done - started, done - computed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    model = Model(str(default_model_path()))
    pool = Pool(model)
    print(f"{SEQUENCES} sequences of {CELLS_EACH} cells in one pool, median of {args.repeats}\n")
    print(f"| {DECODES} decodes and a prompt chunk of | one call | two calls |")
    print("|---|---|---|")
    for chunk in CHUNKS:
        one, two = (median_ms(args.repeats, lambda n=chunk, c=calls: pool.step(n, c))
                    for calls in (1, 2))
        print(f"| {chunk} tokens | {one:.0f} ms | {two:.0f} ms |")
    print(f"\n| {TURN}-token turns in one call | ms a row |")
    print("|---|---|")
    for n in PACKED:
        per_row = median_ms(args.repeats, lambda n=n: pool.turns(n)) / (n * TURN)
        print(f"| {n} | {per_row:.2f} |")
    print(f"\n| {DECODES} decodes right after a call of | ms |")
    print("|---|---|")
    for prompt_first in (False, True):
        what = f"a {TURN}-token chunk" if prompt_first else f"the same {DECODES} decodes"
        ms = median_ms(args.repeats, lambda p=prompt_first: pool.decodes_after(p))
        print(f"| {what} | {ms:.0f} |")
    own = Context(model, ContextShape(n_ctx=1024, n_seq_max=1, n_batch=512, n_threads=2,
                                      kv_type="f16", flash_attn=True))
    apart = [pool.prompt_apart(own) for _ in range(args.repeats)]
    print(f"\n| a {PROMPT}-token prompt | ms |")
    print("|---|---|")
    print(f"| in the pool | {median_ms(args.repeats, pool.prompt_in_pool):.0f} |")
    print(f"| in a context of its own, KV moved in after | "
          f"{1000 * np.median([a[0] for a in apart]):.0f} |")
    print(f"| of which moving the KV in | {1000 * np.median([a[1] for a in apart]):.0f} |")


if __name__ == "__main__":
    main()
