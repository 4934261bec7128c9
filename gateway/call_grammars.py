"""Grammars for tool calls in the model's own syntax (gateway/chat_formats.py).

- A required call (`tool_choice` required, any, or a named function) is generated under a
  grammar of the format's call syntax from the first token: the calls' names are the offered
  ones, and each call's arguments follow its tool's JSON schema.
- With `auto` the model writes what it likes, and the same grammar switches on only once it
  starts a call (llama.cpp's lazy grammar: a trigger pattern over the output so far). From there
  the call, and its arguments, are held to the syntax and the schema.

Every tool's arguments are converted by one llama-cpp-python schema converter, so their rules
share names (string, space...) without clashing. In formats that write arguments as text
parameters (Qwen3-Coder's XML, GLM's), a string parameter is any text without `<`, and any other
parameter is JSON of its schema.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from llama_cpp.llama_grammar import SchemaConverter

from gateway.errors import invalid
from gateway.structured import MAX_GRAMMAR_BYTES, Grammar, check_schema, json_strings_only


class _Rules:
    """The arguments' rules of every tool, from one converter."""

    def __init__(self, functions: dict[str, dict], after: str | None) -> None:
        self.functions = functions
        self.after = after
        self.converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False,
                                         raw_pattern=False)
        self.names = {name: f"args-{i}" for i, name in enumerate(functions)}

    def arguments(self, name: str) -> str:
        """The rule of a tool's arguments, as JSON."""
        schema = self.functions[name]["parameters"]
        check_schema(schema, "tools", f"tools[{name}].parameters")
        schema = self.converter.resolve_refs(schema, name)
        return self.converter.visit(schema, self.names[name])

    def parameter(self, name: str, key: str, schema: dict) -> str:
        """The rule of one parameter written as text: a string is text without `<`."""
        if schema.get("type") == "string" and not ({"enum", "const", "pattern"} & set(schema)):
            return "[^<]*"
        return self.converter.visit(schema, f"{self.names[name]}-{key}")

    def grammar(self, root: str) -> str:
        grammar = json_strings_only(self.converter.format_grammar())
        if self.after is not None:  # the reasoning the prompt opened, closed first
            root = f'[^<]* {json.dumps(self.after)} [ \\n]* ({root})'
        grammar = f"root ::= {root}\n{grammar}"
        if len(grammar) > MAX_GRAMMAR_BYTES:
            raise invalid(f"the tools make a grammar of {len(grammar)} bytes, more than "
                          f"{MAX_GRAMMAR_BYTES}", "tools")
        return grammar


COMMA = '", "'
# Formats that write each parameter as text: a call's head, one parameter, the call's tail.
TEXT_PARAMETERS = {
    "qwen3-coder": ('"<tool_call>\\n<function={name}>\\n"',
                    '"<parameter={key}>\\n" {value} "\\n</parameter>\\n"',
                    '"</function>\\n</tool_call>"'),
    "glm": ('"<tool_call>{name}\\n"',
            '"<arg_key>{key}</arg_key>\\n<arg_value>" {value} "</arg_value>\\n"',
            '"</tool_call>"'),
}


def _alternatives(items: list[str]) -> str:
    return "(" + " | ".join(items) + ")"


def call_grammar(format_name: str, functions: dict[str, dict], forced: str | None,
                 lazy: bool, parallel: bool = True, fenced: bool = False,
                 after: str | None = None) -> Grammar | None:
    """The grammar of calls to `functions` (only `forced` when it names one) in the format
    `format_name`; lazy (for `auto`) triggered where a call begins. None for the JSON fallback
    (its grammars are gateway/tools.py's). `after`: text the output writes first, as it likes,
    up to that closing mark (reasoning the prompt opened)."""
    rules = _Rules(functions, after)
    names = [forced] if forced else list(functions)

    def each(call: Callable[[str], str]) -> str:
        return _alternatives([call(name) for name in names])

    def calls(call: str, separator: str) -> str:
        """One call, or several (parallel_tool_calls) with `separator` between them."""
        return f"{call} ({separator} {call})*" if parallel else call

    def json_object(name: str, key: str = "arguments") -> str:
        return (f'"{{\\"name\\": \\"{name}\\", \\"{key}\\": " {rules.arguments(name)} "}}"')

    if format_name == "hermes":
        call = f'"<tool_call>\\n" {each(json_object)} "\\n</tool_call>"'
        return Grammar(rules.grammar(calls(call, '"\\n"')), _trigger("<tool_call>", lazy))
    if format_name == "llama3":
        call = each(lambda n: json_object(n, "parameters"))
        return Grammar(rules.grammar(calls(call, '"; "')),
                           (r"^\s*(\{)[\s\S]*", r"[\s\S]*?(<\|python_tag\|>)[\s\S]*")
                           if lazy else ())
    if format_name == "mistral":  # Nemo writes each call's id after it: 9 alphanumerics
        call = each(lambda n: json_object(n).removesuffix('"}"') +
                    ' (", \\"id\\": \\"" [a-zA-Z0-9]{9} "\\"")? "}"')
        return Grammar(rules.grammar(f'"[TOOL_CALLS][" {calls(call, COMMA)} "]"'),
                           _trigger("[TOOL_CALLS]", lazy))
    if format_name == "mistral-args":
        call = each(lambda n: f'"[TOOL_CALLS]{n}" ("[CALL_ID]" [a-zA-Z0-9]{{9}})? "[ARGS]" '
                              f'{rules.arguments(n)}')  # Small 3.2 writes the call's id
        return Grammar(rules.grammar(calls(call, "")), _trigger("[TOOL_CALLS]", lazy))
    if format_name == "deepseek":
        if fenced:  # R1: `function`, the separator, the name, the arguments in a JSON fence
            call = each(lambda n: f'"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\\n```json\\n" '
                                  f'{rules.arguments(n)} "\\n```<｜tool▁call▁end｜>"')
        else:
            call = each(lambda n: f'"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>" '
                                  f'{rules.arguments(n)} "<｜tool▁call▁end｜>"')
        every = calls(call, "")
        return Grammar(rules.grammar(f'"<｜tool▁calls▁begin｜>" {every} "<｜tool▁calls▁end｜>"'),
                       _trigger("<｜tool▁calls▁begin｜>", lazy))
    if format_name == "harmony":
        call = each(lambda n: f'"<|channel|>commentary to=functions.{n} <|constrain|>json'
                              f'<|message|>" {rules.arguments(n)}')
        return Grammar(rules.grammar(call),
                           (r"[\s\S]*?(<\|channel\|>commentary to=)[\s\S]*",) if lazy else ())
    if format_name in TEXT_PARAMETERS:
        head, parameter, tail = TEXT_PARAMETERS[format_name]

        def written(name: str) -> str:
            params = _parameters(rules, name, lambda key, value: parameter.format(
                key=key, value=value))
            return f"{head.format(name=name)} {params} {tail}"
        return Grammar(rules.grammar(calls(each(written), '"\\n"')),
                       _trigger("<tool_call>", lazy))
    return None


def _parameters(rules: _Rules, name: str, written: Callable[[str, str], str]) -> str:
    """A tool's parameters in its schema's order, the required ones always, the others
    optional."""
    schema = rules.functions[name]["parameters"]
    required = set(schema.get("required", []))
    parts = []
    for key, sub in (schema.get("properties") or {}).items():
        part = written(key, rules.parameter(name, key, sub if isinstance(sub, dict) else {}))
        parts.append(part if key in required else f"({part})?")
    return " ".join(parts) or '""'


def _trigger(marker: str, lazy: bool) -> tuple[str, ...]:
    if not lazy:
        return ()
    escaped = "".join("\\" + c if c in r"\^$.|?*+()[]{}" else c for c in marker)
    return (rf"[\s\S]*?({escaped})[\s\S]*",)
