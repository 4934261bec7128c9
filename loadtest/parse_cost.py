"""What reading an answer in the model's format costs the gateway: every format's parser run
over an answer as it grows, token by token (4 characters each), as a stream reads it. Prints
microseconds of CPU per token, over a whole answer of 100, 1,000 and 8,000 tokens, for a text
answer and for calls whose arguments are that long (prose, and code whose quotes JSON escapes:
what a coding agent's Write sends): flat across lengths when reading is
incremental, growing with the length when every token re-reads the answer. It runs a checkout
whose parser has no reader too (one parse a token), for the figures before:
`PYTHONPATH=OLD_CHECKOUT python loadtest/parse_cost.py` from there.

    python -m loadtest.parse_cost
"""

from __future__ import annotations

import json
import time

from gateway.core.conversation import Tool
from gateway.formats.chat_formats import detect
from gateway.formats.tools import Toolbox
from tests.chat_outputs import OUTPUTS, TOOLS
from tests.templates import template

LENGTHS = (100, 1_000, 8_000)  # tokens
STEP = 4  # characters a token
REPEATS = 3  # the least of them is printed: CPU time, the machine may be shared
SENTENCE = "The harbour is calm today and every boat is in. "
PROSE = "Paris and its harbour, "
CODE = 'if boats[i] == "ferry": print("in the harbour")\n'  # a coding agent's Write: quotes


def _args(filler: str) -> str:
    return json.dumps({"city": filler})


# A call to get_weather whose one argument is `filler`, as each format writes it (JSON escapes
# its quotes and newlines; the formats that write parameters as text keep it raw).
CALLS = {
    "hermes": lambda f: '<tool_call>\n{"name": "get_weather", "arguments": '
                        f'{_args(f)}}}\n</tool_call>',
    "qwen3-coder": lambda f: "<tool_call>\n<function=get_weather>\n<parameter=city>\n"
                             f"{f}\n</parameter>\n</function>\n</tool_call>",
    "glm": lambda f: f"<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>{f}"
                     "</arg_value>\n</tool_call>",
    "llama3": lambda f: f'{{"name": "get_weather", "parameters": {_args(f)}}}',
    "mistral": lambda f: f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {_args(f)}, '
                         '"id": "abcDEF123"}]',
    "mistral-args": lambda f: f"[TOOL_CALLS]get_weather[ARGS]{_args(f)}",
    "deepseek": lambda f: "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                          f"{_args(f)}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "harmony": lambda f: "<|channel|>commentary to=functions.get_weather <|constrain|>json"
                         f"<|message|>{_args(f)}",
    "json": lambda f: f'{{"name": "get_weather", "arguments": {_args(f)}}}',
}
TEXT_HEAD = {"harmony": "<|channel|>final<|message|>"}


def _filled(unit: str, n_chars: int) -> str:
    return (unit * (n_chars // len(unit) + 1))[:n_chars]


def per_token(parser, answer: str) -> float:
    """Microseconds of CPU a token, reading `answer` as it grows by STEP characters and once
    more when it ends (with one reader, where the parser has them): the least of REPEATS."""
    def once() -> float:
        read = parser.reader().read if hasattr(parser, "reader") else parser.parse
        start, n = time.process_time(), 0
        for end in range(STEP, len(answer) + STEP, STEP):
            read(answer[:end], False)
            n += 1
        parts = read(answer, True)
        assert parts, answer[:80]
        return (time.process_time() - start) / n * 1e6

    return min(once() for _ in range(REPEATS))


def main() -> None:
    toolbox = Toolbox.of([Tool.model_validate(t) for t in TOOLS], "auto")
    templates = {family: name for family, (name, _) in OUTPUTS.items()}
    lengths = " | ".join(f"{n:,}" for n in LENGTHS)
    print(f"| format | text answer: µs a token at {lengths} tokens "
          f"| call, prose arguments: {lengths} | call, code arguments: {lengths} |")
    print("|---|" + "---:|" * 3 * len(LENGTHS))
    for name, call in CALLS.items():
        parser = detect(template(templates[name]), True).parser(toolbox, "")
        assert parser.format.name == name, parser.format.name
        head = TEXT_HEAD.get(name, "")
        figures = [per_token(parser, head + _filled(SENTENCE, n * STEP)) for n in LENGTHS]
        for filler in (PROSE, CODE):
            figures += [per_token(parser, call(_filled(filler, n * STEP))) for n in LENGTHS]
        print(f"| {name} | " + " | ".join(f"{c:.1f}" for c in figures) + " |", flush=True)


if __name__ == "__main__":
    main()
