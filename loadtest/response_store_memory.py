"""What the response store (gateway/responses/store.py) really holds, against what it counts.

    python -m loadtest.response_store_memory [--source DIR]

Two loads, built as POST /v1/responses stores them: 1,000 responses of 2,048 tokens each (a
~1,800-token question and a 248-token answer), and 10 conversations of 50 turns chained with
previous_response_id, each turn adding ~200 tokens (a question and an answer of ~100 each).
Printed for each: the store's own count (`stats`, what --response-store-mb bounds), the
process's resident memory it added (/proc/self/statm) and the Python allocations it added
(tracemalloc, a second run of the same load). `--source` imports the store from another
checkout (e.g. `git archive <commit> gateway cache engine | tar -x -C DIR`), for the figures
before a change; that store is driven the way its own Responses routes drove it (every turn
kept whole before the store kept chained turns as what they add).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import subprocess
import sys
import tracemalloc
import uuid

VOCAB = 49152  # the default model's
WORDS = ["harbour", "ledger", "pilot", "tide", "lantern", "keeper", "schooner", "channel",
         "buoy", "anchor", "weather", "cargo"]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Load:
    """Builds stored responses as gateway/responses/routes.py does, for either version of the
    store."""

    def __init__(self, store_module, message_class) -> None:
        self.module = store_module
        self.message = message_class
        self.chained = hasattr(store_module.StoredResponse, "make")

    def entry(self, rng: random.Random, history, question_tokens: int, answer_tokens: int):
        """A response continuing `history` (the previous entry and its whole conversation, or
        None): (the entry, its whole conversation)."""
        question = " ".join(rng.choices(WORDS, k=question_tokens))
        answer = " ".join(rng.choices(WORDS, k=answer_tokens))
        parent, messages, text, tokens = history or (None, [], "", [])
        messages = [*messages, self.message(role="user", content=question),
                    self.message(role="assistant", content=answer)]
        text += (f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{answer}"
                 "<|im_end|>\n")
        tokens = tokens + [rng.randrange(256, VOCAB) for _ in range(
            question_tokens + answer_tokens + 10)]
        response_id = f"resp_{uuid.UUID(int=rng.getrandbits(128)).hex}"
        items = [{"type": "message", "role": "user", "id": f"msg_{rng.getrandbits(128):032x}",
                  "content": [{"type": "input_text", "text": question}]}]
        body = {"id": response_id, "object": "response", "created_at": 1765000000,
                "status": "completed", "model": "SmolLM2-135M-Instruct", "error": None,
                "output": [{"type": "message", "id": f"msg_{rng.getrandbits(128):032x}",
                            "status": "completed", "role": "assistant",
                            "content": [{"type": "output_text", "text": answer,
                                         "annotations": [], "logprobs": []}]}],
                "usage": {"input_tokens": len(tokens) - answer_tokens,
                          "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens": answer_tokens,
                          "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": len(tokens)},
                "instructions": None, "max_output_tokens": None, "parallel_tool_calls": True,
                "previous_response_id": parent.id if parent else None,
                "reasoning": {"effort": None, "summary": None}, "store": True,
                "temperature": None, "top_p": None, "text": {"format": {"type": "text"}},
                "tool_choice": "auto", "tools": [], "truncation": "disabled", "user": None,
                "metadata": {}}
        cls = self.module.StoredResponse
        if self.chained:
            # Since several models: each entry names its model's fingerprint (one string).
            model = {"fingerprint": "model"} if "fingerprint" in cls.__slots__ else {}
            entry = cls.make(response_id, "tenant", body, items, messages, None, "", text,
                             tokens, parent, **model)
        else:  # before: every turn whole
            entry = cls(response_id, "tenant", body, items, messages, None, "", text, tokens)
        return entry, (entry, messages, text, tokens)

    def independent(self, store, n: int = 1000) -> None:
        rng = random.Random(1)
        for _ in range(n):
            store.put(self.entry(rng, None, 1790, 248)[0])

    def conversations(self, store, n: int = 10, turns: int = 50) -> None:
        rng = random.Random(2)
        for _ in range(n):
            history = None
            for _ in range(turns):
                entry, history = self.entry(rng, history, 95, 95)
                store.put(entry)


def measure(load: Load, fill) -> dict:
    """The store's count, RSS added and Python allocations added by one load (two runs: RSS
    first, in a process that has run nothing else, then under tracemalloc)."""
    new_store = lambda: load.module.ResponseStore(1 << 40, 10**9)  # noqa: E731 (unbounded)
    gc.collect()
    before = rss_bytes()
    store = new_store()
    fill(store)
    gc.collect()
    rss = rss_bytes() - before
    entries, counted = store.stats
    del store
    gc.collect()
    tracemalloc.start()
    store = new_store()
    fill(store)
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {"entries": entries, "counted": counted, "rss": rss, "traced": traced}


LOADS = {"independent": "1,000 responses of 2,048 tokens",
         "conversations": "10 conversations of 50 turns (~200 tok/turn)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default=None,
                        help="a checkout whose gateway/responses/store.py to measure")
    parser.add_argument("--load", choices=LOADS, help=argparse.SUPPRESS)  # one, in a child
    args = parser.parse_args()
    if args.load is None:  # each load in a process of its own: RSS is never given back
        print(f"{'load':<46} {'entries':>7} {'counted MiB':>11} {'RSS MiB':>8} "
              f"{'traced MiB':>10} {'counted/traced':>14}")
        for load in LOADS:
            source = ["--source", args.source] if args.source else []
            subprocess.run([sys.executable, "-m", "loadtest.response_store_memory", "--load",
                            load, *source], check=True)
        return
    if args.source:
        sys.path.insert(0, args.source)
    from gateway.core.conversation import Message
    from gateway.responses import store as response_store

    load = Load(response_store, Message)
    m = measure(load, getattr(load, args.load))
    print(f"{LOADS[args.load]:<46} {m['entries']:>7} {m['counted'] / 2**20:>11.1f} "
          f"{m['rss'] / 2**20:>8.1f} {m['traced'] / 2**20:>10.1f} "
          f"{m['counted'] / m['traced']:>14.2f}", flush=True)


if __name__ == "__main__":
    main()
