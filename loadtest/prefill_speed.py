"""Where single-request prefill time goes: llama.cpp's own compute against each layer above it.

    python -m loadtest.prefill_speed [--tokens 1024] [--repeats 5] [--server PATH ...]

One prompt of `--tokens` tokens (fresh text each repeat, so no system reuses anything),
computed by, alternately within each repeat:
- bare llama-cpp-python: the low-level API on the main thread, one `llama_decode` per n_batch
  tokens, at each (n_batch, n_ubatch) in BATCH_SHAPES: the library's limit;
- the engine: engine.batching.Engine on its own thread as a worker runs it (cache off), time to
  its first output;
- the gateway: the real server over HTTP, time to the first streamed token;
- each llama-server binary given: its own `timings.prompt_ms`, and its time to the first token
  over HTTP (`--server` may name several builds, e.g. one of the llama.cpp llama-cpp-python
  vendors, to tell the library's version from everything else).

It prints a markdown table of median ms and tok/s per system.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import llama_cpp as lc

from engine.batching import Engine
from engine.config import CacheConfig, EngineConfig
from engine.llama import Model, openmp_build
from engine.messages import GenerationRequest, Output, SamplerSettings
from gateway.workers.model_store import default_model_path
from loadtest.gateway_process import GatewayProcess, ServerProcess

N_CTX = 16384  # the engine's default pool of cells
BATCH_SHAPES = [(512, 512), (2048, 512), (1024, 1024)]
WORDS = ["system", "cache", "prefix", "token", "model", "stream", "batch", "window", "layer",
         "query", "answer", "tool", "agent", "request", "server", "engine", "python", "thread",
         "memory", "block", "tree", "radix", "slot"]


def fresh_prompt(model: Model, n_tokens: int, rng: random.Random) -> list[int]:
    text = " ".join(rng.choice(WORDS) for _ in range(n_tokens * 2))
    return model.tokenize(text, add_special=True, parse_special=False)[:n_tokens]


class BareContext:
    """A llama-cpp-python context of the low-level API: prefill alone, as little as it can do."""

    def __init__(self, model: Model, n_batch: int, n_ubatch: int, threads: int) -> None:
        params = lc.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = N_CTX, n_batch, n_ubatch
        params.n_seq_max, params.kv_unified, params.no_perf = 1, True, True
        params.n_threads = params.n_threads_batch = threads
        params.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self.n_batch = n_batch
        self.ctx = lc.llama_init_from_model(model.ptr, params)
        self.batch = lc.llama_batch_init(n_batch, 0, 1)

    def prefill_ms(self, prompt: list[int]) -> float:
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        start = time.perf_counter()
        for begin in range(0, len(prompt), self.n_batch):
            chunk = prompt[begin:begin + self.n_batch]
            for i, token in enumerate(chunk):
                self.batch.token[i], self.batch.pos[i] = token, begin + i
                self.batch.n_seq_id[i], self.batch.seq_id[i][0] = 1, 0
                self.batch.logits[i] = begin + i == len(prompt) - 1
            self.batch.n_tokens = len(chunk)
            if lc.llama_decode(self.ctx, self.batch) != 0:
                raise RuntimeError("llama_decode failed")
        return (time.perf_counter() - start) * 1e3

    def close(self) -> None:
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)


class EngineRunner:
    """The engine on its own thread, cache off: the worker's prefill path without HTTP."""

    def __init__(self, model: Model, threads: int) -> None:
        self.engine = Engine(model, EngineConfig(parallel=8, ctx_size=N_CTX, threads=threads,
                                                 cache=CacheConfig(enabled=False)))
        self.engine.start()

    def prefill_ms(self, prompt: list[int]) -> float:
        arrived = threading.Event()

        class Sink:
            cancelled = False

            def deliver(self, output: Output) -> None:
                if output.last:
                    arrived.set()

        start = time.perf_counter()
        self.engine.submit(GenerationRequest(prompt, max_tokens=1, ignore_eos=True,
                                             sampler=SamplerSettings(temperature=0.0)), Sink())
        arrived.wait()
        return (time.perf_counter() - start) * 1e3

    def close(self) -> None:
        self.engine.stop()


def first_token_ms(url: str, body: dict) -> tuple[float, dict]:
    """Time to the first streamed chunk, and the last chunk's JSON (llama-server's timings)."""
    request = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(),
                                     {"Content-Type": "application/json"})
    start = time.perf_counter()
    first, last = 0.0, {}
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            if line.startswith(b"data: {"):
                first = first or (time.perf_counter() - start) * 1e3
                last = json.loads(line[6:])
    return first, last


class Server:
    """A server over HTTP taking the prompt as token ids on its completions endpoint."""

    def __init__(self, name: str, process: ServerProcess, path: str, body: dict,
                 own_timing: bool) -> None:
        self.name, self.process, self.path, self.own_timing = name, process, path, own_timing
        self.body = {**body, "temperature": 0}
        self.own_ms: list[float] = []

    def prefill_ms(self, prompt: list[int]) -> float:
        ms, last = first_token_ms(self.process.base_url + self.path,
                                  {**self.body, "prompt": prompt})
        if self.own_timing:
            self.own_ms.append(last["timings"]["prompt_ms"])
        return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(default_model_path()))
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--server", type=Path, nargs="*", default=[Path(".bench/llama-server")])
    args = parser.parse_args()
    model = Model(args.model)
    logs = Path(".bench/prefill_speed")
    runs: dict[str, Callable[[list[int]], float]] = {}
    closers: list[Callable[[], None]] = []
    for n_batch, n_ubatch in BATCH_SHAPES:
        bare = BareContext(model, n_batch, n_ubatch, args.threads)
        runs[f"bare llama-cpp-python, n_batch {n_batch} n_ubatch {n_ubatch}"] = bare.prefill_ms
        closers.append(bare.close)
    engine = EngineRunner(model, args.threads)
    runs["engine (its thread, cache off)"] = engine.prefill_ms
    closers.append(engine.close)
    servers: list[Server] = []
    gateway = GatewayProcess(Path(args.model), "--threads", str(args.threads),
                             "--no-prefix-cache")
    servers.append(Server("gateway (HTTP, first token)", gateway, "/v1/completions",
                          {"model": gateway.model_name, "max_tokens": 1}, False))
    for binary in args.server:
        process = ServerProcess([str(binary), "-m", args.model, "-t", str(args.threads),
                                 "-c", str(N_CTX), "--port", "{port}", "--host", "127.0.0.1"],
                                "/health", logs / f"{binary.name}.log")
        servers.append(Server(f"{binary} (HTTP, first token)", process, "/completion",
                              {"n_predict": 1, "cache_prompt": False}, True))
    for server in servers:
        runs[server.name] = server.prefill_ms
        closers.append(server.process.stop)
    rng = random.Random(0)
    times: dict[str, list[float]] = {name: [] for name in runs}
    try:
        for _ in range(args.repeats):
            for name, run in runs.items():  # alternating: the machine's noise hits each alike
                times[name].append(run(fresh_prompt(model, args.tokens, rng)))
    finally:
        for close in closers:
            close()
    for server in servers:
        if server.own_timing:
            times[f"{server.process.proc.args[0]} (its own timings.prompt_ms)"] = server.own_ms
    reference = statistics.median(times[next(iter(times))])
    print(f"llama-cpp-python {lc.__version__} "
          f"({'OpenMP' if openmp_build() else 'ggml threadpool'}), {args.threads} threads, "
          f"{args.tokens}-token prompts, median of {args.repeats}, flash attention on\n")
    print("| system | prefill ms | tok/s | vs the first row |")
    print("|---|---|---|---|")
    for name, values in times.items():
        ms = statistics.median(values)
        print(f"| {name} | {ms:.0f} | {args.tokens * 1e3 / ms:.0f} | {ms / reference:.2f}x |")
    model.close()


if __name__ == "__main__":
    main()
