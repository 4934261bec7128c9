"""Several models behind one server, side by side with llama-server's router mode (issue 53's
benchmark).

    python -m loadtest.models_bench [--sessions 8] [--turns 3] [--idle-seconds 4]

Both servers get one directory of symlinks to the same two GGUFs (SmolLM2 135M and Gemma 3 270M),
the same threads, parallel sequences and KV cells per model (llama-server's router hands its own
flags to each model's child server), and load models on first use. Three phases, each on
freshly started servers:

1. One model loaded at a time (prefixgate `--models-max 1 --cache-dir DIR`, llama-server
   `--models-max 1`): TTFT of a request to a model that is not loaded (the other is: its unload,
   the load, the prefill), then of a second request to it, loaded; each with a fresh prompt of
   the same length, twice per model, the median.
2. Same servers, then the alternating workload at concurrency 4: multi-turn sessions, half on
   each model, interleaved, each model's sessions sharing its system prompt; the assistant turns
   are scripted (the same history on both servers whatever the models answer). Throughput,
   TTFT p50/p99 and swaps: loads during the workload, prefixgate's from its
   `prefixgate_model_loads_total`, llama-server's from its router's log (one "spawning server
   instance" line per child it starts, i.e. per load; its /models lists only the current state).
3. Memory: the proportional set size of the server's whole process tree (prefixgate's HTTP
   process and engine workers, the router and its children; PSS counts pages they share once)
   with both models loaded (prefixgate without --models-max, llama-server --models-max 2), and
   after one of them went idle while the other kept serving (prefixgate
   `--idle-unload-seconds`, llama-server `--sleep-idle-seconds`: its child then frees the model
   and its context but stays, asleep).

`--cold-probes`: phase 1 alone, both servers started together and probed in turn, round by
round (`--probe-rounds`): on a shared machine a round's two probes see the same load, which
runs of one server after the other do not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from aiohttp import ClientSession, ClientTimeout, TCPConnector

from engine.llama import Model
from gateway.workers.model_store import DEFAULT_MODEL, GEMMA3_270M, model_path
from loadtest.client import stream_chat
from loadtest.gateway_process import ROOT, ServerProcess, scrape
from loadtest.stats import RequestRecord, percentiles
from loadtest.workloads import TextMaker

SPAWN_LINE = re.compile(rb"spawning server instance with name=")


@dataclass(frozen=True)
class Sizes:
    sessions: int = 4  # half on each model
    turns: int = 3
    system_tokens: int = 384
    turn_tokens: int = 32  # each user message, and each scripted answer
    max_tokens: int = 8
    probe_tokens: int = 256  # the TTFT probes' prompts
    concurrency: int = 4
    seed: int = 53


@dataclass(frozen=True)
class Engine:
    threads: int
    parallel: int
    ctx_size: int  # KV cells per model, all its sequences together
    idle_seconds: int


def models_dir(out: Path) -> Path:
    """The two models in one directory of symlinks, as both servers read it."""
    directory = out / "models"
    directory.mkdir(parents=True, exist_ok=True)
    for packaged in (DEFAULT_MODEL, GEMMA3_270M):
        link = directory / packaged.file_name
        if not link.exists():
            link.symlink_to(model_path(packaged).resolve())
    return directory


class Server(ServerProcess):
    def __init__(self, name: str, command: list[str], log_dir: Path) -> None:
        self.name = name
        super().__init__(command, "/health", log_dir / f"{name}-{time.strftime('%H%M%S')}.log",
                         health_timeout=300)
        with urllib.request.urlopen(self.base_url + "/v1/models", timeout=10) as r:
            self.ids = [m["id"] for m in json.loads(r.read())["data"]]

    def model_id(self, filename: str) -> str:
        return next(i for i in self.ids if Path(filename).stem.startswith(i) or
                    i.startswith(Path(filename).stem))

    def states(self) -> dict[str, str]:
        with urllib.request.urlopen(self.base_url + "/v1/models", timeout=10) as r:
            return {m["id"]: (m.get("status") or {}).get("value", "?")
                    for m in json.loads(r.read())["data"]}

    def loads(self) -> int:
        """Models loaded so far."""
        if self.name == "prefixgate":
            return int(sum(s.value for s in scrape(self.base_url)
                           if s.name == "prefixgate_model_loads_total"))
        return len(SPAWN_LINE.findall(self.log_path.read_bytes()))

    def memory(self) -> int:
        """PSS of the server and every process under it, in bytes."""
        total, pids = 0, [self.proc.pid]
        while pids:
            pid = pids.pop()
            try:
                rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
                for task in Path(f"/proc/{pid}/task").iterdir():
                    pids += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            total += next(int(line.split()[1]) * 1024 for line in rollup.splitlines()
                          if line.startswith("Pss:"))
        return total


def prefixgate(log_dir: Path, directory: Path, engine: Engine, *flags: str) -> Server:
    return Server("prefixgate", [
        sys.executable, "-m", "gateway", "--models-dir", str(directory), "--host", "127.0.0.1",
        "--port", "{port}", "--threads", str(engine.threads), "--parallel", str(engine.parallel),
        "--ctx-size", str(engine.ctx_size), *flags], log_dir)


def llama_server(binary: Path, log_dir: Path, directory: Path, engine: Engine,
                 *flags: str) -> Server:
    # -kvu: one unified pool of -c cells for its -np sequences, as prefixgate's --ctx-size.
    return Server("llama-server", [
        str(binary), "--models-dir", str(directory), "--host", "127.0.0.1", "--port", "{port}",
        "-t", str(engine.threads), "-np", str(engine.parallel), "-kvu", "-c",
        str(engine.ctx_size), "--cache-ram", "8192", *flags], log_dir)


async def one(session: ClientSession, server: Server, model: str, messages: list[dict],
              max_tokens: int) -> RequestRecord:
    record, _ = await stream_chat(session, server.base_url, model, messages, max_tokens,
                                  {"ignore_eos": True})
    return record


def client() -> ClientSession:
    return ClientSession(timeout=ClientTimeout(total=900),
                         connector=TCPConnector(force_close=True, limit=0))


async def probes(server: Server, models: list[str], maker: TextMaker, sizes: Sizes,
                 rounds: int = 1) -> dict[str, dict[str, float]]:
    """Per model: TTFT while another model is loaded (cold) and once it is (warm), medians."""
    cold: dict[str, list[float]] = {m: [] for m in models}
    warm: dict[str, list[float]] = {m: [] for m in models}
    failed = 0

    def prompt() -> list[dict]:
        return [{"role": "system", "content": maker.text(16)},
                {"role": "user", "content": maker.text(sizes.probe_tokens)}]

    async with client() as session:
        for _ in range(rounds):
            for i, model in enumerate(models):
                other = models[(i + 1) % len(models)]
                await one(session, server, other, prompt(), 1)  # the other one loaded
                for bucket in (cold, warm):
                    record = await one(session, server, model, prompt(), 1)
                    failed += not record.ok
                    if record.ok:
                        bucket[model].append(record.ttft)
    return {m: {"cold": statistics.median(cold[m]) if cold[m] else None,
                "warm": statistics.median(warm[m]) if warm[m] else None} for m in models} | {
        "failed": failed}


def sessions(maker: TextMaker, sizes: Sizes) -> list[tuple[int, str, list[str], list[str]]]:
    """(model index, system prompt, user turns, scripted answers) per session, alternating."""
    systems = [maker.text(sizes.system_tokens) for _ in range(2)]
    return [(s % 2, systems[s % 2], [maker.text(sizes.turn_tokens) for _ in range(sizes.turns)],
             [maker.text(sizes.turn_tokens) for _ in range(sizes.turns)])
            for s in range(sizes.sessions)]


async def alternate(server: Server, models: list[str], work: list, sizes: Sizes) -> dict:
    limit = asyncio.Semaphore(sizes.concurrency)
    records: list[RequestRecord] = []

    async def converse(session: ClientSession, model: int, system: str, users: list[str],
                       answers: list[str]) -> None:
        messages = [{"role": "system", "content": system}]
        for user, answer in zip(users, answers, strict=True):
            messages.append({"role": "user", "content": user})
            async with limit:
                records.append(await one(session, server, models[model], list(messages),
                                         sizes.max_tokens))
            messages.append({"role": "assistant", "content": answer})

    loads = server.loads()
    start = time.perf_counter()
    async with client() as session:
        await asyncio.gather(*(converse(session, *w) for w in work))
    wall = time.perf_counter() - start
    time.sleep(0.5)  # a log line written just before the last answer
    ok = [r for r in records if r.ok]
    ttft = percentiles([r.ttft for r in ok])
    return {"requests": len(records), "failed": len(records) - len(ok), "wall": wall,
            "tokens_per_s": sum(r.output_tokens for r in ok) / wall,
            "requests_per_s": len(ok) / wall, "ttft_p50": ttft["p50"], "ttft_p99": ttft["p99"],
            "swaps": server.loads() - loads,
            "cached_share": sum(r.cached_tokens for r in ok) / max(1, sum(
                r.prompt_tokens for r in ok)),
            "errors": sorted({r.error for r in records if r.error})[:3]}


async def memory(server: Server, models: list[str], idle_seconds: int) -> dict:
    """PSS with both loaded; then with the second idle past `idle_seconds` while the first
    keeps serving (a short request every second)."""
    messages = [{"role": "user", "content": "Say something."}]
    async with client() as session:
        for model in models:
            await one(session, server, model, messages, 4)
        both = server.memory()
        deadline = time.monotonic() + idle_seconds + 30
        while True:
            await one(session, server, models[0], messages, 4)
            states = server.states()
            if states.get(models[1]) in ("unloaded", "sleeping") and \
                    states.get(models[0]) == "loaded":
                await asyncio.sleep(1)
                break
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(1)
        one_idle = server.memory()
    return {"both": both, "one_idle": one_idle, "states": states}


def run(args: argparse.Namespace) -> dict:
    sizes = Sizes(sessions=args.sessions, turns=args.turns, seed=args.seed)
    engine = Engine(threads=args.threads, parallel=args.parallel, ctx_size=args.ctx_size,
                    idle_seconds=args.idle_seconds)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    directory = models_dir(out)
    files = [DEFAULT_MODEL.file_name, GEMMA3_270M.file_name]
    vocab = Model(str(model_path(DEFAULT_MODEL)))
    results: dict = {"engine": engine.__dict__, "sizes": sizes.__dict__, "systems": {}}
    binary = args.llama_server
    if "llama-server" in args.systems and not binary.exists():
        sys.exit(f"{binary} not built: loadtest/build_llama_server.sh")
    cache_dir = out / f"cache-{time.strftime('%H%M%S')}"
    starts = {
        "prefixgate": lambda *f: prefixgate(out, directory, engine, *f),
        "llama-server": lambda *f: llama_server(binary, out, directory, engine, *f)}
    swap_flags = {"prefixgate": ("--models-max", "1", "--cache-dir", str(cache_dir)),
                  "llama-server": ("--models-max", "1")}
    memory_flags = {"prefixgate": ("--idle-unload-seconds", str(engine.idle_seconds)),
                    "llama-server": ("--models-max", "2", "--sleep-idle-seconds",
                                     str(engine.idle_seconds))}
    if args.cold_probes:
        results["systems"] = paired_probes(
            [starts[name](*swap_flags[name]) for name in args.systems], files,
            TextMaker(vocab, sizes.seed), sizes, args.probe_rounds)
        args.systems = []
    for name in args.systems:
        record = results["systems"][name] = {}
        server = starts[name](*swap_flags[name])
        try:
            models = [server.model_id(f) for f in files]
            record["probes"] = asyncio.run(probes(server, models, TextMaker(vocab, sizes.seed),
                                                  sizes, args.probe_rounds))
            print(name, "probes", record["probes"], flush=True)
            work = sessions(TextMaker(vocab, sizes.seed + 1), sizes)
            record["alternating"] = asyncio.run(alternate(server, models, work, sizes))
            print(name, "alternating", record["alternating"], flush=True)
        finally:
            server.stop()
        server = starts[name](*memory_flags[name])
        try:
            models = [server.model_id(f) for f in files]
            record["memory"] = asyncio.run(memory(server, models, engine.idle_seconds))
            print(name, "memory", record["memory"], flush=True)
        finally:
            server.stop()
    vocab.close()
    (out / f"models-bench-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(
        json.dumps(results, indent=1))
    return results


def paired_probes(servers: list[Server], files: list[str], maker: TextMaker, sizes: Sizes,
                  rounds: int) -> dict:
    """--cold-probes: phase 1 alone, the servers started together and probed in turn, round
    by round, the first of a round alternating (a round's probes see the same machine, which
    a busy one changes from second to second). Per server, the medians of its rounds."""
    samples: dict[str, list[dict]] = {server.name: [] for server in servers}
    try:
        for r in range(rounds):
            for server in servers if r % 2 == 0 else servers[::-1]:
                models = [server.model_id(f) for f in files]
                samples[server.name].append(asyncio.run(probes(server, models, maker, sizes)))
                print(server.name, "round", r, samples[server.name][-1], flush=True)
    finally:
        for server in servers:
            server.stop()
    def median(values: list[float | None]) -> float | None:
        kept = [v for v in values if v is not None]
        return statistics.median(kept) if kept else None

    return {name: {"probes": {model: {kind: median([s[model][kind] for s in rounds_])
                                      for kind in ("cold", "warm")}
                              for model in rounds_[0] if model != "failed"}
                   | {"failed": sum(s["failed"] for s in rounds_)}}
            for name, rounds_ in samples.items()}


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(results: dict) -> str:
    pg, ls = (results["systems"].get(n, {}) for n in ("prefixgate", "llama-server"))
    rows: list[tuple[str, float | None, float | None, str]] = []
    names = [k for k in pg.get("probes", {}) if k != "failed"]
    for model in names:
        theirs = ls.get("probes", {}).get(_match(model, ls.get("probes", {})), {})
        for kind in ("cold", "warm"):
            label = "not loaded (unload + load + prefill)" if kind == "cold" else "loaded"
            rows.append((f"TTFT, {model}, {label} (s)", pg["probes"][model][kind],
                         theirs.get(kind), "lower"))
        rows.append((f"TTFT, {model}, not loaded minus loaded: the swap (s)",
                     _minus(pg["probes"][model]), _minus(theirs), "lower"))
    for key, label, better in (("tokens_per_s", "alternating c=4: output tok/s", "higher"),
                               ("requests_per_s", "alternating c=4: req/s", "higher"),
                               ("ttft_p50", "alternating c=4: TTFT p50 (s)", "lower"),
                               ("ttft_p99", "alternating c=4: TTFT p99 (s)", "lower"),
                               ("swaps", "alternating c=4: swaps (loads)", "lower"),
                               ("cached_share", "alternating c=4: cached share of prompt",
                                "higher"),
                               ("failed", "alternating c=4: failed requests", "lower")):
        rows.append((label, pg.get("alternating", {}).get(key),
                     ls.get("alternating", {}).get(key), better))
    for key, label in (("both", "memory, both loaded (MiB)"),
                       ("one_idle", "memory, one idle-unloaded (MiB)")):
        a, b = (s.get("memory", {}).get(key) for s in (pg, ls))
        rows.append((label, a and a / 2**20, b and b / 2**20, "lower"))
    lines = ["| measure | prefixgate | llama-server | prefixgate / llama-server |",
             "|---|---|---|---|"]
    for label, a, b, _ in rows:
        ratio = f"{a / b:.2f}x" if a is not None and b else "-"
        lines.append(f"| {label} | {_f(a)} | {_f(b)} | {ratio} |")
    states = {n: s.get("memory", {}).get("states") for n, s in (("prefixgate", pg),
                                                               ("llama-server", ls))}
    lines += ["", f"States when memory was read with one idle: {states}"]
    return "\n".join(lines)


def _minus(probe: dict) -> float | None:
    cold, warm = probe.get("cold"), probe.get("warm")
    return None if cold is None or warm is None else cold - warm


def _match(model: str, probes: dict) -> str:
    return next((k for k in probes if k.startswith(model) or model.startswith(k)), model)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=Sizes.sessions)
    p.add_argument("--turns", type=int, default=Sizes.turns)
    p.add_argument("--systems", nargs="+", choices=("prefixgate", "llama-server"),
                   default=["prefixgate", "llama-server"])
    p.add_argument("--probe-rounds", type=int, default=1,
                   help="TTFT probes per model, cold and warm (their median is shown)")
    p.add_argument("--cold-probes", action="store_true",
                   help="only the TTFT probes (phase 1), the systems' servers started together "
                        "and probed in turn, --probe-rounds rounds")
    p.add_argument("--seed", type=int, default=Sizes.seed)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--ctx-size", type=int, default=4096, help="KV cells per model")
    p.add_argument("--idle-seconds", type=int, default=4)
    p.add_argument("--llama-server", type=Path, default=ROOT / ".bench" / "llama-server")
    p.add_argument("--out", type=Path, default=ROOT / ".bench" / "models-bench")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    print(table(run(args)))


if __name__ == "__main__":
    main()
