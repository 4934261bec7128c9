"""`response_format` -> a GBNF grammar that llama.cpp's grammar sampler enforces token by token.

JSON schemas go through llama-cpp-python's own converter (`llama_grammar.SchemaConverter`, its
literals escaped here). It ignores what it cannot express (numeric bounds, `not`,
`uniqueItems`, ...), which would let through output the schema forbids, so every keyword is
checked first against what it supports: anything else is a 400 that names the keyword, never a
grammar that silently enforces less. Tools' parameters are checked the same way, in every call
format (gateway/formats/call_grammars.py), when the tool is `strict`; a tool that is not (Claude
Code's, most agents') is held to what a grammar can enforce of its schema, the rest left to the
client that validates the call, as llama.cpp's own converter does (`enforceable`).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from llama_cpp import llama_grammar
from llama_cpp.llama_grammar import JSON_GBNF

from gateway.edge.errors import invalid

# Keywords the converter enforces, or that do not constrain output (annotations).
_ENFORCED = {"type", "properties", "required", "additionalProperties", "items", "prefixItems",
             "minItems", "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref",
             "pattern", "minLength", "maxLength", "format"}
_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment",
                "$defs", "definitions", "deprecated", "readOnly", "writeOnly"}
_FORMATS = {"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"}
_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
PARAM = "response_format.json_schema"
MAX_REPETITIONS = 2000  # llama.cpp's MAX_REPETITION_THRESHOLD (src/llama-grammar.cpp)
MAX_DEPTH = 64
MAX_GRAMMAR_BYTES = 1 << 20  # what a worker's grammar sampler is given to parse, at most
_COUNTS = {"minLength", "maxLength", "minItems", "maxItems"}
_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")  # {m}, {m,} or {m,n} in a pattern


@dataclass(frozen=True)
class Grammar:
    """A GBNF grammar the output follows. Lazy when it has triggers: regular expressions over
    the whole output so far; the grammar applies from the first group of the first to match
    (llama.cpp's lazy grammars), and before that the output is free."""

    gbnf: str
    triggers: tuple[str, ...] = ()


def check_schema(schema: object, param: str, where: str = "schema") -> None:
    """A 400 naming the first keyword or bound a grammar could not enforce."""
    _check(schema, where, param)


def enforceable(schema: object) -> object:
    """`schema` without what no grammar here enforces: keywords the converter does not know
    (`minimum`, `not`, ...), formats it has no rule for, and counts past MAX_REPETITIONS. What is
    malformed is kept, for check_schema to refuse."""
    if not isinstance(schema, dict):
        return schema
    kept = {}
    for key, value in schema.items():
        if key not in _ENFORCED | _ANNOTATIONS or (key == "format" and value not in _FORMATS):
            continue
        if key in _COUNTS | {"pattern"} and _too_many_repetitions(key, value):
            continue
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            value = {name: enforceable(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties"):
            value = enforceable(value)
        elif key in ("prefixItems", "anyOf", "oneOf", "allOf") and isinstance(value, list):
            value = [enforceable(sub) for sub in value]
        kept[key] = value
    return kept


def _too_many_repetitions(key: str, value: object) -> bool:
    if key == "pattern":
        return isinstance(value, str) and any(
            int(n) > MAX_REPETITIONS for pair in _REPEAT.findall(value) for n in pair if n)
    return isinstance(value, int) and value > MAX_REPETITIONS


def grammar_for(kind: str, json_schema: dict | None, param: str = PARAM) -> str | None:
    """The grammar for a response_format of `kind` (text, json_object or json_schema); errors
    name `param`."""
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_GBNF
    if not isinstance(json_schema, dict) or not isinstance(json_schema.get("schema"), dict):
        raise invalid("response_format json_schema needs a `schema` object", param)
    schema = json_schema["schema"]
    _check(schema, "schema", param)
    converter = SchemaConverter()
    with converting(param):
        converter.visit(converter.resolve_refs(copy.deepcopy(schema), "stdin"), "")
    grammar = json_strings_only(converter.format_grammar())
    if len(grammar) > MAX_GRAMMAR_BYTES:
        raise invalid(f"the JSON schema makes a grammar of {len(grammar)} bytes, more than "
                      f"{MAX_GRAMMAR_BYTES}", param)
    return grammar


class SchemaConverter(llama_grammar.SchemaConverter):
    """llama-cpp-python's converter, its literals escaped whole: its own escapes `"` and line
    breaks but not `\\`, so a property name, enum or const holding a backslash or a quote made
    a grammar llama.cpp could not parse (an error in the worker, after a stream's 200) or one
    that wrote another string."""

    def __init__(self) -> None:
        super().__init__(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)

    def _format_literal(self, literal: str) -> str:
        return gbnf_literal(literal)


@contextmanager
def converting(param: str) -> Iterator[None]:
    """What the converter cannot read is a 400 naming `param`, not a 500: it raises on what it
    does not know (an assertion for a schema of annotations only)."""
    try:
        yield
    except (ValueError, KeyError, TypeError, AssertionError, RecursionError) as exc:
        raise invalid(f"the JSON schema cannot be turned into a grammar: {exc}",
                      param) from None


# llama-cpp-python's converter lets any character but `"` and `\` into a string; JSON (and
# llama.cpp's own converter) forbid the control characters there, which this model emits
# (raw newlines inside strings), making the output invalid JSON.
_LOOSE_CHAR = r'char ::= [^"\\] |'
_JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] |'


def json_strings_only(grammar: str) -> str:
    """The converter's grammar with its string characters limited to JSON's."""
    lines = grammar.split("\n")
    return "\n".join(_JSON_CHAR + line[len(_LOOSE_CHAR):] if line.startswith(_LOOSE_CHAR)
                     else line for line in lines)


def gbnf_literal(text: str) -> str:
    """`text` as a GBNF string literal: llama.cpp's grammar parser ends a literal at `"` and
    reads `\\` as an escape, so both are escaped; control characters are written `\\xHH`, so
    that each rule stays on its line (json_strings_only reads the grammar line by line)."""
    return '"' + "".join("\\" + c if c in '"\\' else
                         f"\\x{ord(c):02X}" if ord(c) < 0x20 or c == "\x7f" else c
                         for c in text) + '"'


def _check(schema: object, where: str, param: str, depth: int = 0) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise invalid(f"{where} must be a JSON schema object", param)
    if depth > MAX_DEPTH:  # llama.cpp parses grammars recursively, in the worker
        raise invalid(f"the JSON schema nests deeper than {MAX_DEPTH} levels (at {where})",
                      param)
    for key, value in schema.items():
        if key not in _ENFORCED | _ANNOTATIONS:
            raise invalid(f"the JSON schema keyword '{key}' (at {where}) is not supported: "
                          "outputs could not be constrained by it", param, "unsupported")
        _check_repetition(key, value, where, param)
        if key in ("properties", "$defs", "definitions"):
            for name, sub in _mapping(value, f"{where}.{key}", param).items():
                _check(sub, f"{where}.{key}.{name}", param, depth + 1)
        elif key in ("items", "additionalProperties"):
            _check(value, f"{where}.{key}", param, depth + 1)
        elif key in ("prefixItems", "anyOf", "oneOf", "allOf"):
            if not isinstance(value, list):
                raise invalid(f"{where}.{key} must be a list of schemas", param)
            for i, sub in enumerate(value):
                _check(sub, f"{where}.{key}[{i}]", param, depth + 1)
        elif key == "format" and value not in _FORMATS:
            raise invalid(f"the string format '{value}' (at {where}) is not supported", param,
                          "unsupported")
        elif key == "type":
            types = value if isinstance(value, list) else [value]
            if not all(isinstance(t, str) and t in _TYPES for t in types):
                raise invalid(f"{where}.type {value!r} is not a JSON schema type", param)
        elif key == "required" and not (isinstance(value, list) and
                                        all(isinstance(name, str) for name in value)):
            raise invalid(f"{where}.required must be a list of property names", param)


def _check_repetition(key: str, value: object, where: str, param: str) -> None:
    """The converter writes a bound out as that many copies of its rule (8 MB of grammar per
    million), and llama.cpp refuses repetitions past MAX_REPETITIONS anyway: refuse them here,
    before any grammar is built."""
    if key in _COUNTS:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise invalid(f"{where}.{key} must be a non-negative integer", param)
        bounds = [value]
    elif key == "pattern":
        if not isinstance(value, str):
            raise invalid(f"{where}.pattern must be a string", param)
        bounds = [int(n) for pair in _REPEAT.findall(value) for n in pair if n]
    else:
        return
    if any(n > MAX_REPETITIONS for n in bounds):
        raise invalid(f"the JSON schema keyword '{key}' (at {where}) asks for more than "
                      f"{MAX_REPETITIONS} repetitions, the most llama.cpp's grammars allow",
                      param, "unsupported")


def _mapping(value: object, where: str, param: str) -> dict:
    if not isinstance(value, dict):
        raise invalid(f"{where} must be an object", param)
    return value
