"""Speculative decoding side by side: prefixgate with `--speculation off` and with its default
(on), llama-server without speculation and with its n-gram drafts, in one run.

    python -m loadtest.speculation [--runs 3] [--concurrency 1 4]

Workloads, greedy, each system in turn:
- edit: "repeat this file, renaming one function" (a ~20-line Python file), `--runs` times one
  after another: the answer copies its prompt;
- edit with prediction: the same, with the file as OpenAI's `prediction` (llama-server ignores
  the field: its figure is its plain edit's);
- repeated question: one question `--runs` times one after another, as many users ask it
  (greedy, so the same answer): the later ones can draft the first answer;
- unique: 8 prompts of ~256 tokens of unrelated text, 64 output tokens each, at each
  `--concurrency`: nothing to copy, so drafts can only cost.

It prints output tokens per second end to end (all answers' tokens over the workload's wall
time) and each system's ratio to the first (prefixgate without speculation).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import ClientSession, ClientTimeout, TCPConnector

from engine.llama import Model
from gateway.model_store import default_model_path
from loadtest.client import stream_chat
from loadtest.gateway_process import ROOT, GatewayProcess, ServerProcess
from loadtest.workloads import TextMaker

FILE = '''import math


def area_of_circle(radius):
    """The area of a circle of the given radius."""
    if radius < 0:
        raise ValueError("radius must not be negative")
    return math.pi * radius ** 2


def circumference(radius):
    return 2 * math.pi * radius


def describe(radius):
    area = area_of_circle(radius)
    length = circumference(radius)
    return f"radius {radius}: area {area:.2f}, circumference {length:.2f}"
'''
EDIT = [{"role": "user", "content": "Repeat this Python file exactly, but rename the function "
                                    f"area_of_circle to circle_area:\n\n{FILE}"}]
QUESTION = [{"role": "user", "content": "Explain how a hash map works, with an example in Python."}]
UNIQUE_PROMPTS, UNIQUE_TOKENS, UNIQUE_OUTPUT = 8, 256, 64


@dataclass(frozen=True)
class Workload:
    name: str
    chats: list[list[dict]]
    concurrency: int
    max_tokens: int
    extra: dict | None = None  # more fields of each request


def workloads(model: Model, runs: int, levels: list[int]) -> list[Workload]:
    maker = TextMaker(model, seed=7)
    unique = [[{"role": "user", "content": maker.text(UNIQUE_TOKENS)}]
              for _ in range(UNIQUE_PROMPTS)]
    prediction = {"prediction": {"type": "content", "content": FILE}}
    return [Workload("edit", [EDIT] * runs, 1, 400),
            Workload("edit with prediction", [EDIT] * runs, 1, 400, prediction),
            Workload("repeated question", [QUESTION] * runs, 1, 300),
            *(Workload(f"unique, concurrency {c}", unique, c, UNIQUE_OUTPUT) for c in levels)]


def systems(model: Path, threads: int, llama_server: Path
            ) -> dict[str, Callable[[], ServerProcess]]:
    """Name -> how to start it; each with 4 sequences."""
    def gateway(*flags: str) -> Callable[[], ServerProcess]:
        return lambda: GatewayProcess(model, "--threads", str(threads), "--parallel", "4",
                                      *flags)

    def server(*flags: str) -> Callable[[], ServerProcess]:
        return lambda: ServerProcess(
            [str(llama_server), "-m", str(model), "-t", str(threads), "-np", "4", "-kvu",
             "-c", "16384", "--host", "127.0.0.1", "--port", "{port}", *flags], "/health",
            ROOT / ".bench" / "speculation-llama-server.log")

    found = {"prefixgate --speculation off": gateway("--speculation", "off"),
             "prefixgate": gateway()}
    if llama_server.exists():
        found |= {"llama-server": server(),
                  "llama-server ngram-simple": server("--spec-type", "ngram-simple"),
                  "llama-server ngram-mod": server("--spec-type", "ngram-mod")}
    return found


async def run(url: str, model_id: str, workload: Workload) -> float:
    """Output tokens per second over the workload's wall time."""
    limit = asyncio.Semaphore(workload.concurrency)

    async def one(session: ClientSession, messages: list[dict]) -> int:
        async with limit:
            record, _ = await stream_chat(session, url, model_id, messages,
                                          workload.max_tokens, workload.extra or {},
                                          exact=False)
            if record.error:
                raise RuntimeError(record.error)
            return record.output_tokens

    # A new connection per request, as loadtest.bench: llama-server exits when a streamed
    # response's kept-alive connection carries the next request.
    async with ClientSession(timeout=ClientTimeout(total=1800),
                             connector=TCPConnector(force_close=True, limit=0)) as session:
        await one(session, [{"role": "user", "content": "Say hello."}])  # warm up
        start = time.perf_counter()
        if workload.concurrency == 1:  # one after another: each run repeats the last
            tokens = [await one(session, chat) for chat in workload.chats]
        else:
            tokens = await asyncio.gather(*(one(session, chat) for chat in workload.chats))
        return sum(tokens) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-server", type=Path, default=ROOT / ".bench" / "llama-server")
    parser.add_argument("--systems", nargs="+", default=None,
                        help="only these (names as printed); the first is the ratios' base")
    parser.add_argument("--no-edit", action="store_true", help="the unique prompts only")
    parser.add_argument("--rounds", type=int, default=1,
                        help="every system this many times, in turn (noise shows)")
    args = parser.parse_args()
    model = Model(str(args.model), vocab_only=True)
    loads = workloads(model, args.runs, args.concurrency)
    results: dict[str, dict[str, float]] = {}
    found = systems(args.model, args.threads, args.llama_server)
    chosen = {name: found[name] for name in args.systems or found}
    if args.no_edit:
        loads = [w for w in loads if w.name.startswith("unique")]
    for round_ in range(1, args.rounds + 1):
        for name, start in chosen.items():
            label = f"{name} (round {round_})" if args.rounds > 1 else name
            server = start()
            try:
                results[label] = {w.name: asyncio.run(run(server.base_url, args.model.stem, w))
                                  for w in loads}
            finally:
                server.stop()
            print(f"{label}: " + ", ".join(f"{k} {v:.1f} tok/s"
                                           for k, v in results[label].items()), flush=True)
    base = next(iter(results.values()))
    print("\n| system | " + " | ".join(w.name for w in loads) + " |")
    print("|---" * (len(loads) + 1) + "|")
    for name, row in results.items():
        print(f"| {name} | " + " | ".join(
            f"{row[w.name]:.1f} tok/s ({row[w.name] / base[w.name]:.2f}x)" for w in loads)
            + " |")


if __name__ == "__main__":
    main()
