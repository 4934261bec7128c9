"""Token sequences: how much two share, and how much of a prompt may come from a cache."""

from __future__ import annotations

import numpy as np

# A new prompt keeps its last 8 tokens to compute: llama.cpp's CPU matmuls take other kernels
# for small batches (a one-token batch takes vec_dot, where sgemm serves two or more), which
# round differently from the prompt computed whole. On Gemma 3's Q4_K, tails of 2-7 rows did at
# some prompt lengths; from 8 rows (at a multiple of four, below) none of ten lengths did.
COMPUTED_TAIL = 8
# Cached KV is resumed at a multiple of this many positions. llama.cpp's CPU matmuls on repacked
# weights (Q4_K, Q4_0, IQ4_NL: the common quantizations) take a batch's rows four at a time and
# the rows left over one by one, which round differently. A prompt's chunks start at multiples
# of four, so a tail that starts at one too groups its rows as the whole prompt did (Gemma 3's
# Q4_K, with no cache at all: a prompt cut 3 positions off a multiple of four changed the logits
# by 0.7, cut on one by 0.0).
RESUME_ALIGNMENT = 4


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens `a` and `b` share (one vectorised comparison)."""
    n = min(len(a), len(b))
    differs = np.flatnonzero(a[:n] != b[:n])
    return int(differs[0]) if len(differs) else n


def resume_point(n: int) -> int:
    """Where a sequence holding the KV of n positions may take over: n, rounded down."""
    return n - n % RESUME_ALIGNMENT


def most_cached(n_prompt: int) -> int:
    """The most positions of an n-token prompt a cache hit can skip."""
    return resume_point(n_prompt - COMPUTED_TAIL)


def reusable_prompt(prompt: np.ndarray) -> np.ndarray:
    """The part of a new prompt whose KV may be loaded or shared instead of computed."""
    return prompt[:-COMPUTED_TAIL]
