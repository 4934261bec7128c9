"""Why prefixgate keeps Q8_0 KV: does a token's output depend on what shares its batch?

    python -m loadtest.kernel_invariance

For F16 and Q8_0 KV it prefills 1,024 tokens in chunks of 32 and of 256, then decodes 16 tokens
alone and again beside 7 other sequences, and prints the largest logit difference between the
two ways (0.0 = bitwise identical) with the prefill speed."""

from __future__ import annotations

import time

import llama_cpp as lc
import numpy as np

from gateway.llama import Batch, Context, ContextShape, Model
from gateway.model_store import default_model_path


def measure(model: Model, kv_type: int) -> tuple[float, float, float]:
    ctx = Context(model, ContextShape(n_ctx=8 * 2048, n_seq_max=8, n_batch=256, n_threads=2,
                                      kv_type=kv_type))
    batch = Batch(256)
    tokens = [(i * 7919) % 40000 + 100 for i in range(1024)]
    last, speed = {}, 0.0
    for chunk in (32, 256):
        ctx.forget(0)
        start = time.perf_counter()
        for s in range(0, len(tokens), chunk):
            batch.clear()
            index = batch.add(tokens[s:s + chunk], s, 0, s + chunk >= len(tokens))
            ctx.decode(batch)
        speed = len(tokens) / (time.perf_counter() - start)
        last[chunk] = ctx.logits(index).copy()
    alone, beside = [], []
    for others in (0, 7):
        for s in range(1, 8):
            ctx.forget(s)
        ctx.forget(0)
        batch.clear()
        batch.add(tokens[:256], 0, 0, False)
        ctx.decode(batch)
        for step in range(16):
            batch.clear()
            index = batch.add([500 + step], 256 + step, 0, True)
            for s in range(1, others + 1):
                batch.add([600 + step], step, s, False)
            ctx.decode(batch)
            (alone if others == 0 else beside).append(ctx.logits(index).copy())
    batch.close()
    ctx.close()
    return (float(np.abs(last[32] - last[256]).max()),
            max(float(np.abs(a - b).max()) for a, b in zip(alone, beside, strict=True)), speed)


def main() -> None:
    model = Model(str(default_model_path()))
    print("| KV type | prefill chunks 32 vs 256 | decode alone vs beside 7 | prefill tok/s (256) |")
    print("|---|---:|---:|---:|")
    for name, kv_type in (("F16", lc.GGML_TYPE_F16), ("Q8_0", lc.GGML_TYPE_Q8_0)):
        prefill, decode, speed = measure(model, kv_type)
        print(f"| {name} | {prefill} | {decode} | {speed:.0f} |")
    model.close()


if __name__ == "__main__":
    main()
