"""Benchmark runner: the same seeded workloads against several OpenAI-compatible servers, each
started here on a loopback port with the same GGUF file, thread count and parallel sequences.

    python -m loadtest.bench                      # the full comparison (tens of minutes)
    python -m loadtest.bench --smoke              # seconds: tiny workloads, prefixgate only

Per system: single-request prefill once, then the per-level workloads at every concurrency level;
last, the many-streams workload, with every system started afresh for each number of streams.
Writes a JSON file per run and a markdown table (and PNG plots unless --no-plots) to --out; with
--docs, also docs/benchmarks.md. A system that cannot be started is reported, not left out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from aiohttp import ClientSession, ClientTimeout, TCPConnector

from engine.llama import Model
from gateway.core.conversation import Message
from gateway.formats.prompts import PromptBuilder
from gateway.workers.model_store import default_model_path
from loadtest.client import stream_chat
from loadtest.gateway_process import ROOT, ServerProcess
from loadtest.stats import summarize
from loadtest.workloads import (
    Conversation,
    TextMaker,
    many_streams,
    multi_turn,
    shared_prefix,
    structured,
    unique_prompts,
)

SYSTEMS = ("prefixgate", "prefixgate-no-cache", "prefixgate-deterministic", "llama-server",
           "llama-cpp-python")
# Its server answers one request at a time: N streams would take N single requests' time.
STREAMS_SKIPPED = ("llama-cpp-python",)
STREAMS_NOTE = (
    "Every system is started afresh for each number of streams N, with N parallel sequences, and "
    "gets all N requests at once; the wall time runs from the first request sent to the last "
    "answer. KV cells in all (the column below): prefixgate gets room for the system prompt once "
    "plus every stream's question, answer and chat-template tokens, since its streams share the "
    "prompt's cells; prefixgate-no-cache, prefixgate-deterministic and llama-server get room for "
    "a copy of the prompt in every stream (llama-server: `-c` that many with `-kvu`), since they "
    "share no cells: llama-server's slots keep their own copies, the deterministic mode has one "
    "KV stream per sequence, and without the cache streams arriving together each compute the "
    "prompt. Both with a quarter more as margin, prefixgate at least 4096. llama-cpp-python is "
    "not run: its server answers one request at a time.")


@dataclass
class System:
    name: str
    command: list[str]
    health_path: str
    extra_body: dict = field(default_factory=dict)
    kv_cells: int = 0  # in all, as given on its command line
    missing: str | None = None  # why it cannot run here
    cwd: Path = ROOT  # the checkout it runs from


@dataclass
class Settings:
    model: Path
    threads: int
    parallel: int
    ctx_size: int  # KV cells per sequence
    concurrency: list[int]
    streams: list[int]
    output_tokens: int
    smoke: bool
    gateway_args: list[str] = field(default_factory=list)
    workloads: list[str] = field(default_factory=lambda: list(LEVEL_WORKLOADS))
    requests_scale: int = 1


@dataclass(frozen=True)
class Layout:
    """Sequences a server decodes together and its KV cells in all."""
    parallel: int
    shared_cells: int  # for prefixgate with its cache: sequences share a common prefix's cells
    private_cells: int  # for servers whose every sequence keeps its own copy of its prompt


def level_layout(settings: Settings) -> Layout:
    cells = settings.ctx_size * settings.parallel
    return Layout(settings.parallel, cells, cells)


def stream_layout(sizes: Sizes, output_tokens: int, n: int) -> Layout:
    """Cells for n streams on one system prompt (see STREAMS_NOTE)."""
    # The chat template's tokens, with room to spare.
    own = sizes.stream_question_tokens + output_tokens + 32
    # A quarter more: running short would measure preemptions or rejected requests instead.
    shared = _round_up(1.25 * (sizes.stream_prompt_tokens + n * own), 256)
    private = _round_up(1.25 * n * (sizes.stream_prompt_tokens + own), 256)
    return Layout(n, max(4096, shared), private)


def _round_up(value: float, step: int) -> int:
    return math.ceil(value / step) * step


def gateway_system(name: str, model: Path, threads: int, parallel: int, cells: int,
                   *flags: str) -> System:
    return System(name, [sys.executable, "-m", "gateway", "--model", str(model), "--threads",
                         str(threads), "--parallel", str(parallel), "--ctx-size", str(cells),
                         "--port", "{port}", *flags],
                  "/health", {"ignore_eos": True}, kv_cells=cells)


def llama_server_system(binary: Path, model: Path, threads: int, parallel: int,
                        cells: int) -> System:
    """llama-server with its defaults but for one unified pool of `cells` for `parallel` slots
    and the prompt cache's RAM, as the benchmarks compare with it."""
    server = System("llama-server", [
        str(binary), "-m", str(model), "-t", str(threads), "-np", str(parallel), "-kvu",
        "--port", "{port}", "--host", "127.0.0.1", "-c", str(cells), "--cache-ram", "8192"],
        "/health", {"ignore_eos": True}, kv_cells=cells)
    if not binary.exists():
        server.missing = f"{binary} not built (loadtest/build_llama_server.sh)"
    return server


def systems(settings: Settings, llama_server: Path, eog_tokens: list[int],
            layout: Layout) -> dict[str, System]:
    m, t = str(settings.model), str(settings.threads)

    def gateway(name: str, cells: int, *flags: str) -> System:
        return gateway_system(name, settings.model, settings.threads, layout.parallel, cells,
                              *settings.gateway_args, *flags)

    server = llama_server_system(llama_server, settings.model, settings.threads,
                                 layout.parallel, layout.private_cells)
    n_ctx = layout.private_cells // layout.parallel  # it serves one sequence
    python_server = System("llama-cpp-python", [
        sys.executable, "-m", "llama_cpp.server", "--model", m, "--n_threads", t,
        "--n_ctx", str(n_ctx), "--cache", "true", "--port", "{port}",
        "--host", "127.0.0.1"], "/v1/models",
        # It has no ignore_eos: ban the end-of-generation tokens instead.
        {"logit_bias": {str(tok): -100 for tok in eog_tokens}}, kv_cells=n_ctx)
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError as exc:
        python_server.missing = f"llama-cpp-python[server] not installed ({exc})"
    return {s.name: s for s in [
        gateway("prefixgate", layout.shared_cells),
        gateway("prefixgate-no-cache", layout.private_cells, "--no-prefix-cache"),
        # --ctx-size is split evenly between its per-sequence KV streams.
        gateway("prefixgate-deterministic", layout.private_cells, "--deterministic"),
        server, python_server]}


class RunningServer(ServerProcess):
    def __init__(self, system: System, log_dir: Path) -> None:
        super().__init__(system.command, system.health_path, log_dir / f"{system.name}.log",
                         cwd=system.cwd)
        self.peak_rss = 0
        try:
            with urllib.request.urlopen(self.base_url + "/v1/models", timeout=10) as r:
                self.model_id = json.loads(r.read())["data"][0]["id"]
        except Exception:
            self.stop()  # nobody else holds it to stop it
            raise

    def sample_rss(self) -> None:
        """Memory of the server and its children (prefixgate's engine workers): the sum of
        their proportional set sizes, so that pages they share (the block arena, mapped by the
        gateway and every worker) count once, as in a single process."""
        rss, pids = 0, [self.proc.pid]
        while pids:
            pid = pids.pop()
            try:
                rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
                for task in Path(f"/proc/{pid}/task").iterdir():  # a child's parent is a thread
                    pids += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            rss += next(int(line.split()[1]) * 1024 for line in rollup.splitlines()
                        if line.startswith("Pss:"))
        self.peak_rss = max(self.peak_rss, rss)


@contextmanager
def serving(system: System, log_dir: Path, record: dict) -> Iterator[RunningServer | None]:
    """`system` running, or None when it cannot run here: `record` gets why, or its peak
    resident memory."""
    record["missing"] = system.missing
    server = None
    if not system.missing:
        try:
            server = RunningServer(system, log_dir)
        except Exception as exc:
            record["missing"] = f"could not start: {exc}"
    if record["missing"]:
        print(f"{system.name}: not run: {record['missing']}", flush=True)
    try:
        yield server
    finally:
        if server:
            server.stop()
            record["peak_rss_bytes"] = server.peak_rss


async def run_workload(server: RunningServer, system: System, conversations: list[Conversation],
                       concurrency: int, max_tokens: int) -> tuple[list[dict], float]:
    """Runs every conversation, at most `concurrency` requests in flight."""
    limit = asyncio.Semaphore(concurrency)
    rows: list[dict] = []

    async def converse(session: ClientSession, conversation: Conversation) -> None:
        messages = [{"role": "system", "content": conversation.system}] \
            if conversation.system else []
        for turn, user in enumerate(conversation.turns):
            messages.append({"role": "user", "content": user})
            structured_output = conversation.response_format is not None
            async with limit:
                record, answer = await stream_chat(
                    session, server.base_url, server.model_id, messages,
                    STRUCTURED_MAX_TOKENS if structured_output else max_tokens,
                    _extra(system, conversation), exact=not structured_output)
            rows.append({"turn": turn, "group": conversation.group, "record": record})
            messages.append({"role": "assistant", "content": answer})

    async def sample_memory() -> None:
        while True:
            server.sample_rss()
            await asyncio.sleep(0.2)

    sampler = asyncio.create_task(sample_memory())
    start = time.perf_counter()
    # A fresh connection per request: a server closing an idle keep-alive connection just as it
    # is reused would otherwise count against it. No connection limit: aiohttp's default of 100
    # would hold back the many-streams workload's requests beyond it.
    async with ClientSession(timeout=ClientTimeout(total=900),
                             connector=TCPConnector(force_close=True, limit=0)) as session:
        await asyncio.gather(*(converse(session, c) for c in conversations))
    wall = time.perf_counter() - start
    sampler.cancel()
    return rows, wall


def _extra(system: System, conversation: Conversation) -> dict:
    """The system's own request fields, and the workload's. A structured answer ends where its
    grammar does: nothing may hold back the end of generation then."""
    if conversation.response_format is None:
        return system.extra_body
    return {**{k: v for k, v in system.extra_body.items()
               if k not in ("ignore_eos", "logit_bias")},
            "response_format": conversation.response_format}


def measure(server: RunningServer, system: System, workload: str, conversations: list[Conversation],
            concurrency: int, max_tokens: int) -> tuple[dict, list[dict]]:
    """One workload's run, as the report reads it, and its rows."""
    rows, wall = asyncio.run(run_workload(server, system, conversations, concurrency, max_tokens))
    run = {"system": system.name, "workload": workload, "concurrency": concurrency,
           **summarize([r["record"] for r in rows], wall),
           "ttft_samples": [r["record"].ttft for r in rows if r["record"].ok]}
    return run, rows


def announce(run: dict) -> None:
    prefill = run.get("prefill_tokens_per_s")
    print(f"{run['system']} {run['workload']} c={run['concurrency']}: "
          f"{run['output_throughput']:.1f} tok/s, wall {run['wall_seconds']:.1f} s, "
          f"TTFT p50 {run['ttft']['p50']}, " + (f"prefill {prefill:.0f} tok/s, " if prefill else "")
          + f"failed {run['failed']}", flush=True)


@dataclass(frozen=True)
class Sizes:
    groups: int
    prompts_per_group: int
    prefix_tokens: int
    question_tokens: int
    conversations: int
    turns: int
    system_tokens: int
    turn_tokens: int
    unique_prompts: int
    structured_prompts: int
    unique_tokens: int
    prefill_requests: int
    prefill_tokens: int
    stream_prompt_tokens: int
    stream_question_tokens: int

    def scaled(self, k: int) -> Sizes:
        """k times the requests of every per-level workload: a closed loop's start and end
        then weigh less in its figures."""
        return replace(self, groups=self.groups * k, conversations=self.conversations * k,
                       unique_prompts=self.unique_prompts * k,
                       structured_prompts=self.structured_prompts * k)

    def describe(self) -> str:
        return (f"shared prefix = {self.groups} groups x {self.prompts_per_group} prompts, each a "
                f"{self.prefix_tokens}-token system prompt + a {self.question_tokens}-token "
                f"question; multi-turn = {self.conversations} conversations x {self.turns} turns "
                f"({self.system_tokens}-token system prompt, {self.turn_tokens}-token user turns, "
                f"whole history resent); unique = {self.unique_prompts} prompts of "
                f"{self.unique_tokens} tokens with their own system message; structured = "
                f"{self.structured_prompts} such prompts asking for a JSON record that follows "
                f"a schema (response_format json_schema: nested object, array of enums, bounded "
                f"strings), up to {STRUCTURED_MAX_TOKENS} tokens, ending where the grammar does; "
                f"prefill = "
                f"{self.prefill_requests} requests one after another, each a "
                f"{self.prefill_tokens}-token prompt with its own system message, 1 output token; "
                f"many streams = N requests at once, one {self.stream_prompt_tokens}-token system "
                f"prompt shared by all + a {self.stream_question_tokens}-token question each")


FULL = Sizes(groups=2, prompts_per_group=8, prefix_tokens=1024, question_tokens=64,
             conversations=4, turns=3, system_tokens=256, turn_tokens=64,
             unique_prompts=16, unique_tokens=256, structured_prompts=8, prefill_requests=3,
             prefill_tokens=1024,
             stream_prompt_tokens=400, stream_question_tokens=16)
SMOKE = Sizes(groups=1, prompts_per_group=3, prefix_tokens=64, question_tokens=8,
              conversations=2, turns=2, system_tokens=32, turn_tokens=8,
              unique_prompts=2, unique_tokens=32, structured_prompts=2, prefill_requests=1,
              prefill_tokens=64,
              stream_prompt_tokens=32, stream_question_tokens=8)
LEVEL_WORKLOADS = ("shared_prefix", "multi_turn", "unique", "structured")
# A JSON record is ~60-100 tokens: room for the grammar to finish it.
STRUCTURED_MAX_TOKENS = 200
# Seeds of the workloads measured once (levels use 1000 + level): no prompt repeats another's.
PREFILL_SEED, STREAMS_SEED = 2000, 3000


def make_workloads(sizes: Sizes, model: Model, level: int) -> dict[str, list[Conversation]]:
    """Fresh prompts for each concurrency level, so every level starts with a cold cache."""
    maker = TextMaker(model, seed=1000 + level)
    return {"shared_prefix": shared_prefix(maker, sizes.groups, sizes.prompts_per_group,
                                           sizes.prefix_tokens, sizes.question_tokens),
            "multi_turn": multi_turn(maker, sizes.conversations, sizes.turns,
                                     sizes.system_tokens, sizes.turn_tokens),
            "unique": unique_prompts(maker, sizes.unique_prompts, sizes.unique_tokens),
            "structured": structured(maker, sizes.structured_prompts, sizes.unique_tokens)}


def run_levels(server: RunningServer, system: System, sizes: Sizes, model: Model,
               settings: Settings) -> list[dict]:
    runs = []
    for level in settings.concurrency:
        for workload, conversations in make_workloads(sizes, model, level).items():
            if workload not in settings.workloads:
                continue
            run, rows = measure(server, system, workload, conversations, level,
                                settings.output_tokens)
            run["per_turn"] = per_turn(rows) if workload == "multi_turn" else None
            announce(run)
            runs.append(run)
    return runs


def run_prefill(server: RunningServer, system: System, sizes: Sizes, model: Model) -> dict:
    """Prefill speed of one request alone: prompt tokens / TTFT, the median of a few."""
    conversations = unique_prompts(TextMaker(model, seed=PREFILL_SEED), sizes.prefill_requests,
                                   sizes.prefill_tokens)
    # Counted here, the same for every system: llama-cpp-python's server streams no usage.
    builder = PromptBuilder(model)
    prompt_tokens = [len(builder.chat([Message(role="system", content=c.system),
                                       Message(role="user", content=c.turns[0])]).tokens)
                     for c in conversations]
    run, rows = measure(server, system, "prefill", conversations, 1, max_tokens=1)
    rates = [prompt_tokens[r["group"]] / r["record"].ttft for r in rows if r["record"].ok]
    run.update(prefill_prompt_tokens=statistics.median(prompt_tokens), prefill_samples=rates,
               prefill_tokens_per_s=statistics.median(rates) if rates else None)
    announce(run)
    return run


def run_streams(server: RunningServer, system: System, sizes: Sizes, model: Model, n: int,
                output_tokens: int) -> dict:
    conversations = many_streams(TextMaker(model, seed=STREAMS_SEED + n), n,
                                 sizes.stream_prompt_tokens, sizes.stream_question_tokens)
    run, _ = measure(server, system, "many_streams", conversations, n, output_tokens)
    announce(run)
    return run


def run(settings: Settings, names: list[str], llama_server: Path, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    model = Model(str(settings.model))
    sizes = (SMOKE if settings.smoke else FULL).scaled(settings.requests_scale)
    results: dict = {"machine": machine_info(settings), "workloads": sizes.describe(),
                     "streams_note": STREAMS_NOTE, "systems": {}, "runs": [], "prefill": [],
                     "streams": []}
    path = out / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"

    def save() -> None:  # after each server and on a crash: a long run keeps what it measured
        path.write_text(json.dumps(results, indent=1))

    eog_tokens = [int(t) for t in model.eog_tokens]
    at_levels = systems(settings, llama_server, eog_tokens, level_layout(settings))
    try:
        for name in names if settings.concurrency else []:
            system = at_levels[name]
            record = results["systems"][name] = {"kv_cells": system.kv_cells}
            with serving(system, out, record) as server:
                if server:
                    results["prefill"].append(run_prefill(server, system, sizes, model))
                    results["runs"] += run_levels(server, system, sizes, model, settings)
            save()
        for n in settings.streams:
            with_n = systems(settings, llama_server, eog_tokens,
                             stream_layout(sizes, settings.output_tokens, n))
            for name in (name for name in names if name not in STREAMS_SKIPPED):
                system = with_n[name]
                entry = {"system": name, "workload": "many_streams", "concurrency": n,
                         "kv_cells": system.kv_cells}
                results["streams"].append(entry)
                with serving(system, out, entry) as server:
                    if server:
                        entry.update(run_streams(server, system, sizes, model, n,
                                                 settings.output_tokens))
                save()
    finally:
        save()
        model.close()
    return results


def per_turn(rows: list[dict]) -> list[dict]:
    turns = sorted({r["turn"] for r in rows})
    return [{"turn": t, **{k: v for k, v in summarize(
        [r["record"] for r in rows if r["turn"] == t], 1.0).items()
        if k in ("cached_share", "ttft", "failed")}} for t in turns]


def machine_info(settings: Settings) -> dict:
    return {"platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "model": settings.model.name,
            "threads": settings.threads, "parallel": settings.parallel,
            "ctx_size": settings.ctx_size, "output_tokens": settings.output_tokens}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 8, 16],
                   help="concurrency levels of the per-level workloads (none: skip them and "
                        "the prefill measurement)")
    p.add_argument("--streams", type=int, nargs="*", default=[64, 128],
                   help="streams at once of the many-streams workload (none: skip it)")
    p.add_argument("--no-streams", action="store_true", help="skip the many-streams workload")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--parallel", type=int, default=8)
    p.add_argument("--ctx-size", type=int, default=4096, help="KV cells per sequence")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--llama-server", type=Path, default=ROOT / ".bench" / "llama-server")
    p.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results")
    p.add_argument("--docs", type=Path, default=None, help="also write this markdown page")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny workloads, prefixgate only")
    p.add_argument("--workloads", nargs="+", choices=LEVEL_WORKLOADS,
                   default=list(LEVEL_WORKLOADS), help="the per-level workloads to run")
    p.add_argument("--requests-scale", type=int, default=1,
                   help="k times the requests of every per-level workload (less noise, k "
                        "times as long)")
    p.add_argument("--gateway-args", nargs="+", default=[],
                   help="extra flags for prefixgate, e.g. --gateway-args=--batch-tokens=128")
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    streams = [] if args.no_streams or not args.streams else [4] if args.smoke else args.streams
    return Settings(model=args.model or default_model_path(), threads=args.threads,
                    parallel=args.parallel, ctx_size=args.ctx_size,
                    concurrency=[2] if args.smoke else args.concurrency, streams=streams,
                    output_tokens=8 if args.smoke else args.output_tokens, smoke=args.smoke,
                    gateway_args=args.gateway_args, workloads=args.workloads,
                    requests_scale=args.requests_scale)


def main() -> None:
    from loadtest.report import write_report

    args = parse_args()
    names = ["prefixgate"] if args.smoke else args.systems
    results = run(settings_from(args), names, args.llama_server, args.out)
    table = write_report(results, args.out, plots=not args.no_plots)
    if args.docs:
        args.docs.parent.mkdir(parents=True, exist_ok=True)
        for png in args.out.glob("*.png"):
            shutil.copy(png, args.docs.parent / png.name)
        args.docs.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
