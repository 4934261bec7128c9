"""The gateway with a test-only hook: it replays scripted completions through the real server
and engine. Only the tests start it (`python -m tests.replay_gateway --replay-rules FILE
<gateway flags>`); the production entry point (`python -m gateway`, the image) has no flag, no
environment variable and no code that turns it on, and the image holds no tests/.

No small real model on PyPI writes tool calls in Qwen's, Llama's, Mistral's or gpt-oss's
formats. To put those formats through the real path (template, HTTP, engine, parser, wire),
FILE holds JSON rules:

    [{"when": "<text the prompt holds>", "output": "<the completion>"}, ...]

A chat prompt holding a rule's `when` (the first such rule) is answered with its `output`:
the engine computes those tokens one by one as if it had sampled them, then ends. Prompts no
rule matches are answered by the model. The file is read at each request (on a thread, never
on the event loop), so a test can change it between requests.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from gateway.cli import main
from gateway.core import generation


@dataclass(frozen=True)
class ReplayRules:
    path: Path

    def __call__(self, prompt_text: str) -> str | None:
        rules = json.loads(self.path.read_text())
        return next((rule["output"] for rule in rules if rule["when"] in prompt_text), None)


def run(argv: list[str]) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    p.add_argument("--replay-rules", type=Path, required=True)
    args, rest = p.parse_known_args(argv)
    generation.replay = ReplayRules(args.replay_rules)
    main(rest)


if __name__ == "__main__":  # not when a spawned worker process imports it
    run(sys.argv[1:])
