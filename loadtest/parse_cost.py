"""What reading an answer in the model's format costs the gateway: every format's parser run
over an answer as it grows, token by token (4 characters each), as a stream reads it. Prints
microseconds per parse for a long text answer and a call with long arguments.

    python -m loadtest.parse_cost
"""

from __future__ import annotations

import time

from gateway.chat_formats import detect
from gateway.protocol import Tool
from gateway.tools import Toolbox
from tests.chat_outputs import TOOLS
from tests.templates import template

TEXT = "The harbour is calm today and every boat is in. " * 160  # ~1,900 tokens
ARGUMENTS = '{"city": "' + "Paris and its harbour, " * 360 + '"}'  # ~8,000 characters
CALLS = {
    "hermes": ("Qwen-Qwen2.5-7B-Instruct.jinja",
               f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGUMENTS}}}\n</tool_call>'),
    "qwen3-coder": ("Qwen3-Coder.jinja",
                    "<tool_call>\n<function=get_weather>\n<parameter=city>\n"
                    + "Paris and its harbour, " * 360
                    + "\n</parameter>\n</function>\n</tool_call>"),
    "mistral-args": ("unsloth-mistral-Devstral-Small-2507.jinja",
                     f"[TOOL_CALLS]get_weather[ARGS]{ARGUMENTS}"),
    "harmony": ("openai-gpt-oss-120b.jinja", "<|channel|>commentary to=functions.get_weather "
                f"<|constrain|>json<|message|>{ARGUMENTS}"),
}


def per_parse(parser, answer: str, step: int = 4) -> float:
    """Mean microseconds per parse, reading `answer` as it grows by `step` characters."""
    start, n = time.perf_counter(), 0
    for end in range(step, len(answer) + step, step):
        parser.parse(answer[:end], final=False)
        n += 1
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    toolbox = Toolbox.of([Tool.model_validate(t) for t in TOOLS], "auto")
    print("| format | text answer, µs per parse | call with 8k of arguments, µs per parse |")
    print("|---|---:|---:|")
    for name, (template_name, call) in CALLS.items():
        parser = detect(template(template_name), True).parser(toolbox, "")
        text = TEXT if name != "harmony" else "<|channel|>final<|message|>" + TEXT
        print(f"| {name} | {per_parse(parser, text):.0f} | {per_parse(parser, call):.0f} |")


if __name__ == "__main__":
    main()
