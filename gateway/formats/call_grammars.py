"""Grammars for tool calls in the model's own syntax (gateway/formats/chat_formats.py).

- A required call (`tool_choice` required, any, or a named function) is generated under a
  grammar of the format's call syntax from the first token: the calls' names are the offered
  ones, and each call's arguments follow its tool's JSON schema.
- With `auto` the model writes what it likes, and the same grammar switches on only once it
  starts a call (llama.cpp's lazy grammar: a trigger pattern over the output so far). From there
  the call, and its arguments, are held to the syntax and the schema.

Every tool's arguments are converted by one llama-cpp-python schema converter, so their rules
share names (string, space...) without clashing. In formats that write arguments as text
parameters (Qwen3-Coder's XML, GLM's), a string parameter is any text that does not hold the
format's closing of a value (`</parameter>`, `</arg_value>`), as in llama.cpp's own grammars: code
with `#include <stdio.h>`, `a < b`, HTML or generics goes through whole. Any other parameter is
JSON of its schema. Reasoning that a required call follows is likewise any text without the
closing of the reasoning (`</think>`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

from gateway.edge.errors import invalid
from gateway.formats.structured import (
    MAX_GRAMMAR_BYTES,
    Grammar,
    SchemaConverter,
    check_schema,
    converting,
    gbnf_literal,
    json_strings_only,
)


class _Rules:
    """The arguments' rules of every tool, from one converter."""

    def __init__(self, functions: dict[str, dict], after: str | None) -> None:
        # Every tool offered is checked as response_format's schema is, whatever the format
        # writes of it (all of it as JSON, or each parameter as text): before anything streams.
        for name, function in functions.items():
            check_schema(function["parameters"], "tools", f"tools[{name}].parameters")
        self.functions = functions
        self.after = after
        self.converter = SchemaConverter()
        self.names = {name: f"args-{i}" for i, name in enumerate(functions)}
        self.resolved: dict[str, dict] = {}
        self.texts: dict[str, str] = {}  # a closing -> the rules of text without it

    def schema(self, name: str) -> dict:
        """A tool's parameters, their $refs resolved by the converter: on a copy, as it
        rewrites them in place (the template renders the tool's own)."""
        if name not in self.resolved:
            with converting("tools"):
                self.resolved[name] = self.converter.resolve_refs(
                    copy.deepcopy(self.functions[name]["parameters"]), name)
        return self.resolved[name]

    def arguments(self, name: str) -> str:
        """The rule of a tool's arguments, as JSON."""
        schema = self.schema(name)
        with converting("tools"):
            return self.converter.visit(schema, self.names[name])

    def parameter(self, name: str, key: str, schema: dict, closing: str) -> str:
        """The rule of one parameter written as text: a string is any text without `closing`
        (what ends the value)."""
        if schema.get("type") == "string" and not ({"enum", "const", "pattern"} & set(schema)):
            return self.text_without(closing)
        with converting("tools"):
            return self.converter.visit(schema, f"{self.names[name]}-{key}")

    def text_without(self, closing: str) -> str:
        """The rule of any text that does not hold `closing`; its rules are written once,
        however many parameters use them."""
        if closing not in self.texts:
            self.texts[closing] = f"text-without-{len(self.texts)}"
        return f"{self.texts[closing]}-0"

    def grammar(self, root: str) -> str:
        if self.after is not None:  # the reasoning the prompt opened, closed first
            root = f"{self.text_without(self.after)} {gbnf_literal(self.after)} [ \\n]* ({root})"
        texts = [rule for closing, name in self.texts.items()
                 for rule in text_without(closing, name)]
        grammar = "\n".join([f"root ::= {root}", *texts,
                             json_strings_only(self.converter.format_grammar())])
        if len(grammar) > MAX_GRAMMAR_BYTES:
            raise invalid(f"the tools make a grammar of {len(grammar)} bytes, more than "
                          f"{MAX_GRAMMAR_BYTES}", "tools")
        return grammar


def text_without(closing: str, name: str) -> list[str]:
    """GBNF rules `{name}-0`, `{name}-1`...: any text that does not hold `closing`, read from
    `{name}-0`. Rule k is where the text so far ends in the first k characters of `closing`
    (and in no longer start of it): each next character leads to the rule of the longest start
    of `closing` that the text then ends in (the Knuth-Morris-Pratt automaton), and the one that
    would complete `closing` leads nowhere. A rule may end the text where `closing`, written
    after it, is found first at its own place (for every format's closing, any rule)."""
    rules = []
    for k in range(len(closing)):
        steps = {c: _longest_start_at_end(closing[:k] + c, closing) for c in sorted(set(closing))}
        onward = {c: j for c, j in steps.items() if j > 0}  # any other character goes to 0
        alternatives = [f"[^{''.join(_class_char(c) for c in onward)}] {name}-0"]
        alternatives += [f"{gbnf_literal(c)} {name}-{j}" for c, j in onward.items()
                         if j < len(closing)]
        if (closing[:k] + closing).find(closing) == k:
            alternatives.append('""')
        rules.append(f"{name}-{k} ::= " + " | ".join(alternatives))
    return rules


def _longest_start_at_end(text: str, closing: str) -> int:
    """The length of the longest start of `closing` that `text` ends in."""
    return next(n for n in range(min(len(text), len(closing)), -1, -1)
                if text.endswith(closing[:n]))


def _class_char(c: str) -> str:
    """A character inside a GBNF character class: letters and digits as they are, anything
    else by its code (no `]`, `^`, `-` or `\\` to escape)."""
    if c.isascii() and c.isalnum():
        return c
    return f"\\x{ord(c):02X}" if ord(c) < 0x100 else f"\\U{ord(c):08X}"


@dataclass(frozen=True)
class TextCalls:
    """A format that writes each parameter of a call as text: the call's head ({name}), what
    comes before a parameter's value ({key}), what closes the value (a string value is any text
    without it), what follows the value, and the call's tail."""

    head: str
    before: str
    closing: str
    after: str
    tail: str


COMMA = '", "'
TEXT_PARAMETERS = {
    "qwen3-coder": TextCalls("<tool_call>\n<function={name}>\n", "<parameter={key}>\n",
                             "</parameter>", "\n</parameter>\n", "</function>\n</tool_call>"),
    "glm": TextCalls("<tool_call>{name}\n", "<arg_key>{key}</arg_key>\n<arg_value>",
                     "</arg_value>", "</arg_value>\n", "</tool_call>"),
}


def _alternatives(items: list[str]) -> str:
    return "(" + " | ".join(items) + ")"


def call_grammar(format_name: str, functions: dict[str, dict], forced: str | None,
                 lazy: bool, parallel: bool = True, fenced: bool = False,
                 after: str | None = None) -> Grammar | None:
    """The grammar of calls to `functions` (only `forced` when it names one) in the format
    `format_name`; lazy (for `auto`) triggered where a call begins. None for the JSON fallback
    (its grammars are gateway/formats/tools.py's). `after`: text the output writes first, as it
    likes, up to that closing mark (reasoning the prompt opened)."""
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
        text = TEXT_PARAMETERS[format_name]

        def written(name: str) -> str:
            return (f"{gbnf_literal(text.head.format(name=name))} "
                    f"{_parameters(rules, name, text)} {gbnf_literal(text.tail)}")
        return Grammar(rules.grammar(calls(each(written), '"\\n"')),
                       _trigger("<tool_call>", lazy))
    return None


def _parameters(rules: _Rules, name: str, text: TextCalls) -> str:
    """A tool's parameters written as text, in its schema's order, the required ones always,
    the others optional."""
    schema = rules.schema(name)
    required = set(schema.get("required", []))
    parts = []
    for key, sub in (schema.get("properties") or {}).items():
        if "<" in key or ">" in key or key != key.strip():
            raise invalid(f"tools[{name}].parameters.properties: the name {key!r} cannot be "
                          "written in this model's calls, which put names between `<` and "
                          "`>` markers and read them trimmed", "tools")
        value = rules.parameter(name, key, sub if isinstance(sub, dict) else {}, text.closing)
        part = (f"{gbnf_literal(text.before.format(key=key))} {value} "
                f"{gbnf_literal(text.after)}")
        parts.append(part if key in required else f"({part})?")
    return " ".join(parts) or '""'


def _trigger(marker: str, lazy: bool) -> tuple[str, ...]:
    if not lazy:
        return ()
    escaped = "".join("\\" + c if c in r"\^$.|?*+()[]{}" else c for c in marker)
    return (rf"[\s\S]*?({escaped})[\s\S]*",)
