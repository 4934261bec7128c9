"""The cache index's operations at scale (no model, no block bytes: the index alone).

    python -m loadtest.cache_ops [--blocks 100000] [--pins 5000] [--held 64]

Fills a pool of N blocks with prompts of 64 blocks (16 tokens each), pins the oldest of them
(`--pins` blocks, pinned first so that they sit at the head of the LRU order) and holds
`--held` prompts as live leases, then times the calls a worker makes under the index's lock:
matching a cached prompt, matching an unknown one, planning and committing the store of a new
prompt into the full pool (which evicts 64 blocks), and pinning a prompt again."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from cache.index import CacheIndex

BLOCK = 16
BLOCKS_PER_PROMPT = 64
NAMESPACE = "tenant"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--blocks", type=int, default=100_000)
    p.add_argument("--pins", type=int, default=5_000)
    p.add_argument("--held", type=int, default=64)
    args = p.parse_args()
    index = CacheIndex(args.blocks, BLOCK, pin_budget=args.pins)
    rng = np.random.default_rng(0)
    n_prompts = args.blocks // BLOCKS_PER_PROMPT
    prompts = rng.integers(0, 49152, (n_prompts + 400, BLOCKS_PER_PROMPT * BLOCK), np.int32)

    def store(tokens: np.ndarray) -> None:
        plan = index.plan_store(0, tokens, NAMESPACE, final=True, hold=False)
        index.commit_store(plan.plan_id, written=True)

    start = time.perf_counter()
    for prompt in prompts[:n_prompts]:
        store(prompt)
    rows = [("store a 1,024-token prompt into free slots", (time.perf_counter() - start)
             / n_prompts)]
    until = time.time() + 3600
    n_pinned_prompts = -(-args.pins // BLOCKS_PER_PROMPT)
    for prompt in prompts[:n_pinned_prompts]:
        index.pin(prompt, NAMESPACE, until)
    for prompt in prompts[n_prompts - args.held: n_prompts]:
        index.match(1, prompt, NAMESPACE)  # live sequences: never released here

    def timed(label: str, call: Callable[[np.ndarray], object], items: np.ndarray) -> None:
        start = time.perf_counter()
        for item in items:
            call(item)
        rows.append((label, (time.perf_counter() - start) / len(items)))

    def match(tokens: np.ndarray) -> None:
        index.release(index.match(0, tokens, NAMESPACE).lease_id)

    unpinned = np.arange(n_pinned_prompts, n_prompts - args.held)
    timed("match a cached 1,024-token prompt", match, prompts[rng.choice(unpinned, 200)])
    timed("match an unknown 1,024-token prompt", match, prompts[n_prompts:n_prompts + 200])
    timed("plan + commit a new prompt in the full pool (evicts 64 blocks)", store,
          prompts[n_prompts:])
    timed("pin a pinned 1,024-token prompt again",
          lambda t: index.pin(t, NAMESPACE, until + 1), prompts[:min(200, n_pinned_prompts)])
    snap = index.snapshot()
    print(f"{snap.blocks_used:,} cached blocks of {BLOCK} tokens in a pool of {args.blocks:,}; "
          f"{snap.blocks_pinned:,} pinned, {snap.blocks_held:,} held, "
          f"{snap.evictions:,} evicted")
    print("| operation | time per call (ms) |")
    print("|---|---:|")
    for label, seconds in rows:
        print(f"| {label} | {seconds * 1000:.3f} |")


if __name__ == "__main__":
    main()
