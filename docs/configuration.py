"""Writes docs/configuration.md from the argument parser `prefixgate --help` prints
(gateway/cli.py's build_parser): every flag, its environment twin, default and help, in the
parser's groups, with the longer notes below kept here.

    python docs/configuration.py           # print the page
    python docs/configuration.py --write   # write docs/configuration.md

tests/test_docs.py fails when the page differs from what the current parser generates.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"
COMMAND = "python docs/configuration.py --write"
ENV_PREFIX = "PREFIXGATE_"

# What a flag's help line has no room for (moved from the README's flag table). Keyed by the
# flag's first option string; a key the parser lacks is an error.
NOTES = {
    "--model": "On a CPU, prefer weights llama.cpp repacks into its GEMM kernels (Q4_0, Q8_0, "
               "IQ4_NL, K-quants): the same SmolLM2 requantized to Q4_0 prefills 2.5x faster "
               "than as shipped in Q4_1, which goes through the generic dot product "
               "(`loadtest.weight_kernels`, [scheduler.md](scheduler.md)).",
    "--model-alias": "Responses carry the name asked for. `ANTHROPIC_MODEL=<model id>` does the "
                     "same from Claude Code's side. `PREFIXGATE_MODEL_ALIAS` takes several, "
                     "separated by commas.",
    "--response-store-mb": "Past it (or past `--response-store-hours`) the oldest stored "
                           "responses go first; past `--tenant-cache-share` of the memory, a "
                           "tenant's own oldest "
                           "([api/responses.md](api/responses.md#stored-responses)).",
    "--claude-billing-header": "The block reads `x-anthropic-billing-header: cc_version=...; "
                               "cc_entrypoint=...;`. Dropped, the model never sees it; `keep` "
                               "renders it as sent.",
    "--temperature": "`--temperature`, `--top-p`, `--top-k` and `--min-p` are what a request "
                     "that leaves them out samples with, on every API.",
    "--parallel": "More requests than this per worker wait in a queue (`--max-queue`).",
    "--ctx-size": "llama-server's `-c` with `-kvu`. Left at its default, a request is capped at "
                  "the model's training context; given explicitly it is honoured beyond it, "
                  "with a warning in the log, as llama-server does (agent prompts and resumed "
                  "sessions go past small models' 8k). With `--deterministic`, split evenly: "
                  "`ctx-size / parallel` per sequence.",
    "--batch-tokens": "All decodes first, then prompt chunks. 512 is llama-cpp-python's "
                      "`n_batch`, so a request alone is prefilled in the same chunks.",
    "--kv-type": "llama-server's `-ctk/-ctv`.",
    "--flash-attn": "`on`, as llama-server's `-fa auto` on a CPU: prefill ~1.4x faster here and "
                    "batches far cheaper (no attention matrix over the whole pool); outputs "
                    "match llama-cpp-python's `flash_attn=True`. `off` (or `--no-flash-attn`): "
                    "outputs match llama-cpp-python's defaults "
                    "([architecture.md](architecture.md#engine-modes)).",
    "--deterministic": "See [architecture.md](architecture.md#engine-modes) and "
                       "[deterministic.md](deterministic.md).",
    "--swa-full": "On Gemma 3 270M with 8 sequences and 16,384 cells, 240 MiB of KV instead of "
                  "75 (3.2x), for no gain here "
                  "([sliding-window-and-recurrent.md](sliding-window-and-recurrent.md)).",
    "--target-tpot-ms": "Lower: more even streams, later first tokens for requests arriving "
                        "meanwhile, less work done in all (smaller prompt chunks cost more per "
                        "token); higher: the reverse ([scheduler.md](scheduler.md) has the "
                        "measured trade and why 1000).",
    "--speculation": "Drafts come from text at hand: a chat's `prediction`, an earlier answer "
                     "to the same prompt, the request's own prompt and output, the tenant's "
                     "answers given lately "
                     "([architecture.md](architecture.md#speculative-decoding), "
                     "[speculation.md](speculation.md)). The same output, sooner where an answer "
                     "copies text (an edit of a file, a quoted passage, a JSON record). Not for "
                     "recurrent or sliding-window models (their cells cannot drop a rejected "
                     "draft). With flash attention, attention is computed row by row below 64 "
                     "rows, so verified rows agree with lone decodes.",
    "--prefill-context": "Among the pool's other sequences every prompt row also reads their "
                         "cells' mask (9% more time beside 8 sequences of 300 cells; "
                         "[scheduler.md](scheduler.md)). Costs that context's cells in memory.",
    "--threads": "With `--workers N`, give each cores / N.",
    "--workers": "Each worker has `--parallel` sequences in `--ctx-size` cells "
                 "([architecture.md](architecture.md#workers), [workers.md](workers.md)).",
    "--balance-abs-threshold": "The imbalance guard: when the busiest worker has more requests "
                               "than the idlest by both margins, the idlest gets the request.",
    "--shared-memory": "Created owner-only (0600), never truncated, removed at exit.",
    "--step-timeout": "Stuck means no output and no snapshot, inside llama.cpp say: the worker "
                      "is killed, its requests get a 503 and a replacement starts.",
    "--redis-url": "See [architecture.md](architecture.md#across-replicas-and-restarts).",
    "--redis-key": "Signed over each value's key and bytes, so only holders of the key can "
                   "write KV a gateway will use. It also encrypts the stored `/v1/responses` "
                   "Redis keeps: without it they are not shared through Redis at all.",
    "--pin-budget-mb": "Falling back is counted and logged; no request fails for lack of pin "
                       "room ([api/cache.md](api/cache.md#prompt-cache-controls)).",
    "--tenant-cache-share": "Other tenants' allocations take from a tenant past its share "
                            "before anyone else's.",
    "--api-keys-file": "`#` starts a comment. `PREFIXGATE_API_KEYS` holds the same entries, "
                       "comma-separated. Without keys the gateway is open, and says so at start "
                       "([security.md](security.md)).",
    "--cors-allow-origin": "E.g. `https://app.example`. Preflights (`OPTIONS`) are answered "
                           "before any key is asked for, with `Authorization` and "
                           "`Content-Type` allowed. Off, browsers on other origins are refused "
                           "(llama-server answers any origin).",
    "--rate-limit-rpm": "Over a sliding minute; past either limit, 429 with the seconds to wait "
                        "in `Retry-After`.",
    "--max-tokens": "Unset, a request may ask for as many as the context has room for.",
    "--request-timeout": "A stream gets an error event, then `[DONE]`.",
}

HEADER = f"""\
# Configuration

<!-- Generated by `{COMMAND}` from gateway/cli.py's argument parser; do not edit by hand.
     tests/test_docs.py fails when this page differs from what the parser generates. -->

Every flag `prefixgate --help` lists (`python -m gateway --help`, `make serve ARGS="..."`),
grouped as it groups them. Each has an environment twin, `{ENV_PREFIX}` and the flag's name in
capitals (`--ctx-size` -> `{ENV_PREFIX}CTX_SIZE`), which sets its default: the command line
still wins. A switch's twin is on for `1`, `true` or `yes`.
"""


def build_parser() -> argparse.ArgumentParser:
    """The parser as a machine without PREFIXGATE_* variables builds it."""
    if sys.path[0] != str(ROOT):
        sys.path.insert(0, str(ROOT))  # this checkout's gateway/, not an installed one
    from gateway.cli import build_parser as cli_parser

    clean = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    with mock.patch.dict(os.environ, clean, clear=True):
        return cli_parser()


def machine_dependent() -> set[str]:
    """Flags whose default the parser reads from the machine (its core count)."""
    found = None
    for cores in (1, 1024):
        with mock.patch.object(os, "cpu_count", return_value=cores):
            defaults = {a.dest: a.default for a in build_parser()._actions}
        found = defaults if found is None else {d for d in defaults if defaults[d] != found[d]}
    return found


def page() -> str:
    parser = build_parser()
    formatter = parser._get_formatter()
    varying = machine_dependent()
    flags = {a.option_strings[0] for a in parser._actions if a.option_strings}
    unknown = sorted(set(NOTES) - flags)
    if unknown:
        raise KeyError(f"notes for flags the parser does not have: {unknown}")
    out = [HEADER]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        out += [f"## {group.title}", ""]
        if group.description:
            out += [group.description, ""]
        out += ["| flag | environment | default | |", "|---|---|---|---|"]
        for action in actions:
            out.append("| " + " | ".join((
                _invocation(formatter, action), f"`{ENV_PREFIX}{action.dest.upper()}`",
                "depends on the machine (`os.cpu_count()`)" if action.dest in varying
                else _default(action),
                _cell(formatter._expand_help(action) if action.help else ""))) + " |")
        notes = [(a.option_strings[0], NOTES[a.option_strings[0]]) for a in actions
                 if a.option_strings[0] in NOTES]
        if notes:
            out.append("")
            out += [f"- `{flag}`: {text}" for flag, text in notes]
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def _invocation(formatter: argparse.HelpFormatter, action: argparse.Action) -> str:
    value = ""
    if action.nargs != 0:
        metavar = formatter._get_default_metavar_for_optional(action)
        value = " " + formatter._format_args(action, metavar)
    return ", ".join(f"`{flag}{value}`" for flag in action.option_strings)


def _default(action: argparse.Action) -> str:
    default = action.default
    if isinstance(action, argparse._StoreConstAction) and action.const is not None \
            and not isinstance(action, argparse._StoreTrueAction):
        return f"(sets `{action.dest}` to `{action.const}`)"
    if default is None or default == []:
        return "unset"
    if default is False:
        return "off"
    if default == "":
        return "empty"
    return f"`{default}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def main(argv: list[str] | None = None) -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--write", action="store_true", help=f"write {PAGE.relative_to(ROOT)}")
    if args.parse_args(argv).write:
        PAGE.write_text(page())
    else:
        sys.stdout.write(page())


if __name__ == "__main__":
    main()
