"""What the weights' quantization type costs a CPU prefill, on a bare context (no server).

    python -m loadtest.weight_kernels [--types q4_0 q8_0 q4_k_m] [--repeats 3]

llama.cpp's CPU backend repacks some weight types into interleaved blocks at load and runs
their matrix products as small GEMMs (`ggml-cpu/repack.cpp`: Q4_0, Q4_K, Q8_0, IQ4_NL and
others on AVX2); the rest, Q4_1 among them, go through the generic dot product, one block
row and one activation row at a time. The default model ships as Q4_1. This requantizes it
to each type asked for (lossy: for speed only, its outputs are not compared) in a
temporary directory and times, with each type in turn per repeat: one fresh prompt's prefill
in one call, and a decode step of one sequence after it.

Prints the medians, one row per type; the prefill ratio is against the model as shipped.
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
import time
from pathlib import Path

import llama_cpp as lc
import numpy as np

from engine.config import ContextShape
from engine.llama import Batch, Context, Model
from gateway.workers.model_store import default_model_path

FILE_TYPES = {"q4_0": lc.LLAMA_FTYPE_MOSTLY_Q4_0, "q8_0": lc.LLAMA_FTYPE_MOSTLY_Q8_0,
              "q4_k_m": lc.LLAMA_FTYPE_MOSTLY_Q4_K_M, "iq4_nl": lc.LLAMA_FTYPE_MOSTLY_IQ4_NL}
DECODES = 16


def requantized(source: Path, file_type: str, directory: Path) -> Path:
    target = directory / f"{source.stem}.{file_type}.gguf"
    params = lc.llama_model_quantize_default_params()
    params.ftype = FILE_TYPES[file_type]
    params.allow_requantize = True  # the source is already quantized
    params.nthread = 2
    if lc.llama_model_quantize(str(source).encode(), str(target).encode(),
                               ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not requantize {source} to {file_type}")
    return target


class Timed:
    """One model on a context of its own: a fresh prompt's prefill, then decode steps."""

    def __init__(self, path: Path, prompt_tokens: int) -> None:
        self.model = Model(str(path))
        self.ctx = Context(self.model, ContextShape(n_ctx=2048, n_seq_max=1, n_batch=512,
                                                    n_threads=2, kv_type="f16",
                                                    flash_attn=True))
        self.batch = Batch(512)
        self.prompt_tokens = prompt_tokens
        self.rng = np.random.default_rng(0)

    def run(self) -> tuple[float, float]:
        """(prefill tokens/s, ms per decode step)."""
        self.ctx.forget(0)
        self.batch.clear()
        self.batch.add(self.rng.integers(100, 40000, self.prompt_tokens).tolist(), 0, 0, 1)
        started = time.perf_counter()
        self.ctx.decode(self.batch)
        prefill = self.prompt_tokens / (time.perf_counter() - started)
        started = time.perf_counter()
        for i in range(DECODES):
            self.batch.clear()
            self.batch.add([int(self.rng.integers(100, 40000))], self.prompt_tokens + i, 0, 1)
            self.ctx.decode(self.batch)
        return prefill, 1000 * (time.perf_counter() - started) / DECODES


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", nargs="+", choices=sorted(FILE_TYPES),
                   default=["q4_0", "q8_0", "q4_k_m"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=512)
    args = p.parse_args()
    source = default_model_path()
    with tempfile.TemporaryDirectory() as directory:
        paths = {"as shipped": source} | {t: requantized(source, t, Path(directory))
                                          for t in args.types}
        models = {name: Timed(path, args.prompt_tokens) for name, path in paths.items()}
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
        for _ in range(args.repeats):
            for name, model in models.items():
                runs[name].append(model.run())
    shipped = float(np.median([r[0] for r in runs["as shipped"]]))
    print(f"{source.name}, {args.prompt_tokens}-token prefill in one call and {DECODES} decode "
          f"steps after it, 2 threads, median of {args.repeats}\n")
    print("| weights | prefill tok/s | vs as shipped | decode ms a step |")
    print("|---|---|---|---|")
    for name, timings in runs.items():
        prefill = float(np.median([r[0] for r in timings]))
        decode = float(np.median([r[1] for r in timings]))
        print(f"| {name} | {prefill:.0f} | {prefill / shipped:.2f}x | {decode:.1f} |")


if __name__ == "__main__":
    main()
