"""Multi-turn conversations through OpenAI's Responses API, side by side.

    python -m loadtest.responses_turns [--turns 4] [--max-tokens 32]

One conversation of --turns turns on a ~2k-token instruction prompt (Codex's recorded one, cut),
streamed and greedy, through:
- prefixgate /v1/responses with previous_response_id (stored; each turn sends its new input);
- prefixgate /v1/responses stateless (store false, the history re-sent, as Codex does);
- prefixgate /v1/chat/completions (the history re-sent);
- llama-server /v1/responses (stateless: it keeps no responses).
Each prefixgate mode starts its instructions with its own line, so none reads another's cache.
Printed per turn: the time to the first token and the share of the prompt read from the cache.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import openai

from gateway.workers.model_store import default_model_path
from loadtest.gateway_process import ROOT, ServerProcess

RECORDED = ROOT / "tests" / "fixtures" / "codex_0.169.0_request.json"
QUESTIONS = ["What does this repository do?", "Where are the tests?",
             "How do I run them?", "Which one is the slowest?", "Why?", "Thanks."]


@dataclass
class Turn:
    ttft: float
    prompt_tokens: int
    cached_tokens: int


def client(base_url: str) -> openai.OpenAI:
    """A client per turn: llama-server closes idle keep-alive connections, and a request sent
    on one it just closed fails."""
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=600)


def instructions(mode: str) -> str:
    text = json.loads(RECORDED.read_text())["input"][0]["content"][0]["text"]
    return f"Session of {mode}.\n\n" + text[:8000]


def responses_turns(base_url: str, model: str, mode: str, n: int, max_tokens: int,
                    chained: bool) -> list[Turn]:
    rows, history, previous = [], [], None
    for question in QUESTIONS[:n]:
        # Typed items with parts, as Codex sends them (llama-server wants the type).
        history.append({"type": "message", "role": "user",
                        "content": [{"type": "input_text", "text": question}]})
        request = {"model": model, "instructions": instructions(mode), "stream": True,
                   "max_output_tokens": max_tokens, "temperature": 0}
        if chained:
            request |= {"input": [history[-1]], "previous_response_id": previous}
        else:
            request |= {"input": history, "store": False}
        start, ttft, done = time.perf_counter(), None, None
        for event in client(base_url).responses.create(**request):
            if event.type == "response.output_text.delta" and ttft is None:
                ttft = time.perf_counter() - start
            if event.type in ("response.completed", "response.incomplete"):
                done = event.response
        usage = done.usage
        rows.append(Turn(ttft or time.perf_counter() - start, usage.input_tokens,
                         usage.input_tokens_details.cached_tokens))
        history.append({"type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": done.output_text or "."}]})
        previous = done.id
    return rows


def chat_turns(base_url: str, model: str, mode: str, n: int, max_tokens: int) -> list[Turn]:
    rows, history = [], [{"role": "system", "content": instructions(mode)}]
    for question in QUESTIONS[:n]:
        history.append({"role": "user", "content": question})
        start, ttft, text, usage = time.perf_counter(), None, "", None
        for chunk in client(base_url).chat.completions.create(
                model=model, messages=history, max_tokens=max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft or time.perf_counter() - start
                text += chunk.choices[0].delta.content
            usage = chunk.usage or usage
        rows.append(Turn(ttft or time.perf_counter() - start, usage.prompt_tokens,
                         usage.prompt_tokens_details.cached_tokens))
        history.append({"role": "assistant", "content": text or "."})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--llama-server", type=Path, default=ROOT / ".bench" / "llama-server")
    args = p.parse_args()
    model = str(default_model_path())
    results: dict[str, list[Turn]] = {}
    log_dir = ROOT / "loadtest" / "results"
    gateway = ServerProcess([sys.executable, "-m", "gateway", "--model", model, "--threads", "2",
                             "--parallel", "4", "--ctx-size", "16384", "--port", "{port}"],
                            "/health", log_dir / "responses_turns_prefixgate.log")
    try:
        name = client(gateway.base_url).models.list().data[0].id
        for mode, chained in (("previous_response_id", True), ("stateless", False)):
            print(f"prefixgate /v1/responses, {mode}", flush=True)
            results[f"responses, {mode}"] = responses_turns(gateway.base_url, name, mode,
                                                            args.turns, args.max_tokens, chained)
        print("prefixgate /v1/chat/completions", flush=True)
        results["chat completions"] = chat_turns(gateway.base_url, name, "chat", args.turns,
                                                 args.max_tokens)
    finally:
        gateway.stop()
    server = ServerProcess([str(args.llama_server), "-m", model, "-t", "2", "-np", "4", "-kvu",
                            "-c", "16384", "--port", "{port}", "--host", "127.0.0.1"],
                           "/health", log_dir / "responses_turns_llama-server.log")
    try:
        print("llama-server /v1/responses, stateless", flush=True)
        results["llama-server responses"] = responses_turns(
            server.base_url, "model", "llama-server", args.turns, args.max_tokens,
            chained=False)
    finally:
        server.stop()
    names = list(results)
    print("| turn | " + " | ".join(f"{n}: TTFT (s), cached" for n in names) + " |")
    print("|---|" + "---:|" * len(names))
    for t in range(args.turns):
        print(f"| {t + 1} | " + " | ".join(
            f"{results[n][t].ttft:.2f}, {results[n][t].cached_tokens}/"
            f"{results[n][t].prompt_tokens}" for n in names) + " |")


if __name__ == "__main__":
    main()
