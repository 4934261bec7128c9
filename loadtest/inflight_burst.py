"""What 8 requests arriving at once on a new ~1,024-token prefix cost, against one cold request.

    python -m loadtest.inflight_burst [--rounds 3] [--tokens 16] [-- gateway flags...]

It starts a gateway itself. Each round sends one request on a prefix nobody has seen, then 8 at
once on another new prefix, each with its own question. The first of the 8 computes the prefix;
the others wait for its cells and share them (`seq_cp`), computing only their own tails. It
prints, per round and as medians: the cold request's time to first token and to its last token,
the time until all 8 had their first token and until all 8 finished, and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics

from aiohttp import ClientSession, ClientTimeout

from gateway.workers.model_store import default_model_path
from loadtest.client import stream_chat
from loadtest.gateway_process import GatewayProcess

BURST = 8
PREFIX_WORDS = 990  # ~1,024 tokens of this model with the chat template
WORDS = ["river", "mountain", "ledger", "archive", "lantern", "harbor", "orchard", "meadow",
         "copper", "signal", "engine", "garden", "window", "thunder", "compass", "violet",
         "canyon", "marble", "anchor", "falcon", "summit", "willow", "quartz", "beacon"]


def new_prefix(rng: random.Random) -> str:
    return "You are the keeper of this catalogue: " + " ".join(
        rng.choice(WORDS) for _ in range(PREFIX_WORDS))


def messages(prefix: str, question: int) -> list[dict]:
    return [{"role": "system", "content": prefix},
            {"role": "user", "content": f"Question {question}: which word comes first?"}]


async def one_round(base_url: str, model: str, rng: random.Random,
                    tokens: int) -> dict[str, float]:
    async with ClientSession(timeout=ClientTimeout(total=600)) as session:
        cold, _ = await stream_chat(session, base_url, model, messages(new_prefix(rng), 0),
                                    tokens, {"ignore_eos": True})
        prefix = new_prefix(rng)
        burst = await asyncio.gather(*(
            stream_chat(session, base_url, model, messages(prefix, i), tokens,
                        {"ignore_eos": True}) for i in range(BURST)))
    records = [record for record, _ in burst]
    for record in [cold, *records]:
        if not record.ok:
            raise SystemExit(f"a request failed: {record.error}")
    start = min(r.start for r in records)
    return {
        "prompt tokens": cold.prompt_tokens,
        "cold TTFT": cold.chunk_times[0] - cold.start,
        "cold E2E": cold.end - cold.start,
        "burst: all first tokens": max(r.chunk_times[0] for r in records) - start,
        "burst: all done": max(r.end for r in records) - start,
        "burst cached tokens, median": statistics.median(r.cached_tokens for r in records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16, help="completion tokens per request")
    parser.add_argument("gateway_args", nargs="*", help="flags for the gateway (after --)")
    args = parser.parse_args()
    server = GatewayProcess(default_model_path(), *args.gateway_args)
    rng = random.Random(0)
    try:
        rounds = [asyncio.run(one_round(server.base_url, server.model_name, rng, args.tokens))
                  for _ in range(args.rounds)]
    finally:
        server.stop()
    names = list(rounds[0])
    print(f"{BURST} requests at once on a new prefix vs one cold request, {args.tokens} tokens "
          f"each, gateway flags: {' '.join(args.gateway_args) or '(defaults)'}\n")
    print("| round | " + " | ".join(names) + " | first tokens / cold TTFT | done / cold E2E |")
    print("|---" * (len(names) + 3) + "|")
    for label, row in [*((str(i + 1), r) for i, r in enumerate(rounds)),
                       ("median", {n: statistics.median(r[n] for r in rounds) for n in names})]:
        cells = " | ".join(f"{row[n]:.2f}" if isinstance(row[n], float) else f"{row[n]:.0f}"
                           for n in names)
        print(f"| {label} | {cells} | {row['burst: all first tokens'] / row['cold TTFT']:.2f}x "
              f"| {row['burst: all done'] / row['cold E2E']:.2f}x |")


if __name__ == "__main__":
    main()
