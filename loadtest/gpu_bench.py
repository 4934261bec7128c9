"""The GPU benchmark: prefixgate beside llama-server, both built for the same backend, every
layer on the device.

    make bench-gpu BACKEND=cuda       # builds llama-server for CUDA once, then runs this
    python -m loadtest.gpu_bench --backend vulkan [--model M.gguf] [--concurrency 1 8]
    python -m loadtest.gpu_bench --backend vulkan --smoke --model models/tiny-random-llama.gguf

Run it with the Python whose llama-cpp-python is built for --backend (`make setup BACKEND=...`);
llama-server comes from `BACKEND=... loadtest/build_llama_server.sh`. Each server is started
once, warmed up (a device compiles its kernels on first use), then measured:
- shared prefix and multi-turn (loadtest.workloads, bench.py's sizes) at each concurrency: TTFT
  p50 and output throughput; for multi-turn also the TTFT of the turns after the first;
- a prefix computed on the device (a new one) against the same prefix cached: for prefixgate
  asked again after its request ended, so its blocks come back from the shared-memory pool,
  with the load's own time from /metrics; llama-server's slot keeps it in place;
- device memory: weights, KV and compute buffers, KV per sequence, and the KV each live session
  holds at the peak of the shared-prefix run.
Prints a markdown table. On a software device (Mesa's llvmpipe/lavapipe, SwiftShader) the speed
figures are meaningless, and the table says so: the run only proves the benchmark works.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import ClientSession, TCPConnector

from engine.devices import Device
from engine.llama import BUFFER_LINE, Model, backends, devices
from gateway.workers.model_store import default_model_path
from loadtest.bench import (
    FULL,
    SMOKE,
    RunningServer,
    Sizes,
    System,
    gateway_system,
    llama_server_system,
    measure,
    serving,
)
from loadtest.client import stream_chat
from loadtest.gateway_process import ROOT, scrape, totals
from loadtest.stats import percentiles
from loadtest.workloads import TextMaker, multi_turn, shared_prefix

# --backend -> the name of llama.cpp's backend in its registry (engine.llama.backends(); ggml's
# GGML_CUDA_NAME and GGML_METAL_NAME).
BACKENDS = {"cpu": "CPU", "vulkan": "Vulkan", "cuda": "CUDA", "rocm": "ROCm", "metal": "MTL"}
# Drivers that run a GPU API on the CPU: a benchmark's speed there says nothing of a GPU's.
SOFTWARE_DEVICES = ("llvmpipe", "lavapipe", "swiftshader")
SYSTEM_NAMES = ("prefixgate", "llama-server")
MIB = 2**20


def default_llama_server(backend: str) -> Path:
    """Where loadtest/build_llama_server.sh puts llama-server built for `backend`."""
    return ROOT / ".bench" / ("llama-server" if backend == "cpu" else f"llama-server-{backend}")


@dataclass
class GpuSettings:
    backend: str
    model: Path
    llama_server: Path
    concurrency: list[int]
    sizes: Sizes
    output_tokens: int
    hit_rounds: int  # prefixes computed, then asked again cached
    threads: int
    ctx_size: int  # KV cells per sequence

    @property
    def parallel(self) -> int:
        return max(self.concurrency)

    def describe(self) -> str:
        s = self.sizes
        return (f"shared prefix = {s.groups} groups x {s.prompts_per_group} prompts, each a "
                f"{s.prefix_tokens}-token system prompt + a {s.question_tokens}-token question; "
                f"multi-turn = {s.conversations} conversations x {s.turns} turns "
                f"({s.system_tokens}-token system prompt, {s.turn_tokens}-token user turns, "
                f"whole history resent); {self.output_tokens} output tokens a request; cached "
                f"prefix = {self.hit_rounds} new {s.prefix_tokens}-token system prompts, each "
                f"asked once (computed) and again with another question (cached), 1 output "
                f"token")


@dataclass
class Measured:
    """One system's figures: what the table reads."""
    runs: dict[tuple[str, int], dict] = field(default_factory=dict)  # (workload, level) -> run
    cold_ttft: float | None = None
    hit_ttft: float | None = None
    load_ms: float | None = None  # per pool load, prefixgate's /metrics
    loaded_tokens: float | None = None  # per pool load
    memory: dict[tuple[str, str], int] = field(default_factory=dict)  # (buffer, kind) -> bytes
    kv_cells: int = 0  # the sequences' unified KV, as the command line gives it
    cell_bytes: float | None = None  # KV bytes one cell takes


def offload_flags(backend: str) -> tuple[list[str], list[str]]:
    """prefixgate's and llama-server's flags for every layer on the device (none for the CPU)."""
    if backend == "cpu":
        return ["--n-gpu-layers", "0"], ["-ngl", "0"]
    return ["--n-gpu-layers", "all"], ["-ngl", "99"]


def systems(settings: GpuSettings) -> dict[str, System]:
    ours, theirs = offload_flags(settings.backend)
    cells = settings.ctx_size * settings.parallel
    gateway = gateway_system("prefixgate", settings.model, settings.threads, settings.parallel,
                             cells, *ours)
    server = llama_server_system(settings.llama_server, settings.model, settings.threads,
                                 settings.parallel, cells)
    # -lv 4: llama-server logs llama.cpp's own INFO lines, the buffer sizes among them, only
    # at its trace verbosity; memory_of() reads them.
    server.command += [*theirs, "-lv", "4"]
    if server.missing:
        server.missing = (f"{settings.llama_server} not built (BACKEND={settings.backend} "
                          "loadtest/build_llama_server.sh)")
    return {s.name: s for s in (gateway, server)}


def offload_devices(backend: str) -> list[Device]:
    """The devices of `backend` that layers go to; exits with what to do when there are none."""
    built = backends()
    if BACKENDS[backend] not in built:
        raise SystemExit(f"this Python's llama-cpp-python has the backends {', '.join(built)}, "
                         f"not {BACKENDS[backend]}: run with the one `make setup "
                         f"BACKEND={backend}` built")
    if backend == "cpu":
        return []
    found = [d for d in devices() if d.offloads]
    if not found:
        raise SystemExit(f"no {BACKENDS[backend]} device found (Mesa's software driver is used "
                         "only with GGML_VK_VISIBLE_DEVICES=0: see docs/gpu.md)")
    return found


def software(found: list[Device]) -> list[Device]:
    return [d for d in found if any(n in d.description.lower() for n in SOFTWARE_DEVICES)]


@contextmanager
def peak_cells(server: RunningServer) -> Iterator[list[int]]:
    """Samples prefixgate's KV cells in use while the block runs; yields [peak] (filled on
    exit). A thread: the workload's event loop is asyncio.run inside bench.measure."""
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            peak[0] = max(peak[0], *(int(s.value) for s in scrape(server.base_url)
                                     if s.name == "prefixgate_kv_cells_used"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        done.set()
        sampler.join()


def run_levels(server: RunningServer, system: System, settings: GpuSettings, model: Model,
               into: Measured) -> None:
    for level in settings.concurrency:
        # Fresh prompts at each level (bench.py's seeds), so every level starts cold.
        maker = TextMaker(model, seed=1000 + level)
        s = settings.sizes
        workloads = {"shared_prefix": shared_prefix(maker, s.groups, s.prompts_per_group,
                                                    s.prefix_tokens, s.question_tokens),
                     "multi_turn": multi_turn(maker, s.conversations, s.turns, s.system_tokens,
                                              s.turn_tokens)}
        for workload, conversations in workloads.items():
            # Only prefixgate says how many cells are in use.
            watch = system.name == "prefixgate"
            with peak_cells(server) if watch else nullcontext([None]) as peak:
                run, rows = measure(server, system, workload, conversations, level,
                                    settings.output_tokens)
            run["peak_cells"] = peak[0]
            # Turns after the first find the history's KV cached (multi-turn; none elsewhere).
            run["later_turns_ttft"] = percentiles(
                [r["record"].ttft for r in rows if r["turn"] > 0 and r["record"].ok])["p50"]
            into.runs[workload, level] = run
            print(f"{system.name} {workload} c={level}: TTFT p50 {run['ttft']['p50']}, "
                  f"{run['output_throughput']:.1f} tok/s, failed {run['failed']}", flush=True)


async def cached_prefix(server: RunningServer, system: System, maker: TextMaker,
                        settings: GpuSettings,
                        metrics: Callable[[], dict[str, float]] | None) -> dict:
    """TTFT of new prefixes (computed on the device) and of the same ones asked again
    (cached); with `metrics` (prefixgate's), the pool loads the cached requests made."""
    cold, hit, load_seconds, loads, loaded = [], [], 0.0, 0.0, 0.0
    # A fresh connection per request, as bench.run_workload's: llama-server closes idle ones.
    async with ClientSession(connector=TCPConnector(force_close=True)) as session:
        async def ask(prefix: str) -> float:
            messages = [{"role": "system", "content": prefix},
                        {"role": "user", "content": maker.text(settings.sizes.question_tokens)}]
            record, _ = await stream_chat(session, server.base_url, server.model_id, messages,
                                          1, system.extra_body)
            if not record.ok:
                raise RuntimeError(f"{system.name}: {record.error}")
            return record.ttft

        for _ in range(settings.hit_rounds):
            prefix = maker.text(settings.sizes.prefix_tokens)
            cold.append(await ask(prefix))
            before = await asyncio.to_thread(metrics) if metrics else {}
            hit.append(await ask(prefix))
            if metrics:
                after = await asyncio.to_thread(metrics)

                def grew(name: str) -> float:
                    return after[name] - before[name]  # noqa: B023 - read at once

                load_seconds += grew("prefixgate_prefix_cache_load_seconds_total")
                loads += grew("prefixgate_prefix_cache_loads_total")
                loaded += grew("prefixgate_prefix_cache_hits_total")
    return {"cold_ttft": statistics.median(cold), "hit_ttft": statistics.median(hit),
            "load_ms": load_seconds / loads * 1000 if loads else None,
            "loaded_tokens": loaded / loads if loads else None}


def gateway_metrics(server: RunningServer) -> dict[str, float]:
    return totals(scrape(server.base_url))


def memory_of(server: RunningServer, system: System) -> dict[tuple[str, str], int]:
    """(buffer, kind) -> bytes llama.cpp allocated: prefixgate's /metrics (every worker's
    added up), llama-server's start-up log (the same llama.cpp lines prefixgate reads)."""
    memory: dict[tuple[str, str], int] = {}
    if system.name == "prefixgate":
        found = [((s.labels["buffer"], s.labels["kind"]), s.value) for s in scrape(server.base_url)
                 if s.name == "prefixgate_worker_memory_bytes"]
    else:
        found = [((m[1].decode(), m[2].decode()), float(m[3]) * MIB)
                 for m in BUFFER_LINE.finditer(server.log_path.read_bytes())]
    for key, nbytes in found:
        memory[key] = memory.get(key, 0) + int(nbytes)
    return memory


def kv_cell_bytes(server: RunningServer, system: System, m: Measured) -> float | None:
    """llama-server's KV buffer over its cells. prefixgate's KV buffers also hold its prefill
    context's cells (engine/prefill_context.py), so its figure is a pool block's bytes over its
    tokens: a block holds the same K and V rows, copied out of the device."""
    if system.name != "prefixgate":
        kv = sum(nbytes for (_, kind), nbytes in m.memory.items() if kind == "KV")
        return kv / m.kv_cells if kv else None
    pool = gateway_metrics(server)
    blocks = pool["prefixgate_kv_pool_blocks_used"] + pool["prefixgate_kv_pool_blocks_free"]
    return pool["prefixgate_kv_pool_bytes_capacity"] / blocks \
        / pool["prefixgate_kv_pool_block_tokens"]


def measure_system(system: System, settings: GpuSettings, model: Model, logs: Path,
                   into: Measured) -> str | None:
    """Runs everything on one system; returns why it could not run, or None."""
    record: dict = {}
    with serving(system, logs, record) as server:
        if server is None:
            return record["missing"]
        # Unmeasured: a device compiles its kernels for each shape on first use, and the
        # top concurrency meets every batch shape the measured runs do.
        measure(server, system, "warm-up", shared_prefix(
            TextMaker(model, seed=5000), 1, settings.parallel, settings.sizes.prefix_tokens,
            settings.sizes.question_tokens), settings.parallel, settings.output_tokens)
        run_levels(server, system, settings, model, into)
        figures = asyncio.run(cached_prefix(
            server, system, TextMaker(model, seed=6000), settings,
            (lambda: gateway_metrics(server)) if system.name == "prefixgate" else None))
        into.cold_ttft, into.hit_ttft = figures["cold_ttft"], figures["hit_ttft"]
        into.load_ms, into.loaded_tokens = figures["load_ms"], figures["loaded_tokens"]
        into.memory = memory_of(server, system)
        into.kv_cells = system.kv_cells
        into.cell_bytes = kv_cell_bytes(server, system, into)
    return None


@dataclass(frozen=True)
class Row:
    label: str
    values: tuple[float | None, float | None]  # prefixgate's, llama-server's
    digits: int
    ratio: bool = True  # prefixgate / llama-server is worth a column

    def markdown(self) -> str:
        ours, theirs = self.values
        cells = ["-" if v is None else f"{v:.{self.digits}f}" for v in self.values]
        ratio = f"{ours / theirs:.2f}x" if self.ratio and ours and theirs else "-"
        return f"| {self.label} | {cells[0]} | {cells[1]} | {ratio} |"


def rows(settings: GpuSettings, measured: dict[str, Measured], where: list[str]) -> list[Row]:
    ours, theirs = (measured[name] for name in SYSTEM_NAMES)

    def both(get: Callable[[Measured], float | None]) -> tuple[float | None, float | None]:
        return get(ours), get(theirs)

    def run_figure(workload: str, level: int, *path: str) -> Callable[[Measured], float | None]:
        def get(m: Measured) -> float | None:
            value = m.runs.get((workload, level))
            for key in path:
                value = value.get(key) if isinstance(value, dict) else None
            return value
        return get

    table = []
    for level in settings.concurrency:
        for workload, name in (("shared_prefix", "shared prefix"), ("multi_turn", "multi-turn")):
            table += [Row(f"{name}, concurrency {level}: TTFT p50 (s)",
                          both(run_figure(workload, level, "ttft", "p50")), 3),
                      Row(f"{name}, concurrency {level}: output throughput (tok/s)",
                          both(run_figure(workload, level, "output_throughput")), 1)]
        table.append(Row(f"multi-turn, concurrency {level}: TTFT p50 of turns 2+ (s)",
                         both(run_figure("multi_turn", level, "later_turns_ttft")), 3))
    n = settings.sizes.prefix_tokens
    table += [
        Row(f"{n}-token prefix computed on the device: TTFT p50 (s)",
            both(lambda m: m.cold_ttft), 3),
        Row("the same prefix cached (prefixgate: loaded from the pool; llama-server: kept in "
            "its slot): TTFT p50 (s)", both(lambda m: m.hit_ttft), 3),
        Row("pool load into the device, per cached request (ms; tokens loaded: "
            f"{_count(ours.loaded_tokens)})", both(lambda m: m.load_ms), 2, ratio=False)]
    device = "+".join(where) if settings.backend != "cpu" else "the host"
    for kind, label in (("model", "weights"), ("KV", "KV"), ("compute", "compute buffers")):
        table.append(Row(f"{label} on {device} (MiB)",
                         both(lambda m, k=kind: _on(m, where, k) / MIB if m.memory else None),
                         1))
    table.append(Row(f"KV on {device} per sequence (its KV buffers / {settings.parallel} "
                     f"sequences of {ours.kv_cells or theirs.kv_cells} cells; prefixgate's "
                     "include its prefill context; MiB)",
                     both(lambda m: _on(m, where, "KV") / settings.parallel / MIB
                          if m.memory else None), 2))
    top = settings.parallel
    table.append(Row(
        f"KV on {device} held per live session, shared prefix at concurrency {top} (MiB; "
        "prefixgate: peak cells in use / sessions; llama-server: each slot's own prompt and "
        "answer, computed)", (_held(ours, top, shared=True), _held(theirs, top, shared=False)),
        2))
    return table


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _on(m: Measured, where: list[str], kind: str) -> int:
    return sum(nbytes for (buffer, k), nbytes in m.memory.items() if buffer in where and k == kind)


def _held(m: Measured, sessions: int, shared: bool) -> float | None:
    """MiB of device KV each live session holds: prefixgate's measured peak of cells in use
    (sessions share the prefix's cells); for llama-server, whose slots share no cells, each
    request's prompt and answer."""
    run = m.runs.get(("shared_prefix", sessions))
    if not m.cell_bytes or run is None or run["requests"] == run["failed"]:
        return None
    if shared:
        return run["peak_cells"] * m.cell_bytes / sessions / MIB
    output_tokens = run["output_throughput"] * run["wall_seconds"]  # as summarize() counts it
    tokens = (run["prompt_tokens"] + output_tokens) / (run["requests"] - run["failed"])
    return tokens * m.cell_bytes / MIB


def report(settings: GpuSettings, found: list[Device], measured: dict[str, Measured],
           missing: dict[str, str]) -> str:
    where = [d.name for d in found] or ["CPU", "CPU_Mapped"]
    ours, theirs = offload_flags(settings.backend)
    lines = [f"## prefixgate and llama-server on {BACKENDS[settings.backend]}", ""]
    if fake := software(found):
        lines += [f"**{', '.join(d.name for d in fake)} is a software device "
                  f"({'; '.join(d.description for d in fake)}: Mesa's driver running on the "
                  "CPU). Every speed figure below is meaningless: this run only shows that the "
                  "benchmark works. Run the same command on a real GPU for its figures.**", ""]
    lines += [f"Devices: {'; '.join(d.describe() for d in found) or 'none (CPU build)'}. Model "
              f"{settings.model.name}; prefixgate `{' '.join(ours)}`, llama-server "
              f"`{' '.join(theirs)}`; both {settings.parallel} parallel sequences in "
              f"{settings.ctx_size * settings.parallel} unified KV cells, {settings.threads} "
              f"threads. Workloads: {settings.describe()}.", "",
              "| figure | prefixgate | llama-server | prefixgate / llama-server |",
              "|---|---:|---:|---:|"]
    lines += [row.markdown() for row in rows(settings, measured, where)]
    lines += ["", *(f"{name}: not run: {why}" for name, why in missing.items())]
    return "\n".join(lines).rstrip() + "\n"


def run(settings: GpuSettings) -> str:
    found = offload_devices(settings.backend)
    if fake := software(found):
        print(f"{fake[0].describe()} is a software device: the speed figures will be "
              "meaningless", flush=True)
    model = Model(str(settings.model), vocab_only=True)
    measured, missing = {name: Measured() for name in SYSTEM_NAMES}, {}
    # The servers' logs, a folder a run: a server appends to its log, and llama-server's
    # memory is read from its own start-up lines.
    logs = ROOT / "loadtest" / "results" / f"gpu-{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"server logs: {logs}", flush=True)
    try:
        for name, system in systems(settings).items():
            if why := measure_system(system, settings, model, logs, measured[name]):
                missing[name] = why
    finally:
        model.close()
    return report(settings, found, measured, missing)


def parse_args(argv: list[str] | None = None) -> GpuSettings:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=BACKENDS, required=True,
                   help="the backend both servers are built for (cpu: a smoke test without one)")
    p.add_argument("--model", type=Path, default=None, help="default: SmolLM2 135M")
    p.add_argument("--llama-server", type=Path, default=None,
                   help="default: .bench/llama-server-BACKEND (loadtest/build_llama_server.sh)")
    # Defaults: (the full run's, --smoke's).
    p.add_argument("--concurrency", type=int, nargs="+", help="default: 1 8 (smoke: 1 2)")
    p.add_argument("--output-tokens", type=int, help="default: 32 (smoke: 8)")
    p.add_argument("--hit-rounds", type=int,
                   help="prefixes computed, then asked again cached; default: 3 (smoke: 1)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--ctx-size", type=int, help="KV cells per sequence; default: 2048 (smoke: 512)")
    p.add_argument("--smoke", action="store_true",
                   help="bench.py's tiny workloads and the smaller defaults: a software device "
                        "or a test runs it in a minute or two")
    args = p.parse_args(argv)
    smoke = int(args.smoke)

    def given(value: object, defaults: tuple) -> object:
        return defaults[smoke] if value is None else value

    return GpuSettings(
        backend=args.backend, model=args.model or default_model_path(),
        llama_server=args.llama_server or default_llama_server(args.backend),
        concurrency=given(args.concurrency, ([1, 8], [1, 2])), sizes=(FULL, SMOKE)[smoke],
        output_tokens=given(args.output_tokens, (32, 8)),
        hit_rounds=given(args.hit_rounds, (3, 1)), threads=args.threads,
        ctx_size=given(args.ctx_size, (2048, 512)))


def main() -> None:
    print(run(parse_args()))


if __name__ == "__main__":
    main()
