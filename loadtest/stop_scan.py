"""What matching stop strings costs the engine thread per generated token, by how many a
request carries (engine/textstream.py).

    python -m loadtest.stop_scan

A 2,000-token answer of ordinary text (pieces of 1-6 bytes, as a tokenizer's) is fed through a
TextStream holding N stop strings that never match (N up to 10,000, past the API's bound of
gateway/core/bounds.py: the scan is the same however many there are). Printed: microseconds per
token.
"""

from __future__ import annotations

import random
import time

from engine.textstream import TextStream

TOKENS = 2_000
WORDS = ("the", " harbour", " office", " records", " every", " ship", ",", " its", " cargo",
         " and", " crew", ".", "\n")


def per_token_us(n_stops: int, pieces: list[bytes]) -> float:
    stops = [f"<never {i}>" for i in range(n_stops)]
    best = float("inf")
    for _ in range(3):
        stream = TextStream(stops)
        start = time.perf_counter()
        for piece in pieces:
            stream.push(piece)
        best = min(best, time.perf_counter() - start)
    return best / len(pieces) * 1e6


def main() -> None:
    rng = random.Random(0)
    pieces = [rng.choice(WORDS).encode() for _ in range(TOKENS)]
    print("| stop strings | per token (us) |")
    print("|---:|---:|")
    for n in (0, 1, 4, 64, 1_000, 10_000):
        print(f"| {n:,} | {per_token_us(n, pieces):.1f} |")


if __name__ == "__main__":
    main()
