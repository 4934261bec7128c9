"""Benchmark runner: the same seeded workloads against several OpenAI-compatible servers, each
started here on a loopback port with the same GGUF file, thread count and parallel sequences.

    python -m loadtest.bench                      # the full comparison (tens of minutes)
    python -m loadtest.bench --smoke              # seconds: tiny workloads, prefixgate only

Writes a JSON file per run and a markdown table (and PNG plots unless --no-plots) to --out; with
--docs, also docs/benchmarks.md. A system that cannot be started is reported, not left out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import ClientSession, ClientTimeout, TCPConnector

from gateway.llama import Model
from gateway.model_store import default_model_path
from loadtest.client import stream_chat
from loadtest.gateway_process import ROOT, ServerProcess
from loadtest.stats import summarize
from loadtest.workloads import Conversation, TextMaker, multi_turn, shared_prefix, unique_prompts


@dataclass
class System:
    name: str
    command: list[str]
    health_path: str
    extra_body: dict = field(default_factory=dict)
    missing: str | None = None  # why it cannot run here


@dataclass
class Settings:
    model: Path
    threads: int
    parallel: int
    ctx_size: int
    concurrency: list[int]
    output_tokens: int
    smoke: bool
    gateway_args: list[str] = field(default_factory=list)


def systems(settings: Settings, llama_server: Path, eog_tokens: list[int]) -> dict[str, System]:
    m, t, n = str(settings.model), str(settings.threads), str(settings.parallel)
    gateway = [sys.executable, "-m", "gateway", "--model", m, "--threads", t, "--parallel", n,
               "--ctx-size", str(settings.ctx_size), "--port", "{port}", *settings.gateway_args]
    server = System("llama-server", [
        str(llama_server), "-m", m, "-t", t, "-np", n, "-kvu", "--port", "{port}",
        "--host", "127.0.0.1", "-c", str(settings.ctx_size * settings.parallel),
        "--cache-ram", "8192"], "/health", {"ignore_eos": True})
    if not llama_server.exists():
        server.missing = f"{llama_server} not built (loadtest/build_llama_server.sh)"
    python_server = System("llama-cpp-python", [
        sys.executable, "-m", "llama_cpp.server", "--model", m, "--n_threads", t,
        "--n_ctx", str(settings.ctx_size), "--cache", "true", "--port", "{port}",
        "--host", "127.0.0.1"], "/v1/models",
        # It has no ignore_eos: ban the end-of-generation tokens instead.
        {"logit_bias": {str(tok): -100 for tok in eog_tokens}})
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError as exc:
        python_server.missing = f"llama-cpp-python[server] not installed ({exc})"
    return {
        "prefixgate": System("prefixgate", gateway, "/health", {"ignore_eos": True}),
        "prefixgate-no-cache": System("prefixgate-no-cache", [*gateway, "--no-prefix-cache"],
                                      "/health", {"ignore_eos": True}),
        "llama-server": server,
        "llama-cpp-python": python_server,
    }


class RunningServer(ServerProcess):
    def __init__(self, system: System, log_dir: Path) -> None:
        super().__init__(system.command, system.health_path, log_dir / f"{system.name}.log")
        self.peak_rss = 0
        with urllib.request.urlopen(self.base_url + "/v1/models", timeout=10) as r:
            self.model_id = json.loads(r.read())["data"][0]["id"]

    def sample_rss(self) -> None:
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                self.peak_rss = max(self.peak_rss, int(line.split()[1]) * 1024)


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
            async with limit:
                record, answer = await stream_chat(session, server.base_url, server.model_id,
                                                   messages, max_tokens, system.extra_body)
            rows.append({"turn": turn, "group": conversation.group, "record": record})
            messages.append({"role": "assistant", "content": answer})

    async def sample_memory() -> None:
        while True:
            server.sample_rss()
            await asyncio.sleep(0.2)

    sampler = asyncio.create_task(sample_memory())
    start = time.perf_counter()
    # A fresh connection per request: a server closing an idle keep-alive connection just as it
    # is reused would otherwise count against it.
    async with ClientSession(timeout=ClientTimeout(total=900),
                             connector=TCPConnector(force_close=True)) as session:
        await asyncio.gather(*(converse(session, c) for c in conversations))
    wall = time.perf_counter() - start
    sampler.cancel()
    return rows, wall


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
    unique_tokens: int

    def describe(self) -> str:
        return (f"shared prefix = {self.groups} groups x {self.prompts_per_group} prompts, each a "
                f"{self.prefix_tokens}-token system prompt + a {self.question_tokens}-token "
                f"question; multi-turn = {self.conversations} conversations x {self.turns} turns "
                f"({self.system_tokens}-token system prompt, {self.turn_tokens}-token user turns, "
                f"whole history resent); unique = {self.unique_prompts} prompts of "
                f"{self.unique_tokens} tokens with their own system message")


FULL = Sizes(2, 8, 1024, 64, 4, 3, 256, 64, 16, 256)
SMOKE = Sizes(1, 3, 64, 8, 2, 2, 32, 8, 2, 32)


def make_workloads(sizes: Sizes, model: Model, level: int) -> dict[str, list[Conversation]]:
    """Fresh prompts for each concurrency level, so every level starts with a cold cache."""
    maker = TextMaker(model, seed=1000 + level)
    return {"shared_prefix": shared_prefix(maker, sizes.groups, sizes.prompts_per_group,
                                           sizes.prefix_tokens, sizes.question_tokens),
            "multi_turn": multi_turn(maker, sizes.conversations, sizes.turns,
                                     sizes.system_tokens, sizes.turn_tokens),
            "unique": unique_prompts(maker, sizes.unique_prompts, sizes.unique_tokens)}


def run(settings: Settings, names: list[str], llama_server: Path, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    model = Model(str(settings.model))
    available = systems(settings, llama_server, [int(t) for t in model.eog_tokens])
    results: dict = {"machine": machine_info(settings), "systems": {}, "runs": [],
                     "workloads": (SMOKE if settings.smoke else FULL).describe()}
    path = out / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    for name in names:
        system = available[name]
        results["systems"][name] = {"missing": system.missing}
        if system.missing:
            print(f"{name}: not run: {system.missing}", flush=True)
            continue
        try:
            server = RunningServer(system, out)
        except Exception as exc:
            results["systems"][name]["missing"] = f"could not start: {exc}"
            print(f"{name}: could not start: {exc}", flush=True)
            continue
        try:
            for level in settings.concurrency:
                sizes = SMOKE if settings.smoke else FULL
                for workload, conversations in make_workloads(sizes, model, level).items():
                    rows, wall = asyncio.run(run_workload(
                        server, system, conversations, level, settings.output_tokens))
                    summary = summarize([r["record"] for r in rows], wall)
                    summary["per_turn"] = per_turn(rows) if workload == "multi_turn" else None
                    summary["ttft_samples"] = [r["record"].ttft for r in rows
                                               if r["record"].ok]
                    results["runs"].append({"system": name, "workload": workload,
                                            "concurrency": level, **summary})
                    print(f"{name} {workload} c={level}: {summary['output_throughput']:.1f} "
                          f"tok/s, TTFT p50 {summary['ttft']['p50']}, "
                          f"failed {summary['failed']}", flush=True)
        finally:
            server.stop()
            results["systems"][name]["peak_rss_bytes"] = server.peak_rss
            path.write_text(json.dumps(results, indent=1))  # after each system: a long run
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


def main() -> None:
    from loadtest.report import write_report

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--systems", nargs="+", default=["prefixgate", "prefixgate-no-cache",
                                                    "llama-server", "llama-cpp-python"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--parallel", type=int, default=8)
    p.add_argument("--ctx-size", type=int, default=4096)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--llama-server", type=Path, default=ROOT / ".bench" / "llama-server")
    p.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results")
    p.add_argument("--docs", type=Path, default=None, help="also write this markdown page")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny workloads, prefixgate only")
    p.add_argument("--gateway-args", nargs="+", default=[],
                   help="extra flags for prefixgate, e.g. --gateway-args=--batch-tokens=128")
    args = p.parse_args()
    settings = Settings(model=args.model or default_model_path(), threads=args.threads,
                        parallel=args.parallel, ctx_size=args.ctx_size,
                        concurrency=[2] if args.smoke else args.concurrency,
                        output_tokens=8 if args.smoke else args.output_tokens, smoke=args.smoke,
                        gateway_args=args.gateway_args)
    names = ["prefixgate"] if args.smoke else args.systems
    results = run(settings, names, args.llama_server, args.out)
    table = write_report(results, args.out, plots=not args.no_plots)
    if args.docs:
        args.docs.parent.mkdir(parents=True, exist_ok=True)
        for png in args.out.glob("*.png"):
            shutil.copy(png, args.docs.parent / png.name)
        args.docs.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
