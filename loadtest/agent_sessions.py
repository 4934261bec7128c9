"""Coding-agent sessions over Anthropic's /v1/messages, side by side: prefixgate and llama-server.

    python -m loadtest.agent_sessions [--sessions 4] [--turns 6] [--systems ...]

Every session sends what Claude Code 2.1.328 sends (its recorded request: the billing line, its
system prompt and environment, six of its tools: ~6k tokens with the test model), with its own
billing line (the line's hash of the first question, as Claude Code writes it) and its own
questions; each turn resends the history with the answer before it. Sessions run one after
another, streamed, greedy, each answer cut at --max-tokens. Printed per session and turn: the
time to the first token and the share of the prompt each server reports read from its cache
(`cache_read_input_tokens`), then the first turns of sessions 2 on against llama-server's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import anthropic
import numpy as np

from gateway.workers.model_store import default_model_path
from loadtest.gateway_process import ROOT, ServerProcess

RECORDED = ROOT / "tests" / "fixtures" / "claude_code_2.1.328_request.json"
TOOLS = ("Read", "Edit", "Write", "Skill", "ToolSearch", "DeferredToolPlaceholder")
QUESTIONS = ["What does the function parse_args return?", "Where is the config file read?",
             "Rename the variable n to count.", "Why does the test fail on Python 3.11?",
             "Add a docstring to main.", "What does this repository do?",
             "List the files under src.", "Explain the Makefile's test target."]


@dataclass
class Turn:
    session: int
    turn: int
    ttft: float
    prompt_tokens: int
    cached_tokens: int


def billing_line(question: str) -> str:
    """Claude Code's: three hex digits of a hash of characters of the first question."""
    picked = "".join(question[i] if i < len(question) else "0" for i in (4, 7, 20))
    suffix = hashlib.sha256(f"59cf53e54c78{picked}2.1.328".encode()).hexdigest()[:3]
    return f"x-anthropic-billing-header: cc_version=2.1.328.{suffix}; cc_entrypoint=sdk-cli;"


def session_request(recorded: dict, history: list[dict], max_tokens: int) -> dict:
    """As Claude Code sends a turn: its environment as a system turn after the first question,
    a breakpoint on the last message."""
    system = [dict(block) for block in recorded["system"]]
    system[0]["text"] = billing_line(history[0]["content"])
    environment = {"role": "system", "content": recorded["messages"][1]["content"][0]["text"]}
    messages = [history[0], environment, *history[1:]]
    messages[-1] = {"role": messages[-1]["role"], "content": [
        {"type": "text", "text": messages[-1]["content"], "cache_control": {"type": "ephemeral"}}]}
    return {"model": recorded["model"], "max_tokens": max_tokens,
            "extra_body": {"temperature": 0.0},  # (this SDK's stream() takes none by name)
            "system": system, "messages": messages,
            "tools": [t for t in recorded["tools"] if t["name"] in TOOLS]}


def run_sessions(base_url: str, n_sessions: int, n_turns: int, max_tokens: int) -> list[Turn]:
    recorded = json.loads(RECORDED.read_text())
    rows = []
    for s in range(n_sessions):
        history: list[dict] = []
        for t in range(n_turns):
            question = QUESTIONS[(s + t) % len(QUESTIONS)] + f" (session {s + 1})" * (t == 0)
            history.append({"role": "user", "content": question})
            request = session_request(recorded, history, max_tokens)
            # A client per turn: llama-server closes idle keep-alive connections, and a request
            # sent on one it just closed fails.
            client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0,
                                         timeout=600)
            start, ttft = time.perf_counter(), None
            with client.messages.stream(**request) as stream:
                for _ in stream.text_stream:
                    ttft = ttft or time.perf_counter() - start
                message = stream.get_final_message()
            usage = message.usage
            prompt = usage.input_tokens + (usage.cache_read_input_tokens or 0) \
                + (usage.cache_creation_input_tokens or 0)
            rows.append(Turn(s + 1, t + 1, ttft or time.perf_counter() - start, prompt,
                             usage.cache_read_input_tokens or 0))
            print(f"  session {s + 1} turn {t + 1}: TTFT {rows[-1].ttft:.2f} s, "
                  f"{rows[-1].cached_tokens}/{prompt} cached", flush=True)
            answer = "".join(b.text for b in message.content if b.type == "text") or "."
            history.append({"role": "assistant", "content": answer})
    return rows


def commands(model: Path, llama_server: Path, threads: int, cells: int) -> dict[str, list[str]]:
    import sys

    return {
        "prefixgate": [sys.executable, "-m", "gateway", "--model", str(model), "--threads",
                       str(threads), "--parallel", "4", "--ctx-size", str(cells),
                       "--model-alias", "claude-*", "--port", "{port}"],
        "llama-server": [str(llama_server), "-m", str(model), "-t", str(threads), "-np", "4",
                         "-kvu", "-c", str(cells), "--port", "{port}", "--host", "127.0.0.1"],
    }


def table(results: dict[str, list[Turn]]) -> str:
    names = list(results)
    lines = ["| session | turn | " + " | ".join(f"{n} TTFT (s) | {n} cached" for n in names)
             + (" | TTFT ratio |" if len(names) == 2 else " |"),
             "|---|---|" + "---:|---:|" * len(names) + ("---:|" if len(names) == 2 else "")]
    by_key = {n: {(r.session, r.turn): r for r in rows} for n, rows in results.items()}
    for key in sorted(by_key[names[0]]):
        cells = [by_key[n].get(key) for n in names]
        row = f"| {key[0]} | {key[1]} | " + " | ".join(
            f"{r.ttft:.2f} | {r.cached_tokens / r.prompt_tokens:.0%}" if r else "- | -"
            for r in cells)
        if len(names) == 2 and all(cells):
            row += f" | {cells[0].ttft / cells[1].ttft:.2f}x"
        lines.append(row + " |")
    if len(names) == 2:
        firsts = [by_key[names[0]][(s, 1)].ttft / by_key[names[1]][(s, 1)].ttft
                  for s in range(2, 1 + max(k[0] for k in by_key[names[0]]))
                  if (s, 1) in by_key[names[1]]]
        later = [by_key[names[0]][k].ttft / by_key[names[1]][k].ttft for k in by_key[names[0]]
                 if k[1] > 1 and k in by_key[names[1]]]
        if firsts:
            lines.append(f"\nfirst turn of sessions 2 on: TTFT {names[0]} / {names[1]} = "
                         f"{max(firsts):.2f}x at most (target <= 0.2x); turns 2 on: "
                         f"{float(np.median(later)):.2f}x at the median")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--llama-server", type=Path, default=ROOT / ".bench" / "llama-server")

    p.add_argument("--systems", nargs="+", default=["prefixgate", "llama-server"])
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx-size", type=int, default=32768, help="KV cells of each server")
    args = p.parse_args()
    model = args.model or default_model_path()
    results = {}
    for name in args.systems:
        print(f"{name}:", flush=True)
        command = commands(model, args.llama_server, args.threads, args.ctx_size)[name]
        server = ServerProcess(command, "/health", ROOT / "loadtest" / "results" /
                               f"agent_sessions_{name}.log")
        try:
            results[name] = run_sessions(server.base_url, args.sessions, args.turns,
                                         args.max_tokens)
        finally:
            server.stop()
    print(table(results))


if __name__ == "__main__":
    main()
