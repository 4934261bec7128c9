"""Which KV configuration keeps `--deterministic`'s promise, and how fast is each one?

    python -m loadtest.kernel_invariance [--threads 2] [--only q8-fa-seq f16-seq ...]

The promise: a request's greedy output is the same alone or batched with others, cache on or off,
token for token. For every candidate configuration this measures, in one run:

- prefill tok/s: 1,024 tokens of one sequence, submitted in chunks of 256 (best of two runs;
  with n_ubatch 32, llama.cpp computes each chunk as 8 micro-batches);
- decode tok/s: 8 sequences decoded together for 32 steps (aggregate), and one sequence alone;
- the largest absolute logit difference (0.0 = bitwise identical) of
  (a) chunking: the 1,024 tokens prefilled in chunks of 32, and in ragged chunks (1, 63, 192, ...),
      vs chunks of 256;
  (b) beside 7: sequence 0 decoded beside 7 others (one longer than it) vs alone, with every
      sequence taking logits;
      after churn: the same, but the others came and went first, so that in a unified pool
      sequence 0's cells start past cell 0 and its decoded tokens land in cells freed before its
      prompt's (not in position order); prompts of re-admitted sequences share the decode calls,
      and sequence 1 is missing for the first 5 steps;
      prompts beside decodes: the last logits of those re-admitted prompts (two of 48 tokens,
      one of 530, prefilled 24 a step beside the decodes) vs each prompt prefilled alone;
  (c) restored prefix: 320 tokens serialised (Context.sequence_state), loaded into another
      sequence at other cells, and the rest prefilled after them, vs the cold prefill.

It prints a markdown table; docs/deterministic.md explains each row from the llama.cpp source.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# ggml's barriers are OpenMP barriers, which spin by default: when another process holds one of
# the two cores, every barrier waits a scheduler slice and decoding collapses to ~1 tok/s. Waiting
# passively keeps the speeds comparable on a shared machine. libgomp reads this once, at load.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import llama_cpp as lc
import numpy as np

from engine.config import ContextShape
from engine.llama import Batch, Context, Model
from gateway.workers.model_store import default_model_path

N_SEQ = 8
N_CTX = N_SEQ * 2048  # per-sequence streams get 2,048 cells each
N_BATCH = 512  # EngineConfig.batch_tokens
PROMPT = 1024
CHUNK = 256
RAGGED = (1, 63, 192)  # one token (a decode-shaped call), just under and over the 64-row FA tile
SEQ0_PROMPT = 300  # long enough that sequence 0's decodes see n_kv = 512, the split-KV threshold
STEPS = 32
PREFIX = 320  # five 64-token cache blocks, not a multiple of the 256-token chunk
ADMIT_CHUNK = 24  # prompt tokens an admitted sequence prefills per decode step


@dataclass(frozen=True)
class Candidate:
    key: str
    name: str
    kv_type: str
    flash_attn: bool
    unified: bool
    n_ubatch: int | None = None  # None: n_batch, as in every engine mode
    pad: bool = False  # a lone token gets a dummy token beside it (see Runner._pad_lone_tokens)


CANDIDATES = (
    Candidate("q8-fa-seq", "Q8_0, FA, per-seq streams (today's --deterministic)", "q8_0", True,
              False),
    Candidate("q8-fa-uni", "Q8_0, FA, unified", "q8_0", True, True),
    Candidate("f16-seq", "F16, no FA, per-seq streams", "f16", False, False),
    Candidate("f16-uni", "F16, no FA, unified (default mode)", "f16", False, True),
    Candidate("f16-fa-seq", "F16, FA, per-seq streams", "f16", True, False),
    Candidate("f16-fa-uni", "F16, FA, unified", "f16", True, True),
    # n_ubatch 32 < the 64-row tile (GGML_FA_TILE_Q): no micro-batch takes the tiled kernel.
    Candidate("f16-fa-seq-ub32", "F16, FA, per-seq streams, n_ubatch 32", "f16", True, False, 32),
    # ... and a lone token is padded so that it is not a one-row, one-stream split-KV call.
    Candidate("f16-fa-seq-ub32-pad", "F16, FA, per-seq streams, n_ubatch 32, lone token padded",
              "f16", True, False, 32, True),
)


class Runner:
    """Drives one context: every llama_decode call goes through `call`, which pads lone tokens
    when the candidate asks for it."""

    def __init__(self, model: Model, candidate: Candidate, threads: int) -> None:
        self.ctx = Context(model, ContextShape(
            n_ctx=N_CTX, n_seq_max=N_SEQ, n_batch=N_BATCH, n_threads=threads,
            kv_type=candidate.kv_type, flash_attn=candidate.flash_attn,
            unified=candidate.unified, n_ubatch=candidate.n_ubatch))
        self.pad = candidate.pad
        self.batch = Batch(N_BATCH)

    def call(self, parts: list[tuple[list[int], int, int, bool]]) -> list[int]:
        """One llama_decode of (tokens, first position, seq id, logits for last) parts; returns
        the batch index of each part's last token."""
        self.batch.clear()
        indexes = [self.batch.add(*part) for part in parts]
        pads = self._pad_lone_tokens(parts) if self.pad else []
        self.ctx.decode(self.batch)
        for seq in pads:
            self.ctx.forget(seq)
        return indexes

    def _pad_lone_tokens(self, parts: list[tuple[list[int], int, int, bool]]) -> list[int]:
        """Give every one-token part with no neighbouring sequence in the call a dummy token
        from a free neighbour. With one stream per sequence, split_equal (llama-batch.cpp) puts
        only sequences with consecutive ids in one micro-batch, so such a token would be a
        one-row, one-stream flash attention: the split-KV kernel once n_kv >= 512. (This mirrors
        split_equal for calls ordered as here, decodes by id first; it is not a general rule.)"""
        present = {seq for _, _, seq, _ in parts}
        pads = []
        for tokens, _, seq, _ in parts:
            if len(tokens) > 1 or {seq - 1, seq + 1} & present:
                continue
            pad = seq + 1 if seq + 1 < N_SEQ else seq - 1
            if lc.llama_memory_seq_pos_max(self.ctx.memory, pad) >= 0:
                raise RuntimeError(f"padding sequence {pad} is in use")
            self.batch.add([100], 0, pad, False)
            present.add(pad)
            pads.append(pad)
        return pads

    def prefill(self, tokens: list[int], seq: int, chunks: Iterable[int] = (CHUNK,),
                first_pos: int = 0) -> np.ndarray:
        """Prefill in chunks of the given sizes, cycled; returns the last token's logits."""
        start, index = 0, -1
        for size in itertools.cycle(chunks):
            end = min(start + size, len(tokens))
            [index] = self.call([(tokens[start:end], first_pos + start, seq, end == len(tokens))])
            start = end
            if start == len(tokens):
                return self.ctx.logits(index).copy()
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()


@dataclass
class Row:
    name: str
    prefill: float  # tok/s
    decode_8: float  # tok/s, all 8 sequences together
    decode_1: float  # tok/s, one sequence alone
    chunks_32: float  # max abs logit differences, 0.0 = bitwise identical
    ragged: float
    beside: float
    churn: float
    prompts: float
    restore: float


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 40000, n).tolist()


def step_token(seq: int, step: int) -> int:
    """The token fed to a sequence at a decode step: fixed, so that runs compare like for like."""
    return 1000 + (seq * 977 + step * 31) % 30000


def diff(a: Iterable[np.ndarray], b: Iterable[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def decode(run: Runner, others: dict[int, list[int]], admit: dict[int, dict[int, list[int]]],
           ) -> tuple[list[np.ndarray], dict[int, np.ndarray], float]:
    """Decode sequence 0 (prefilled already) for STEPS steps beside the running `others`
    (seq -> tokens so far). As the engine does, a prompt admitted at a step is prefilled in the
    same calls, after the decodes, ADMIT_CHUNK tokens a step, and decodes from the step after.
    Returns sequence 0's logits per step, each admitted prompt's last logits, and the time
    spent in llama_decode."""
    pos = {seq: len(held) for seq, held in others.items()}  # next position of decoding seqs
    prefilling: dict[int, list[int]] = {}
    done: dict[int, int] = {}  # prompt tokens prefilled so far
    logits, prompt_logits, seconds = [], {}, 0.0
    for step in range(STEPS):
        for seq, prompt in admit.get(step, {}).items():
            prefilling[seq], done[seq] = prompt, 0
        parts = [([step_token(0, step)], SEQ0_PROMPT + step, 0, True)]
        parts += [([step_token(seq, step)], pos[seq], seq, True) for seq in sorted(pos)]
        for seq, prompt in prefilling.items():
            end = min(done[seq] + ADMIT_CHUNK, len(prompt))
            parts.append((prompt[done[seq]:end], done[seq], seq, end == len(prompt)))
        start = time.perf_counter()
        indexes = run.call(parts)
        seconds += time.perf_counter() - start
        logits.append(run.ctx.logits(indexes[0]).copy())
        for seq in pos:
            pos[seq] += 1
        chunked = list(prefilling)
        for seq, index in zip(chunked, indexes[len(parts) - len(chunked):], strict=True):
            done[seq] = min(done[seq] + ADMIT_CHUNK, len(prefilling[seq]))
            if done[seq] == len(prefilling[seq]):
                prompt_logits[seq] = run.ctx.logits(index).copy()
                pos[seq] = len(prefilling.pop(seq))
    return logits, prompt_logits, seconds


def measure(model: Model, candidate: Candidate, threads: int) -> Row:
    run = Runner(model, candidate, threads)
    ctx, prompt = run.ctx, tokens(1, PROMPT)

    # Prefill speed and the cold reference, twice: the two must agree bitwise as well.
    colds, best = [], float("inf")
    for _ in range(2):
        ctx.clear()
        start = time.perf_counter()
        colds.append(run.prefill(prompt, 0))
        best = min(best, time.perf_counter() - start)
    cold = colds[0]
    if diff([colds[0]], [colds[1]]) != 0.0:
        print(f"warning: {candidate.key}: two identical prefills differ", file=sys.stderr)

    # (a) the same tokens in other chunkings
    chunked = []
    for chunks in ((32,), RAGGED):
        ctx.clear()
        chunked.append([run.prefill(prompt, 0, chunks)])

    # (c) a restored prefix: sequence 1 gets sequence 0's serialised cells after sequence 2's
    ctx.clear()
    run.prefill(prompt[:PREFIX], 0)
    blob = ctx.sequence_state(0).copy()
    ctx.forget(0)
    run.prefill(tokens(2, 100), 2)
    ctx.load_sequence_state(1, blob)
    restored = run.prefill(prompt[PREFIX:], 1, first_pos=PREFIX)

    # (b) decode alone, beside 7 in a clean layout, and beside 7 after churn
    seq0 = tokens(3, SEQ0_PROMPT)
    # Sequence 7 is the longest, so that n_kv (padded to 256 over a micro-batch's streams) is
    # 768 beside it and 512 alone.
    first = {seq: tokens(10 + seq, 600 if seq == 7 else 40 + 20 * seq) for seq in range(1, N_SEQ)}
    ctx.clear()
    run.prefill(seq0, 0)
    alone, _, alone_s = decode(run, {}, {})

    ctx.clear()
    run.prefill(seq0, 0)
    for seq, held in first.items():
        run.prefill(held, seq)
    beside, _, beside_s = decode(run, first, {})

    ctx.clear()
    for seq, held in first.items():  # the others first: sequence 0's cells start at 1,260
        run.prefill(held, seq)
    run.prefill(seq0, 0)
    for seq in (1, 2, 3):  # free cells 0-239, before sequence 0's prompt
        ctx.forget(seq)
    running = {seq: held for seq, held in first.items() if seq > 3}
    # Sequence 1's prompt ends in a 2-token chunk at n_kv 768: split_equal gives its first token
    # to the micro-batch of the decodes and leaves the last one alone in a micro-batch.
    admit = {0: {2: tokens(20, 48), 3: tokens(21, 48)}, 4: {1: tokens(22, 22 * ADMIT_CHUNK + 2)}}
    churned, admitted, _ = decode(run, running, admit)
    prompts = {seq: prompt for at_step in admit.values() for seq, prompt in at_step.items()}
    prompts_alone = []
    for seq, prompt in prompts.items():
        ctx.clear()
        prompts_alone.append(run.prefill(prompt, seq))
    run.close()

    return Row(candidate.name, PROMPT / best, N_SEQ * STEPS / beside_s, STEPS / alone_s,
               diff([cold], chunked[0]), diff([cold], chunked[1]), diff(alone, beside),
               diff(alone, churned), diff(prompts_alone, [admitted[seq] for seq in prompts]),
               diff([cold], [restored]))


def fmt(d: float) -> str:
    return "0.0" if d == 0.0 else f"{d:.3g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default: 2)")
    parser.add_argument("--only", nargs="+", choices=[c.key for c in CANDIDATES],
                        help="measure these candidates only")
    args = parser.parse_args()
    path = args.model or default_model_path()
    model = Model(str(path))
    print(f"{path.name}, {args.threads} threads on {os.cpu_count()} CPUs, "
          f"llama-cpp-python {lc.__version__}, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}\n")
    print("| configuration | prefill tok/s | decode tok/s, 8 seqs | decode tok/s, 1 seq "
          "| (a) chunks of 32 | (a) ragged chunks | (b) beside 7 | (b) after churn "
          "| (b) prompts beside decodes | (c) restored prefix |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for candidate in CANDIDATES:
        if args.only and candidate.key not in args.only:
            continue
        r = measure(model, candidate, args.threads)
        print(f"| {r.name} | {r.prefill:.0f} | {r.decode_8:.0f} | {r.decode_1:.0f} "
              f"| {fmt(r.chunks_32)} | {fmt(r.ragged)} | {fmt(r.beside)} | {fmt(r.churn)} "
              f"| {fmt(r.prompts)} | {fmt(r.restore)} |", flush=True)
    model.close()


if __name__ == "__main__":
    main()
