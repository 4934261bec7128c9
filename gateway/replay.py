"""A test-only hook: replay a scripted completion through the real server and engine.

No small real model on PyPI writes tool calls in Qwen's, Llama's, Mistral's or gpt-oss's
formats. To put those formats through the real path (template, HTTP, engine, parser, wire),
the environment variable PREFIXGATE_REPLAY names a JSON file of rules:

    [{"when": "<text the prompt holds>", "output": "<the completion>"}, ...]

A chat prompt holding a rule's `when` (the first such rule) is answered with its `output`:
the engine computes those tokens one by one as if it had sampled them, then ends. Prompts no
rule matches are answered by the model. The file is read at each request, so a test can change
it between requests. Unset, nothing here runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

VARIABLE = "PREFIXGATE_REPLAY"


def scripted_output(prompt_text: str) -> str | None:
    path = os.environ.get(VARIABLE)
    if not path:
        return None
    rules = json.loads(Path(path).read_text())
    return next((rule["output"] for rule in rules if rule["when"] in prompt_text), None)
