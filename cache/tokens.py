"""Token sequences: how much two share, and how much of a prompt may come from a cache."""

from __future__ import annotations

import numpy as np

# A new prompt keeps its last two tokens to compute: llama.cpp's CPU matmuls take another kernel
# for a one-token batch (sgemm serves two or more), so a one-token tail would round differently
# from the prompt computed whole.
COMPUTED_TAIL = 2


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens `a` and `b` share (one vectorised comparison)."""
    n = min(len(a), len(b))
    differs = np.flatnonzero(a[:n] != b[:n])
    return int(differs[0]) if len(differs) else n


def reusable_prompt(prompt: np.ndarray) -> np.ndarray:
    """The part of a new prompt whose KV may be loaded or shared instead of computed."""
    return prompt[:-COMPUTED_TAIL]
