"""Model outputs written in each model family's own format, with what they mean: the scripted
completions the format tests parse directly and replay through the real server."""

from __future__ import annotations

import json
from dataclasses import dataclass

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                   "required": ["tz"]}}}
TOOLS = [WEATHER, TIME]


@dataclass(frozen=True)
class Scripted:
    """An output and its parts: (kind, text or arguments, name)."""

    output: str
    parts: tuple[tuple[str, str, str], ...]

    def calls(self) -> list[tuple[str, dict]]:
        return [(name, json.loads(text)) for kind, text, name in self.parts if kind == "call"]

    def text(self) -> str:
        return "".join(text for kind, text, _ in self.parts if kind == "text")

    def reasoning(self) -> str:
        return "".join(text for kind, text, _ in self.parts if kind == "reasoning")


def call(name: str, **arguments) -> tuple[str, str, str]:
    return ("call", json.dumps(arguments), name)


PARIS = call("get_weather", city="Paris")
UTC = call("get_time", tz="UTC")

# Template (file in llama.cpp's models/templates) -> its format's outputs, by case.
OUTPUTS: dict[str, tuple[str, dict[str, Scripted]]] = {
    "hermes": ("Qwen-Qwen2.5-7B-Instruct.jinja", {
        "call": Scripted('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                         '\n</tool_call>', (PARIS,)),
        "parallel": Scripted(
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>',
            (PARIS, UTC)),
        "text_then_call": Scripted(
            'Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>', (("text", "Let me look that up.", ""), PARIS)),
        "malformed": Scripted('<tool_call>\n{"name": get_weather}\n</tool_call>',
                              (("text", '<tool_call>\n{"name": get_weather}\n</tool_call>',
                                ""),)),
    }),
    "hermes-thinking": ("Qwen-Qwen3-0.6B.jinja", {
        "thinking_then_call": Scripted(
            '<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{"name": '
            '"get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            (("reasoning", "The user wants the weather.", ""), PARIS)),
        "thinking_then_text": Scripted('<think>\nEasy.\n</think>\n\nHello there.',
                                       (("reasoning", "Easy.", ""),
                                        ("text", "Hello there.", ""))),
    }),
    "qwen3-coder": ("Qwen3-Coder.jinja", {
        "call": Scripted('<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n'
                         '</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n'
                         '</tool_call>', (call("get_weather", city="Paris", days=3),)),
        "parallel": Scripted(
            '<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
            '</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=tz>\n'
            'UTC\n</parameter>\n</function>\n</tool_call>', (PARIS, UTC)),
        "text_then_call": Scripted(
            'Checking.\n<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n'
            '</function>\n</tool_call>', (("text", "Checking.", ""), UTC)),
        "malformed": Scripted('<tool_call>\nget_weather Paris\n</tool_call>',
                              (("text", "<tool_call>\nget_weather Paris\n</tool_call>", ""),)),
    }),
    "llama3": ("meta-llama-Llama-3.1-8B-Instruct.jinja", {
        "call": Scripted('{"name": "get_weather", "parameters": {"city": "Paris"}}', (PARIS,)),
        "parallel": Scripted('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                             '{"name": "get_time", "parameters": {"tz": "UTC"}}',
                             (PARIS, UTC)),
        "text_then_call": Scripted(
            'One moment.<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}',
            (("text", "One moment.", ""), UTC)),
        "malformed": Scripted('{"name": "get_weather", "parameters": }',
                              (("text", '{"name": "get_weather", "parameters": }', ""),)),
    }),
    "mistral": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", {
        "call": Scripted('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, '
                         '"id": "a1b2c3d4e"}]', (PARIS,)),
        "parallel": Scripted('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": '
                             '"Paris"}}, {"name": "get_time", "arguments": {"tz": "UTC"}}]',
                             (PARIS, UTC)),
        "text_then_call": Scripted('Sure.[TOOL_CALLS][{"name": "get_time", "arguments": '
                                   '{"tz": "UTC"}}]', (("text", "Sure.", ""), UTC)),
        "malformed": Scripted('[TOOL_CALLS]get_weather(Paris)',
                              (("text", "[TOOL_CALLS]get_weather(Paris)", ""),)),
    }),
    "mistral-args": ("unsloth-mistral-Devstral-Small-2507.jinja", {
        "call": Scripted('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', (PARIS,)),
        "parallel": Scripted('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
                             '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}', (PARIS, UTC)),
        "text_then_call": Scripted('Sure.[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}',
                                   (("text", "Sure.", ""), UTC)),
    }),
    "mistral-args-ids": ("Mistral-Small-3.2-24B-Instruct-2506.jinja", {
        "call": Scripted('[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}',
                         (PARIS,)),
    }),
    "harmony": ("openai-gpt-oss-120b.jinja", {
        "call": Scripted('<|channel|>commentary to=functions.get_weather <|constrain|>json'
                         '<|message|>{"city": "Paris"}', (PARIS,)),
        "thinking_then_call": Scripted(
            '<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant'
            '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"city": "Paris"}', (("reasoning", "Need the weather.", ""), PARIS)),
        "thinking_then_text": Scripted(
            '<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final'
            '<|message|>Hello there.', (("reasoning", "Simple.", ""),
                                        ("text", "Hello there.", ""))),
    }),
    "deepseek": ("deepseek-ai-DeepSeek-V3.1.jinja", {
        "call": Scripted('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>'
                         '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', (PARIS,)),
        "parallel": Scripted(
            '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
            '<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"tz": "UTC"}'
            '<｜tool▁call▁end｜><｜tool▁calls▁end｜>', (PARIS, UTC)),
        "text_then_call": Scripted(
            'Looking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>'
            '{"tz": "UTC"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
            (("text", "Looking.", ""), UTC)),
    }),
    "deepseek-r1": ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", {
        "thinking_then_call": Scripted(
            'The weather, then.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function'
            '<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>'
            '<｜tool▁calls▁end｜>', (("reasoning", "The weather, then.", ""), PARIS)),
    }),
    "glm": ("GLM-4.6.jinja", {
        "call": Scripted('<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris'
                         '</arg_value>\n</tool_call>', (PARIS,)),
        "thinking_then_call": Scripted(
            '<think>Weather please.</think>\n<tool_call>get_time\n<arg_key>tz</arg_key>\n'
            '<arg_value>UTC</arg_value>\n</tool_call>',
            (("reasoning", "Weather please.", ""), UTC)),
    }),
    "json": ("google-gemma-2-2b-it.jinja", {
        "call": Scripted('{"name": "get_weather", "arguments": {"city": "Paris"}}', (PARIS,)),
        "malformed": Scripted('{"name": "nope", "arguments": {}}',
                              (("text", '{"name": "nope", "arguments": {}}', ""),)),
    }),
}

# A coding agent's Write tool, and file contents it writes: code full of `<`, and a template
# holding the text-parameter formats' own markers (a value may hold any text but its closing).
WRITE = {"type": "function", "function": {
    "name": "Write", "description": "Write a file",
    "parameters": {"type": "object", "properties": {"file_path": {"type": "string"},
                                                    "content": {"type": "string"}},
                   "required": ["file_path", "content"]}}}
CODE = {
    "c": "#include <stdio.h>\nint main(){ return a < b; }",
    "html": "<div><p>x</p></div>",
    "typescript": "const m: Map<string, Array<number>> = new Map();",
    "template": "{{- '<tool_call>\\n<function=' + name + '>\\n' }}</function>\n</tool_call>",
}
# The formats that write each parameter as text, and a Write call in each.
TEXT_CALLS = {
    "qwen3-coder": "<tool_call>\n<function=Write>\n<parameter=file_path>\n{path}\n</parameter>\n"
                   "<parameter=content>\n{content}\n</parameter>\n</function>\n</tool_call>",
    "glm": "<tool_call>Write\n<arg_key>file_path</arg_key>\n<arg_value>{path}</arg_value>\n"
           "<arg_key>content</arg_key>\n<arg_value>{content}</arg_value>\n</tool_call>",
}


def write_call(family: str, content: str, path: str = "main.c") -> str:
    """A Write call as the family's model writes it."""
    return TEXT_CALLS[family].format(path=path, content=content)
