"""Radix tree + block pool operations at scale (no model, no block bytes: the index alone).

    python -m loadtest.cache_ops [--blocks 100000]

Fills a pool of N blocks with prompts of 64 blocks (16 tokens each), then times matching cached
prompts, matching unknown ones, and inserting into the full pool (which evicts)."""

from __future__ import annotations

import argparse
import time

import numpy as np

from cache.block_pool import BlockPool
from cache.radix_tree import RadixTree

BLOCK = 16
BLOCKS_PER_PROMPT = 64


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--blocks", type=int, default=100_000)
    args = p.parse_args()
    pool = BlockPool(args.blocks, BLOCK)
    tree = RadixTree(pool)

    def allocate(_start: int, _end: int) -> int | None:
        return tree.allocate()

    rng = np.random.default_rng(0)
    n_prompts = args.blocks // BLOCKS_PER_PROMPT
    prompts = rng.integers(0, 49152, (n_prompts + 200, BLOCKS_PER_PROMPT * BLOCK), np.int32)
    start = time.perf_counter()
    for prompt in prompts[:n_prompts]:
        tree.release(tree.insert(prompt, allocate)[0])
    fill = time.perf_counter() - start
    rows = [("insert 1,024-token prompt (64 new blocks)", fill / n_prompts)]

    def timed(label, fn, items):
        start = time.perf_counter()
        for item in items:
            fn(item)
        rows.append((label, (time.perf_counter() - start) / len(items)))

    timed("match cached 1,024-token prompt", lambda t: tree.release(tree.match(t)),
          prompts[rng.integers(0, n_prompts, 200)])
    timed("match unknown 1,024-token prompt", lambda t: tree.release(tree.match(t)),
          prompts[n_prompts:n_prompts + 200])
    timed("insert into full pool (evicts 64 blocks)",
          lambda t: tree.release(tree.insert(t, allocate)[0]), prompts[n_prompts:])
    print(f"{len(tree):,} cached blocks of {BLOCK} tokens, pool of {pool.n_slots:,} slots")
    print("| operation | time per call (ms) |")
    print("|---|---:|")
    for label, seconds in rows:
        print(f"| {label} | {seconds * 1000:.3f} |")


if __name__ == "__main__":
    main()
