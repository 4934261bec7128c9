"""Speculative decoding side by side: prefixgate with `--speculation off` and with its default
(on), llama-server without speculation and with its n-gram drafts, in one run.

    python -m loadtest.speculation [--runs 3] [--concurrency 1 4]

Workloads, greedy, each system in turn, each at every `--concurrency` (`--runs` x that many
sessions, that many at once; a session's turns one after another, each answer sent back):
- edit: "repeat this file, renaming one function" (a ~20-line Python file): the answer copies
  its prompt;
- edit with prediction: the same, with the file as OpenAI's `prediction` (llama-server ignores
  the field: its figure is its plain edit's);
- edit, its answer predicted: the same, with the model's own answer (prefixgate's without
  speculation) as the prediction: what drafts give where the prediction is right;
- RAG quote: three passages and a question answered by quoting one;
- agent loop: a coding agent's 6 turns: a task, then tools' outputs (test results, files,
  grep) to repeat, each answer sent back (SmolLM2 135M does not quote them unasked); every
  session the same task, as many users of one agent run it;
- repeated question: one question, as many users ask it (greedy, so the same answer);
- unique: 8 prompts of ~256 tokens of unrelated text, 64 output tokens each: nothing to
  copy, so drafts can only cost.

It prints output tokens per second end to end (all answers' tokens over the workload's wall
time), each system's ratio to the first (prefixgate without speculation) and prefixgate's to
the best llama-server.
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
from gateway.workers.model_store import default_model_path
from loadtest.client import stream_chat
from loadtest.gateway_process import ROOT, GatewayProcess, ServerProcess
from loadtest.workloads import Conversation, TextMaker

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
EDIT = ("Repeat this Python file exactly, but rename the function area_of_circle to "
        f"circle_area:\n\n{FILE}")
AGENT_TASK = "The test suite fails in inventory/stock.py. Find out why."
# What the agent's tools returned, each sent back to be repeated (and quoted from later).
TOOL_OUTPUTS = [
    """Tool run_tests returned:
```
FAILED tests/test_stock.py::test_reserve_more_than_available - AssertionError: expected OutOfStock
FAILED tests/test_stock.py::test_release_returns_items - assert 3 == 5
2 failed, 41 passed in 0.84s
```""",
    """Tool read_file returned inventory/stock.py:
```python
class OutOfStock(Exception):
    pass


class Stock:
    def __init__(self, items):
        self.items = dict(items)
        self.reserved = {}

    def reserve(self, sku, count):
        available = self.items.get(sku, 0) - self.reserved.get(sku, 0)
        if count > available + 1:
            raise OutOfStock(sku)
        self.reserved[sku] = self.reserved.get(sku, 0) + count

    def release(self, sku, count):
        self.reserved[sku] = self.reserved.get(sku, 0) - count
```""",
    """Tool read_file returned tests/test_stock.py (lines 20-34):
```python
def test_reserve_more_than_available():
    stock = Stock({"apple": 2})
    with pytest.raises(OutOfStock):
        stock.reserve("apple", 3)


def test_release_returns_items():
    stock = Stock({"pear": 5})
    stock.reserve("pear", 2)
    stock.release("pear", 2)
    assert stock.available("pear") == 5
```""",
    """Tool grep returned:
```
inventory/stock.py:12:        if count > available + 1:
inventory/api.py:40:    stock.reserve(order.sku, order.count)
inventory/api.py:52:    stock.release(order.sku, order.count)
```""",
    """Tool run_tests returned:
```
FAILED tests/test_stock.py::test_release_returns_items
E   AttributeError: 'Stock' object has no attribute 'available'
1 failed, 42 passed in 0.81s
```""",
]
PASSAGES = (
    "The harbour bridge opened in 1932 after eight years of work. It carries eight lanes of "
    "traffic, two railway lines and a cycleway, and its arch rises 134 metres above the water. "
    "Painting it takes ten years, after which the painters start again at the other end.",
    "The lighthouse on the northern cape was first lit in 1859. Its lamp burned whale oil "
    "until 1872, then kerosene, and since 1933 it has been electric. The keeper's cottage "
    "beside it is now a museum, open on weekends from April to October.",
    "The old orchard behind the railway station grows forty varieties of apple. Volunteers "
    "prune the trees every February, and in autumn the harvest is pressed into cider at the "
    "market on the square, where the proceeds pay for new saplings.")
RAG = ("Answer from the passages below, quoting the passage that answers word for word.\n\n"
       + "\n\n".join(f"[{i}] {text}" for i, text in enumerate(PASSAGES, 1))
       + "\n\nQuestion: What did the lighthouse's lamp burn, and since when has it been "
         "electric?")
QUESTION = "Explain how a hash map works, with an example in Python."
UNIQUE_PROMPTS, UNIQUE_TOKENS, UNIQUE_OUTPUT = 8, 256, 64


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: list[Conversation]
    concurrency: int
    max_tokens: int  # of each answer
    extra: dict | None = None  # more fields of each request


def workloads(model: Model, runs: int, levels: list[int], edited: str) -> list[Workload]:
    """`edited`: the model's own answer to the edit, predicted exactly in one workload."""
    maker = TextMaker(model, seed=7)
    unique = [Conversation(None, [maker.text(UNIQUE_TOKENS)]) for _ in range(UNIQUE_PROMPTS)]
    prediction = {"prediction": {"type": "content", "content": FILE}}
    exact = {"prediction": {"type": "content", "content": edited}}
    found = []
    for c in levels:
        def same(system: str | None, turns: list[str]) -> list[Conversation]:
            return [Conversation(system, turns) for _ in range(runs * c)]  # noqa: B023

        found += [Workload(f"edit, c={c}", same(None, [EDIT]), c, 400),
                  Workload(f"edit with prediction, c={c}", same(None, [EDIT]), c, 400,
                           prediction),
                  Workload(f"edit, its answer predicted, c={c}", same(None, [EDIT]), c, 400,
                           exact),
                  Workload(f"RAG quote, c={c}", same(None, [RAG]), c, 200),
                  Workload(f"agent loop, c={c}", same(None, [AGENT_TASK, *(
                      f"Repeat this tool output exactly:\n\n{output}" for output in TOOL_OUTPUTS)]),
                           c, 200),
                  Workload(f"repeated question, c={c}", same(None, [QUESTION]), c, 300),
                  Workload(f"unique, c={c}", unique, c, UNIQUE_OUTPUT)]
    return found


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


def edited(start: Callable[[], ServerProcess], model_id: str) -> str:
    """The answer a server gives to the edit."""
    async def ask() -> str:
        async with ClientSession(timeout=ClientTimeout(total=600)) as session:
            record, answer = await stream_chat(session, server.base_url, model_id,
                                               [{"role": "user", "content": EDIT}], 400, {},
                                               exact=False)
            if record.error:
                raise RuntimeError(record.error)
            return answer

    server = start()
    try:
        return asyncio.run(ask())
    finally:
        server.stop()


async def run(url: str, model_id: str, workload: Workload) -> float:
    """Output tokens per second over the workload's wall time."""
    limit = asyncio.Semaphore(workload.concurrency)

    async def ask(session: ClientSession, messages: list[dict]) -> tuple[int, str]:
        record, answer = await stream_chat(session, url, model_id, messages,
                                           workload.max_tokens, workload.extra or {},
                                           exact=False)
        if record.error:
            raise RuntimeError(record.error)
        return record.output_tokens, answer

    async def converse(session: ClientSession, conversation: Conversation) -> int:
        """A session's turns one after another, each answer sent back: its output tokens."""
        async with limit:
            messages = [{"role": "system", "content": conversation.system}] \
                if conversation.system else []
            tokens = 0
            for turn in conversation.turns:
                messages.append({"role": "user", "content": turn})
                n, answer = await ask(session, messages)
                messages.append({"role": "assistant", "content": answer})
                tokens += n
            return tokens

    # A new connection per request, as loadtest.bench: llama-server exits when a streamed
    # response's kept-alive connection carries the next request.
    async with ClientSession(timeout=ClientTimeout(total=1800),
                             connector=TCPConnector(force_close=True, limit=0)) as session:
        await ask(session, [{"role": "user", "content": "Say hello."}])  # warm up
        start = time.perf_counter()
        # Sessions start in order: at concurrency 1 each one repeats the last.
        tokens = await asyncio.gather(*(converse(session, c) for c in workload.sessions))
        return sum(tokens) / (time.perf_counter() - start)

def drafts(server: ServerProcess) -> dict[str, tuple[float, float]]:
    """A gateway's draft tokens so far by source: drafted, accepted; {} for other servers."""
    if not isinstance(server, GatewayProcess):
        return {}
    drafted = server.labelled("prefixgate_speculative_drafted_tokens_total", "source")
    accepted = server.labelled("prefixgate_speculative_accepted_tokens_total", "source")
    return {source: (drafted[source], accepted[source]) for source in drafted}


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
    parser.add_argument("--workloads", nargs="+", default=None,
                        help="only the workloads whose names start with one of these")
    parser.add_argument("--rounds", type=int, default=1,
                        help="every system this many times, in turn (noise shows)")
    args = parser.parse_args()
    model = Model(str(args.model), vocab_only=True)
    found = systems(args.model, args.threads, args.llama_server)
    answer = edited(found["prefixgate --speculation off"], args.model.stem)
    loads = [w for w in workloads(model, args.runs, args.concurrency, answer)
             if not args.workloads or w.name.startswith(tuple(args.workloads))]
    results: dict[str, dict[str, float]] = {}
    # prefixgate's draft tokens by workload and source: drafted, accepted
    acceptance: dict[str, dict[str, tuple[float, float]]] = {}
    chosen = {name: found[name] for name in args.systems or found}
    for round_ in range(1, args.rounds + 1):
        for name, start in chosen.items():
            label = f"{name} (round {round_})" if args.rounds > 1 else name
            results[label] = {}
            for w in loads:  # each on a server of its own: none remembers another's answers
                server = start()
                try:
                    before = drafts(server)
                    results[label][w.name] = asyncio.run(run(server.base_url, args.model.stem, w))
                    if name == "prefixgate":
                        acceptance[w.name] = {
                            source: (n - before[source][0], a - before[source][1])
                            for source, (n, a) in drafts(server).items()}
                finally:
                    server.stop()
            print(f"{label}: " + ", ".join(f"{k} {v:.1f} tok/s"
                                           for k, v in results[label].items()), flush=True)
    print_tables(loads, results, acceptance)


def print_tables(loads: list[Workload], results: dict[str, dict[str, float]],
                 acceptance: dict[str, dict[str, tuple[float, float]]]) -> None:
    """Output tokens per second by workload and system (ratios to the first system, and
    prefixgate's to the best llama-server), then prefixgate's draft tokens by source."""
    base, *_ = results
    servers = [name for name in results if name.startswith("llama-server")]
    print("\n| workload | " + " | ".join(results) + " | prefixgate / best llama-server |")
    print("|---" * (len(results) + 2) + "|")
    for w in loads:
        cells = [f"{row[w.name]:.1f} ({row[w.name] / results[base][w.name]:.2f}x)"
                 for row in results.values()]
        best = max((results[name][w.name] for name in servers), default=0)
        lead = f"{results['prefixgate'][w.name] / best:.2f}x" \
            if best and "prefixgate" in results else "-"
        print(f"| {w.name} | " + " | ".join(cells) + f" | {lead} |")
    if acceptance:
        sources = sorted({source for counts in acceptance.values() for source in counts})
        print("\nprefixgate's draft tokens, accepted of drafted, by source:\n")
        print("| workload | " + " | ".join(sources) + " |")
        print("|---" * (len(sources) + 1) + "|")
        for name, counts in acceptance.items():
            print(f"| {name} | " + " | ".join(
                f"{a:.0f} of {n:.0f} ({a / n:.0%})" if n else "-"
                for n, a in (counts.get(source, (0, 0)) for source in sources)) + " |")

if __name__ == "__main__":
    main()
