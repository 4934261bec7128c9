"""Requests whose lists run past their bounds (gateway/core/bounds.py), on every API, and how they
are answered while streams generate beside them.

    python -m loadtest.long_lists [--source DIR] [--rounds 5]

Each case is one list past its bound (5 cache breakpoints, 10,000 stop strings, ...). 3 streams
generate while every case is sent `--rounds` times in turn. Printed per case: the status and the
parameter the error names, and the time to the answer (median and max); then the streams' worst
inter-token gap while the cases were answered against their worst gap before them, and the
workers' restarts. `--source` runs the gateway from another checkout (the figures before).
tests/test_fuzz.py sends the same cases.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import ClientSession, ClientTimeout

from gateway.core import bounds
from gateway.workers.model_store import default_model_path
from loadtest.client import stream_chat
from loadtest.gateway_process import ROOT, GatewayProcess

CHAT, COMPLETIONS, MESSAGES, RESPONSES = ("/v1/chat/completions", "/v1/completions",
                                          "/v1/messages", "/v1/responses")
USER = {"role": "user", "content": "Hi"}
PART = {"type": "text", "text": "Hi"}
FUNCTION = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
ANTHROPIC_TOOL = {"name": "f", "input_schema": {"type": "object"}}
RESPONSES_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
MARKED = {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}
ANSWER_WITHIN = 120.0  # seconds: a case not answered by then is printed as a timeout


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    fields: Callable[[], dict]  # what is added to the API's smallest body
    param: str  # what the error names


def _base(path: str, model: str) -> dict:
    if path == COMPLETIONS:
        return {"model": model, "prompt": "Hi", "max_tokens": 1}
    if path == RESPONSES:
        return {"model": model, "input": "Hi", "max_output_tokens": 16}
    return {"model": model, "messages": [USER], "max_tokens": 1}


def body(case: Case, model: str) -> dict:
    return _base(case.path, model) | case.fields()


def _n(bound: int) -> int:
    return bound + 1


CASES = [
    Case("chat stop", CHAT, lambda: {"stop": ["x"] * _n(bounds.STOP_STRINGS)}, "stop"),
    Case("chat stop, one long", CHAT, lambda: {"stop": "x" * _n(bounds.STOP_CHARS)}, "stop"),
    Case("chat logit_bias", CHAT,
         lambda: {"logit_bias": {str(i): 1 for i in range(_n(bounds.LOGIT_BIAS))}},
         "logit_bias"),
    Case("chat messages", CHAT, lambda: {"messages": [USER] * _n(bounds.MESSAGES)}, "messages"),
    Case("chat content parts", CHAT,
         lambda: {"messages": [{"role": "user", "content": [PART] * _n(bounds.PARTS)}]},
         "messages[0].content"),
    Case("chat tool calls", CHAT, lambda: {"messages": [USER, {
        "role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": "{}"}}] * _n(bounds.PARTS)}]},
        "messages[1].tool_calls"),
    Case("chat tools", CHAT, lambda: {"tools": [FUNCTION] * _n(bounds.TOOLS)}, "tools"),
    Case("chat metadata", CHAT,
         lambda: {"metadata": {f"k{i}": "v" for i in range(_n(bounds.METADATA))}}, "metadata"),
    Case("chat modalities", CHAT, lambda: {"modalities": ["text"] * _n(bounds.PARTS)},
         "modalities"),
    Case("completion stop", COMPLETIONS, lambda: {"stop": ["x"] * _n(bounds.STOP_STRINGS)},
         "stop"),
    Case("completion token ids", COMPLETIONS, lambda: {"prompt": [1] * _n(bounds.TOKEN_IDS)},
         "prompt"),
    Case("messages 10,000 stop sequences", MESSAGES,
         lambda: {"stop_sequences": [f"stop {i}" for i in range(10_000)]}, "stop_sequences"),
    Case("messages stop characters", MESSAGES,
         lambda: {"stop_sequences": ["x" * (bounds.STOP_CHARS // 2 + 1)] * 2},
         "stop_sequences"),
    Case("messages 5 breakpoints", MESSAGES, lambda: {"messages": [
        {"role": "user", "content": [MARKED] * (bounds.CACHE_BREAKPOINTS + 1)}]},
        "cache_control"),
    Case("messages 4 breakpoints and automatic caching", MESSAGES, lambda: {
        "cache_control": {"type": "ephemeral"},
        "messages": [{"role": "user", "content": [MARKED] * bounds.CACHE_BREAKPOINTS}]},
        "cache_control"),
    Case("messages input_examples", MESSAGES, lambda: {"tools": [
        ANTHROPIC_TOOL | {"input_examples": [{}] * _n(bounds.PARTS)}]},
        "tools[0].input_examples"),
    Case("messages messages", MESSAGES, lambda: {"messages": [USER] * _n(bounds.MESSAGES)},
         "messages"),
    Case("messages content blocks", MESSAGES,
         lambda: {"messages": [{"role": "user", "content": [PART] * _n(bounds.PARTS)}]},
         "messages[0].content"),
    Case("messages system blocks", MESSAGES, lambda: {"system": [PART] * _n(bounds.PARTS)},
         "system"),
    Case("messages tools", MESSAGES, lambda: {"tools": [ANTHROPIC_TOOL] * _n(bounds.TOOLS)},
         "tools"),
    Case("responses input items", RESPONSES, lambda: {"input": [USER] * _n(bounds.MESSAGES)},
         "input"),
    Case("responses content parts", RESPONSES, lambda: {"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}] * _n(bounds.PARTS)}]},
        "input[0].message.content"),
    Case("responses tools", RESPONSES, lambda: {"tools": [RESPONSES_TOOL] * _n(bounds.TOOLS)},
         "tools"),
    Case("responses namespaces' functions", RESPONSES, lambda: {"tools": [
        {"type": "namespace", "name": f"ns{i}", "tools": [RESPONSES_TOOL] * 100}
        for i in range(bounds.TOOLS // 100 + 1)]}, "tools"),
    Case("responses context_management", RESPONSES, lambda: {"context_management": [
        {"type": "compaction"}] * _n(bounds.PARTS)}, "context_management"),
    Case("responses allowed_callers", RESPONSES, lambda: {"tools": [
        RESPONSES_TOOL | {"allowed_callers": ["direct"] * _n(bounds.PARTS)}]},
        "tools[0].function.allowed_callers"),
    Case("responses include", RESPONSES,
         lambda: {"include": ["reasoning.encrypted_content"] * _n(bounds.INCLUDE)}, "include"),
    Case("responses metadata", RESPONSES,
         lambda: {"metadata": {f"k{i}": "v" for i in range(_n(bounds.METADATA))}}, "metadata"),
]


def error_param(path: str, answer: dict) -> str | None:
    """The parameter an error names, in either API's shape (Anthropic's names none: its
    message says it)."""
    error = answer.get("error", {})
    return error.get("param") if path != MESSAGES else error.get("message")


async def measure(server: GatewayProcess, model: str, rounds: int) -> tuple[list, dict]:
    async with ClientSession() as session:
        async def send(case: Case) -> tuple[int | str, float]:
            data = json.dumps(body(case, model)).encode()  # the client's work, not timed
            sent = time.perf_counter()
            try:
                async with session.post(server.base_url + case.path, data=data,
                                        headers={"Content-Type": "application/json"},
                                        timeout=ClientTimeout(total=ANSWER_WITHIN)) as r:
                    await r.read()
                    return r.status, time.perf_counter() - sent
            except TimeoutError:
                return "timeout", time.perf_counter() - sent

        streams = [asyncio.create_task(stream_chat(
            session, server.base_url, model,
            [{"role": "user", "content": f"Tell a long story about ship {i}."}], 300,
            {"ignore_eos": True})) for i in range(3)]
        await asyncio.sleep(4.0)  # the streams are generating: the gaps before
        start = time.perf_counter()
        answers: dict[str, list[tuple[int, float]]] = {c.name: [] for c in CASES}
        for _ in range(rounds):
            for case in CASES:
                answers[case.name].append(await send(case))
        window = (start, time.perf_counter())
        records = [record for record, _ in await asyncio.gather(*streams)]
    gaps = {"before": [], "during": []}
    for record in records:
        for a, b in itertools.pairwise(record.chunk_times):
            if b <= window[0]:
                gaps["before"].append(b - a)
            elif window[0] <= a and b <= window[1]:
                gaps["during"].append(b - a)
    return [(c, answers[c.name]) for c in CASES], gaps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", type=Path, default=ROOT, help="checkout to run the gateway from")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    server = GatewayProcess(default_model_path(), "--ctx-size", "16384", source=args.source)
    try:
        rows, gaps = asyncio.run(measure(server, server.model_name, args.rounds))
        workers = server.health()[1].get("workers", [])
    finally:
        server.stop()
    print("| case | status | answered in, median (ms) | max (ms) |")
    print("|---|---:|---:|---:|")
    for case, answers in rows:
        times = [t * 1000 for _, t in answers]
        statuses = "/".join(sorted({str(s) for s, _ in answers}))
        print(f"| {case.name} | {statuses} | {statistics.median(times):.1f} | "
              f"{max(times):.1f} |")
    print()
    print("| streams' inter-token gap | n | max (s) |")
    print("|---|---:|---:|")
    for when, values in gaps.items():
        print(f"| {when} the cases | {len(values)} | {max(values, default=0):.3f} |")
    print(f"\nworkers: {[(w.get('state'), w.get('restarts')) for w in workers]}")


if __name__ == "__main__":
    main()
