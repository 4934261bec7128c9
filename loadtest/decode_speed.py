"""The engine's decode speed against a bare llama-cpp-python loop, both measured in one run.

    python -m loadtest.decode_speed [--tokens 128] [--concurrency 1 8] [--flash-attn on|off]
                                    [--source CHECKOUT ...]

For each concurrency it decodes `--tokens` greedy tokens per sequence after a short prompt:
- bare loop, main thread: concurrency 1 is llama-cpp-python's own `Llama.eval`, one token per
  call; above 1, the low-level API, one `llama_decode` of one token per sequence and a greedy
  `llama_sampler_sample` each, as little as a batched loop can do;
- bare loop, second thread: the same loop from a thread that is not the process's main one
  (where the engine runs), which an OpenMP build of llama.cpp makes ~3x slower;
- engine: engine.batching.Engine on its own thread, exactly as a worker process runs it (cache
  off: the decode path is the same), with the share of its step spent outside `llama_decode`;
- gateway: the real gateway (one worker process, the default cache) over streamed HTTP, each
  sequence a streamed /v1/completions request of the same prompt's token ids: a user's time per
  token, with the gateway's and worker's CPU taken from llama.cpp's two cores. `--source` adds
  the gateway of other checkouts beside it (before/after figures in one run).

It prints a markdown table: ms per decode step (one token for each sequence) and tok/s.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp as lc
import numpy as np
import orjson
from aiohttp import ClientSession, ClientTimeout

from engine.batching import Engine
from engine.config import CacheConfig, EngineConfig
from engine.llama import Model, openmp_build
from engine.messages import GenerationRequest, Output, SamplerSettings
from gateway.workers.model_store import default_model_path
from loadtest.gateway_process import ROOT, GatewayProcess

N_CTX = 16384  # the engine's default: one unified pool of cells
PROMPT_WORDS = 24


def prompts(n: int, model: Model) -> list[list[int]]:
    return [model.tokenize(f"Story {i}: " + "the quick brown fox jumps over the lazy dog " *
                           (PROMPT_WORDS // 9 + 1), add_special=True, parse_special=False)
            for i in range(n)]


def on_thread(run: Callable[[], float]) -> float:
    result: list[float] = []
    thread = threading.Thread(target=lambda: result.append(run()))
    thread.start()
    thread.join()
    return result[0]


def bare_single(model_path: str, prompt: list[int], n_tokens: int, threads: int,
                flash: bool) -> float:
    """ms per token of llama-cpp-python's high-level Llama.eval, greedy."""
    llm = lc.Llama(model_path, n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                   flash_attn=flash, verbose=False)
    llm.eval(prompt)
    token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    start = time.perf_counter()
    for _ in range(n_tokens):
        llm.eval([token])
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    elapsed = time.perf_counter() - start
    llm.close()
    return elapsed / n_tokens * 1e3


def bare_batched(model: Model, batch_prompts: list[list[int]], n_tokens: int, threads: int,
                 flash: bool) -> float:
    """ms per step of the low-level API decoding one token for each sequence together."""
    n_seq = len(batch_prompts)
    params = lc.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = N_CTX, 512, 512
    params.n_seq_max, params.kv_unified, params.no_perf = n_seq, True, True
    params.n_threads = params.n_threads_batch = threads
    params.flash_attn_type = (lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash
                              else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    ctx = lc.llama_init_from_model(model.ptr, params)
    batch = lc.llama_batch_init(512, 0, 1)
    samplers = [lc.llama_sampler_init_greedy() for _ in range(n_seq)]

    def add(token: int, pos: int, seq: int, logits: bool) -> None:
        i = batch.n_tokens
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
        batch.seq_id[i][0], batch.logits[i] = seq, logits
        batch.n_tokens = i + 1

    tokens, positions = [], []
    for seq, prompt in enumerate(batch_prompts):
        batch.n_tokens = 0
        for pos, token in enumerate(prompt):
            add(token, pos, seq, pos == len(prompt) - 1)
        lc.llama_decode(ctx, batch)
        tokens.append(lc.llama_sampler_sample(samplers[seq], ctx, -1))
        positions.append(len(prompt))
    start = time.perf_counter()
    for _ in range(n_tokens):
        batch.n_tokens = 0
        for seq in range(n_seq):
            add(tokens[seq], positions[seq], seq, True)
            positions[seq] += 1
        lc.llama_decode(ctx, batch)
        tokens = [lc.llama_sampler_sample(samplers[seq], ctx, seq) for seq in range(n_seq)]
    elapsed = time.perf_counter() - start
    for sampler in samplers:
        lc.llama_sampler_free(sampler)
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    return elapsed / n_tokens * 1e3


@dataclass
class _Recorder:
    """An engine output sink that keeps when each output arrived."""

    cancelled: bool = False
    times: list[float] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    last: Output | None = None

    def deliver(self, output: Output) -> None:
        self.times.append(time.perf_counter())
        if output.last:
            self.last = output
            self.done.set()


@dataclass(frozen=True)
class EngineFigures:
    ms_per_step: float
    outside_decode: float  # share of the decode phase's wall time the engine spent elsewhere


def engine_run(model: Model, batch_prompts: list[list[int]], n_tokens: int, threads: int,
               flash: bool) -> EngineFigures:
    config = EngineConfig(parallel=max(8, len(batch_prompts)), ctx_size=N_CTX, threads=threads,
                          flash_attn=flash, cache=CacheConfig(enabled=False))
    sinks = [_Recorder() for _ in batch_prompts]
    in_decode, first = [0.0], [0.0]

    def start_timing(_snapshot) -> None:  # after each step: from the first all-decode step on
        if not first[0] and all(sink.times for sink in sinks):
            first[0], in_decode[0] = time.perf_counter(), 0.0

    engine = Engine(model, config, on_publish=start_timing)
    decode = engine.ctx.decode

    def timed_decode(batch) -> None:
        start = time.perf_counter()
        decode(batch)
        in_decode[0] += time.perf_counter() - start

    engine.ctx.decode = timed_decode
    engine.start()
    # Submitted together, so that the prompts are prefilled in one step and every step after
    # that decodes all of them; greedy, and never ending early.
    for prompt, sink in zip(batch_prompts, sinks, strict=True):
        engine.submit(GenerationRequest(prompt, max_tokens=n_tokens + 1, ignore_eos=True,
                                        sampler=SamplerSettings(temperature=0.0)), sink)
    for sink in sinks:
        sink.done.wait()
    wall = max(sink.times[-1] for sink in sinks) - first[0]
    engine.stop()
    per_sequence = [(sink.times[-1] - sink.times[0]) / (sink.last.usage.completion_tokens - 1)
                    for sink in sinks]
    return EngineFigures(statistics.median(per_sequence) * 1e3, 1 - in_decode[0] / wall)


async def _stream_tpot(session: ClientSession, gateway: GatewayProcess, prompt: list[int],
                       n_tokens: int) -> float:
    """ms per token of one streamed greedy completion, from its first token to its last."""
    body = {"model": gateway.model_name, "prompt": prompt, "max_tokens": n_tokens + 1,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    times, completion_tokens = [], 0
    async with session.post(gateway.base_url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            event = orjson.loads(line[6:])
            if any(choice.get("text") for choice in event.get("choices") or []):
                times.append(time.perf_counter())
            if usage := event.get("usage"):
                completion_tokens = usage["completion_tokens"]
    # A chunk can carry more than one token (text held back mid-character), so per token.
    return (times[-1] - times[0]) / (completion_tokens - 1) * 1e3


def gateway_http(model_path: str, batch_prompts: list[list[int]], n_tokens: int, threads: int,
                 flash: bool, source: Path) -> float:
    """ms per token (median over the sequences) through the gateway's streamed HTTP API."""
    gateway = GatewayProcess(Path(model_path), "--threads", str(threads),
                             "--parallel", str(max(8, len(batch_prompts))),
                             "--flash-attn", "on" if flash else "off", source=source)

    async def run() -> list[float]:
        async with ClientSession(timeout=ClientTimeout(total=600)) as session:
            await _stream_tpot(session, gateway, batch_prompts[0], 8)  # warm up
            return await asyncio.gather(*(_stream_tpot(session, gateway, prompt, n_tokens)
                                          for prompt in batch_prompts))
    try:
        return statistics.median(asyncio.run(run()))
    finally:
        gateway.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(default_model_path()))
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--flash-attn", choices=("on", "off"), default="on")
    parser.add_argument("--source", type=Path, nargs="*", default=[],
                        help="other checkouts whose gateway to measure beside this one's")
    args = parser.parse_args()
    sources = [ROOT, *args.source]
    flash = args.flash_attn == "on"
    model = Model(args.model)
    print(f"llama-cpp-python {lc.__version__}, {'OpenMP' if openmp_build() else 'ggml threadpool'}"
          f" build, {args.threads} threads, flash attention {args.flash_attn}, "
          f"{args.tokens} tokens per sequence\n")
    gateway_names = ["gateway" if source == ROOT else f"gateway ({source})" for source in sources]
    print("| sequences | bare loop, main thread | bare loop, second thread | engine (its thread) "
          "| engine / bare | engine time outside llama_decode | "
          + " | ".join(f"{name}, streamed HTTP | {name} / bare" for name in gateway_names) + " |")
    print("|---" * (6 + 2 * len(sources)) + "|")
    for n_seq in args.concurrency:
        batch_prompts = prompts(n_seq, model)
        if n_seq == 1:
            def bare(prompt=batch_prompts[0]):
                return bare_single(args.model, prompt, args.tokens, args.threads, flash)
        else:
            def bare(batch_prompts=batch_prompts):
                return bare_batched(model, batch_prompts, args.tokens, args.threads, flash)
        main_ms = bare()
        thread_ms = on_thread(bare)
        engine = engine_run(model, batch_prompts, args.tokens, args.threads, flash)
        http = [gateway_http(args.model, batch_prompts, args.tokens, args.threads, flash, source)
                for source in sources]
        print(f"| {n_seq} | {_cell(main_ms, n_seq)} | {_cell(thread_ms, n_seq)} "
              f"| {_cell(engine.ms_per_step, n_seq)} | {engine.ms_per_step / main_ms:.2f}x "
              f"| {engine.outside_decode:.1%} | "
              + " | ".join(f"{_cell(ms, n_seq)} | {ms / main_ms:.2f}x" for ms in http) + " |")
    model.close()


def _cell(ms_per_step: float, n_seq: int) -> str:
    return f"{ms_per_step:.1f} ms ({n_seq * 1e3 / ms_per_step:.0f} tok/s)"


if __name__ == "__main__":
    main()
