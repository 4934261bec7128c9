"""The model's own output format, recognised from its chat template: where its reasoning is and
how it writes tool calls. An answer is parsed into parts, in order: reasoning, text, calls.

    | format       | calls, as the model writes them                                | reasoning |
    |--------------|----------------------------------------------------------------|-----------|
    | hermes       | <tool_call>{"name": ..., "arguments": {...}}</tool_call>       | <think>   |
    | qwen3-coder  | <tool_call><function=NAME><parameter=KEY>v</parameter>...      | <think>   |
    | glm          | <tool_call>NAME<arg_key>KEY</arg_key><arg_value>v</arg_value>  | <think>   |
    | llama3       | {"name": ..., "parameters": {...}} (or after <|python_tag|>)   |           |
    | mistral      | [TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}]     |           |
    | mistral-args | [TOOL_CALLS]NAME[ARGS]{...}                                    | [THINK]   |
    | deepseek     | <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}                   | <think>   |
    | harmony      | <|channel|>commentary to=functions.NAME ...<|message|>{...}    | analysis  |
    | json         | the whole answer is {"name": ..., "arguments": {...}}          |           |

`json` is the fallback: for a template without its own call syntax, and for one without tools
at all (then the tools are described in the system prompt, gateway/formats/tools.py).

The parser reads the whole answer so far, each time it grows, and returns its parts. Parts only
ever grow: a parse of a longer answer extends the last parse's parts and may add new ones, never
changes what was returned. So a stream sends each part's growth as it comes. To keep that true,
text that may be the start of a marker is held back until it is known, and a call is returned
from the moment its name is known, its arguments (JSON) as far as they are written. A stream
reads its answer with a reader of its own (`OutputParser.reader`), which gives the same parts as
parsing the whole answer so far, at a cost per token that does not grow with the answer: it
resumes after what is settled (closed reasoning, closed calls, text before a call), and its
searches and JSON scans resume where they ran out of text (loadtest/parse_cost.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field

from gateway.formats.call_grammars import call_grammar
from gateway.formats.structured import Grammar
from gateway.formats.tools import Toolbox


@dataclass
class Part:
    kind: str  # "reasoning" | "text" | "call"
    text: str = ""  # reasoning or answer text; a call's arguments (JSON) so far
    name: str = ""  # a call's function
    id: str | None = None  # a call's id, when the model wrote one (Mistral)
    done: bool = False  # a call whose arguments are whole


@dataclass(frozen=True)
class ChatFormat:
    name: str
    think: tuple[str, str] | None = None  # reasoning between these tags
    markers: tuple[str, ...] = ()  # what the output keeps of the model's special tokens
    short_call_ids: bool = False  # the template wants 9-character alphanumeric call ids
    fenced: bool = False  # DeepSeek R1: arguments in a ```json fence

    def parser(self, toolbox: Toolbox | None, prompt: str) -> OutputParser | None:
        """None when answers are plain text (no tools, no reasoning)."""
        if toolbox is None and self.think is None and self.name != "harmony":
            return None
        return OutputParser(self, toolbox, self.think is not None and _opens(prompt, self.think),
                            self.answer_head(toolbox))

    def answer_head(self, toolbox: Toolbox | None) -> str:
        """What the prompt writes of the answer: in the JSON format, a named call's head, so
        that the model generates only the arguments (no token spent on the wrapper)."""
        if self.name != "json" or toolbox is None or not toolbox.forced:
            return ""
        return f'{{"name": {json.dumps(toolbox.forced)}, "arguments": '

    def grammar(self, toolbox: Toolbox | None, thinking: bool = False) -> Grammar | None:
        """The grammar of calls: from the first token when one is required (after the
        reasoning, when the prompt opened it), lazy under `auto`
        (gateway/formats/call_grammars.py). The JSON fallback has only its required one
        (gateway/formats/tools.py): under `auto` an answer that is not a call may be any JSON."""
        if toolbox is None:
            return None
        if self.name == "json":
            return Grammar(toolbox.grammar()) if toolbox.forced is not None else None
        forced = toolbox.forced is not None
        return call_grammar(self.name, toolbox.held_functions(), toolbox.forced or None,
                            lazy=not forced, parallel=toolbox.parallel, fenced=self.fenced,
                            after=self.think[1] if thinking and forced else None)

    def call_id(self, call_id: str) -> str:
        """A call's id as the template takes it: the same id always maps the same way, so a
        conversation renders the same each turn (and hits the cache)."""
        if not self.short_call_ids or re.fullmatch(r"[A-Za-z0-9]{9}", call_id):
            return call_id
        return hashlib.sha256(call_id.encode()).hexdigest()[:9]


@dataclass(frozen=True)
class Reasoning:
    """What a request asks of a reasoning model, as chat templates take it: `enable_thinking`
    (Qwen3, GLM), `thinking` (DeepSeek V3.1), `reasoning_effort` (gpt-oss). None: the
    template's default."""

    enabled: bool | None = None
    effort: str | None = None

    @classmethod
    def of_effort(cls, effort: str | None) -> Reasoning:
        """OpenAI's reasoning_effort: `none` and `minimal` turn thinking off where a template
        can; the level goes to templates that take one."""
        if effort is None:
            return cls()
        return cls(effort not in ("none", "minimal"), effort if effort in (
            "low", "medium", "high") else None)

    def template_options(self) -> dict:
        options = {}
        if self.enabled is not None:
            options |= {"enable_thinking": self.enabled, "thinking": self.enabled}
        if self.effort is not None:
            options["reasoning_effort"] = self.effort
        return options


TEMPLATE_DEFAULT = Reasoning()
THINK = ("<think>", "</think>")
HARMONY = ("<|start|>", "<|end|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|call|>",
           "<|return|>")
DEEPSEEK = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")


def detect(template: str, takes_tools: bool) -> ChatFormat:
    """The format a template's model writes, from the markers its template renders."""
    think = THINK if "<think>" in template else None
    if "<|channel|>" in template:
        return ChatFormat("harmony", markers=HARMONY)
    if "<｜tool▁call▁begin｜>" in template:
        return ChatFormat("deepseek", think, DEEPSEEK + THINK, fenced="```json" in template)
    if "[TOOL_CALLS]" in template:
        short = "length 9" in template
        if "[ARGS]" in template:
            mistral_think = ("[THINK]", "[/THINK]") if "[THINK]" in template else None
            return ChatFormat("mistral-args", mistral_think,
                              ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]"),
                              short)
        return ChatFormat("mistral", None, ("[TOOL_CALLS]",), short)
    if "<tool_call>" in template:
        if "<function=" in template:
            return ChatFormat("qwen3-coder", think, ("<tool_call>", "</tool_call>") + THINK)
        if "<arg_key>" in template:
            return ChatFormat("glm", think, ("<tool_call>", "</tool_call>") + THINK)
        return ChatFormat("hermes", think, ("<tool_call>", "</tool_call>") + THINK)
    if "<|python_tag|>" in template or ('"parameters"' in template and "ipython" in template):
        return ChatFormat("llama3", None, ("<|python_tag|>",))
    return ChatFormat("json", think, THINK if think else ())


def _opens(prompt: str, tags: tuple[str, str]) -> bool:
    """Whether the prompt leaves the answer inside reasoning (the template opened it)."""
    return prompt.rfind(tags[0]) > prompt.rfind(tags[1])


# Where each format's calls begin.
OPENERS = {
    "hermes": ("<tool_call>",), "qwen3-coder": ("<tool_call>",), "glm": ("<tool_call>",),
    "llama3": ("<|python_tag|>",), "mistral": ("[TOOL_CALLS]",),
    "mistral-args": ("[TOOL_CALLS]",), "deepseek": ("<｜tool▁calls▁begin｜>",
                                                   "<｜tool▁call▁begin｜>"),
    "json": (), "harmony": (),
}
# Formats whose call may also be the whole answer, a JSON object from its first character.
LEADING_OBJECT = ("llama3", "json")


class _Malformed(Exception):
    """What began as a call is not one: it is text."""


@dataclass
class OutputParser:
    """Reads answers in a format. `parse` reads one answer at a time; `reader` gives a parser
    of its own to one answer read as it grows (`read`), whose cost per token does not grow
    with the answer: it resumes after what is settled (closed reasoning, closed calls), and
    its searches and scans resume where they last ran out of text."""

    format: ChatFormat
    toolbox: Toolbox | None
    thinking: bool  # the answer starts inside reasoning
    head: str = ""  # the answer's start, written by the prompt
    openers: tuple[str, ...] = field(init=False)
    # A reader's memory of its answer so far (positions count from the start of head + answer):
    _read: int = field(init=False, repr=False, compare=False)  # the answer's length so far
    # (pos, at_start, parts): where a parse may resume, the parts before it settled.
    _settled: tuple[int, bool, tuple[Part, ...]] | None = field(init=False, repr=False,
                                                                compare=False)
    _finds: dict[tuple[str, int], int] = field(init=False, repr=False, compare=False)
    # Scans of JSON values by where they start: (how far, depth, open string's start, closed).
    _scans: dict[int, tuple[int, int, int | None, bool]] = field(init=False, repr=False,
                                                                 compare=False)
    _pairs_read: dict[int, tuple[str, str, int]] = field(init=False, repr=False, compare=False)
    _members: dict[int, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.openers = OPENERS[self.format.name] if self.toolbox is not None else ()
        self._read, self._settled = 0, None
        self._finds, self._scans, self._pairs_read, self._members = {}, {}, {}, {}

    def call_grammar(self) -> Grammar | None:
        return self.format.grammar(self.toolbox, self.thinking)

    def reader(self) -> OutputParser:
        """A parser for one answer read as it grows: see `read`."""
        return dataclasses.replace(self)

    def parse(self, text: str, final: bool) -> list[Part]:
        """The parts of an answer so far; `final` once it has ended."""
        return self.reader().read(text, final)

    def read(self, text: str, final: bool) -> list[Part]:
        """The parts of this reader's answer so far, as `parse` gives them: each call's text
        extends the last call's (a reader per answer)."""
        if len(text) < self._read:
            raise ValueError("a reader reads one answer as it grows; this one shrank")
        self._read = len(text)
        text = self.head + text
        if self.format.name == "harmony":
            return _Harmony(self, final).parse(text)
        if self._settled is not None:
            pos, at_start, parts = self._resume()
        else:
            parts = []
            pos = self._reasoning(text, final, parts)
            if pos is None:
                return parts
            pos = _skip_space(text, pos)
            at_start = True
        while pos < len(text):
            self._settle(pos, at_start, parts)
            start, opener = self._next_call(text, pos, at_start)
            if start is None:
                _add_text(parts, text[pos:] if final else
                          text[pos:_held_end(text, pos, self.openers)])
                break
            _add_text(parts, text[pos:start].rstrip())
            self._settle(start, at_start, parts)  # the text before a call is settled too
            calls_before = len(parts)
            try:
                end = self._calls(text, start, opener, final, parts)
            except _Malformed:
                del parts[calls_before:]
                end = self._malformed_end(text, start, opener, final)
                if end is None:
                    break
                _add_text(parts, text[start:end])
                pos, at_start = end, False
                continue
            if end is None:
                break
            pos, at_start = _skip_space(text, end), False
        return parts

    # ----- what a reader remembers -------------------------------------------------------

    def _settle(self, pos: int, at_start: bool, parts: list[Part]) -> None:
        """A parse is at `pos` with the parts before it read: everything before `pos` is
        settled (the reasoning and calls before it closed, and `pos` is inside the text), so
        a longer answer's parse comes here the same way. Only a text part at the end may
        still grow: it is copied."""
        if self._settled is None or self._settled[0] != pos:
            self._settled = (pos, at_start, tuple(_own_last(parts)))

    def _resume(self) -> tuple[int, bool, list[Part]]:
        pos, at_start, parts = self._settled
        return pos, at_start, _own_last(list(parts))

    def _find(self, text: str, sub: str, start: int, base: int = 0) -> int:
        """text.find(sub, start), `text` being the answer from `base` on (maybe cut before its
        end): a search that found nothing resumes where it stopped (the answer only grows)."""
        key = (sub, base + start)
        begin = max(start, self._finds.get(key, 0) - base)
        found = text.find(sub, begin)
        self._finds[key] = base + (found if found >= 0 else
                                   max(begin, len(text) - len(sub) + 1))
        return found

    def _object_end(self, text: str, start: int, base: int = 0) -> int | None:
        """The index after the JSON object or array opening at `start`; None if not yet closed.
        Strings are skipped with str.find, and a scan resumes where the last one on this
        answer stopped, with its depth: a long argument costs its new characters only."""
        key = base + start
        scan = self._scans.get(key)
        if scan is not None and scan[0] - base <= len(text):
            i, depth, string, closed = scan[0] - base, scan[1], scan[2], scan[3]
            if closed:
                return i
            string = None if string is None else string - base
        else:
            i, depth, string = start, 0, None
        while True:
            if string is not None:
                close = _string_close(text, string, i)
                if close is None:
                    self._scans[key] = (base + len(text), depth, base + string, False)
                    return None
                i, string = close, None
            found = _STRUCTURE.search(text, i)
            if found is None:
                self._scans[key] = (base + len(text), depth, None, False)
                return None
            i = found.end()
            mark = found.group()
            if mark == '"':
                string = i
            elif mark in "{[":
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    self._scans[key] = (base + i, 0, None, True)
                    return i

    def _string_end(self, text: str, start: int, base: int = 0) -> int | None:
        """The index after the `"` closing a string whose content begins at `start`."""
        key = -(base + start) - 1  # beside the objects' scans, apart from them
        scan = self._scans.get(key)
        searched = start if scan is None else max(start, scan[0] - base)
        end = _string_close(text, start, searched)
        self._scans[key] = (base + (len(text) if end is None else end - 1), 0, None, False)
        return end

    # ----- reasoning ---------------------------------------------------------------------

    def _reasoning(self, text: str, final: bool, parts: list[Part]) -> int | None:
        """Where the answer begins after any reasoning; None while the reasoning goes on."""
        if self.format.think is None:
            return 0
        opening, closing = self.format.think
        start = 0
        if not self.thinking:
            stripped = _skip_space(text, 0)
            if text.startswith(opening, stripped):
                start = stripped + len(opening)
            elif not final and opening.startswith(text[stripped:stripped + len(opening)]) \
                    and len(text) - stripped <= len(opening):
                return None  # may be the opening tag, not yet whole
            else:
                return 0
        end = self._find(text, closing, start)
        if end < 0:
            cut = len(text) if final else _held_end(text, start, (closing,))
            parts.append(Part("reasoning", text[min(_skip_space(text, start), cut):cut]))
            return None
        parts.append(Part("reasoning", text[start:end].strip()))
        return end + len(closing)

    # ----- calls -------------------------------------------------------------------------

    def _next_call(self, text: str, pos: int, at_start: bool) -> tuple[int | None, str]:
        found = [(i, o) for o in self.openers if (i := self._find(text, o, pos)) >= 0]
        if self.toolbox is not None and at_start and self.format.name in LEADING_OBJECT \
                and text.startswith("{", pos):
            found.append((pos, "{"))
        if not found:
            return None, ""
        return min(found)

    def _calls(self, text: str, start: int, opener: str, final: bool,
               parts: list[Part]) -> int | None:
        """Parse the calls from `start` into parts; where they end (None: not yet ended)."""
        name = self.format.name
        if opener == "{" or name == "llama3":
            return self._llama_objects(text, start + (0 if opener == "{" else len(opener)),
                                       final, parts)
        body = start + len(opener)
        if name == "hermes":
            return self._tagged(text, body, "</tool_call>", final, parts, self._hermes_call)
        if name == "qwen3-coder":
            return self._tagged(text, body, "</tool_call>", final, parts, self._xml_call,
                                XML_PARAMETER)
        if name == "glm":
            return self._tagged(text, body, "</tool_call>", final, parts, self._glm_call,
                                GLM_PARAMETER)
        if name == "mistral":
            return self._mistral_list(text, body, final, parts)
        if name == "mistral-args":
            return self._mistral_args(text, body, final, parts)
        return self._deepseek(text, start, opener, final, parts)

    def _malformed_end(self, text: str, start: int, opener: str, final: bool) -> int | None:
        """Where text that looked like a call ends: at the format's closing, else the end."""
        closing = {"hermes": "</tool_call>", "qwen3-coder": "</tool_call>",
                   "glm": "</tool_call>", "deepseek": "<｜tool▁calls▁end｜>"
                   }.get(self.format.name)
        if closing and opener != "{":
            end = self._find(text, closing, start)
            if end >= 0:
                return end + len(closing)
        return len(text) if final else None

    def _call(self, parts: list[Part], name: str, arguments: str, done: bool,
              call_id: str | None = None) -> None:
        if name not in self.toolbox.functions:
            raise _Malformed
        parts.append(Part("call", arguments, name, call_id, done))

    def _tagged(self, text: str, body: int, closing: str, final: bool, parts: list[Part],
                read, parameter: Parameter | None = None) -> int | None:
        """One call between an opener and `closing`, its body read by `read`; in a format
        that writes `parameter`s as text, a `closing` inside a value does not close the call."""
        end = self._find(text, closing, body) if parameter is None else \
            self._closing_after_values(text, body, closing, parameter)
        inner = text[body:end] if end >= 0 else text[body:]
        read(inner, end >= 0 or final, parts, body)
        return None if end < 0 else end + len(closing)

    def _hermes_call(self, inner: str, whole: bool, parts: list[Part], base: int) -> None:
        end = self._object_call(inner, whole, parts, ("arguments",), base)
        if whole and (end is None or inner[end:].strip()):
            raise _Malformed

    def _object_call(self, text: str, final: bool, parts: list[Part],
                     argument_keys: tuple[str, ...], base: int = 0) -> int | None:
        """One call object at the start of `text` (the answer from `base` on):
        `{"name": ..., <argument key>: {...}}`, keys in any order (an `id` is kept). Its
        arguments are returned as they are written; a call whose arguments come before its
        name, once both are read. Where the object ends; None while it is not yet closed."""
        pos = _skip_space(text, 0)
        if pos >= len(text):
            if final:
                raise _Malformed
            return None
        if text[pos] != "{":
            raise _Malformed
        pos += 1
        name = call_id = None
        arguments: tuple[int, int | None] | None = None
        emitted = len(parts)
        while True:
            pos = _skip_space(text, pos)
            if pos >= len(text):
                break
            if text[pos] in ",}":
                if text[pos] == "}":
                    if name is None or arguments is None:
                        raise _Malformed
                    self._argued(parts, emitted, name, text, arguments, True, call_id)
                    return pos + 1
                pos += 1
                continue
            if text[pos] != '"':
                raise _Malformed
            key_end = self._value_end(text, pos, final, base)
            if key_end is None:
                break
            key = json.loads(text[pos:key_end])
            colon = _skip_space(text, key_end)
            if colon < len(text) and text[colon] != ":":
                raise _Malformed
            value = _skip_space(text, colon + 1)
            if value >= len(text):
                break
            # Arguments cut by the length limit are returned as far as they got.
            end = self._value_end(text, value, final and key not in argument_keys, base)
            if key in argument_keys:
                arguments = (value, end)
            elif key == "name" and end is not None:
                name = json.loads(text[value:end])
                if not isinstance(name, str):
                    raise _Malformed
            elif key == "id" and end is not None:
                call_id = str(json.loads(text[value:end]))
            if end is None:
                break
            pos = end
        # Not closed: still being written, or cut by the length limit.
        if name is not None and arguments is not None:
            self._argued(parts, emitted, name, text, arguments,
                         final and arguments[1] is not None, call_id)
        elif final:
            raise _Malformed
        return len(text) if final else None

    def _value_end(self, text: str, start: int, final: bool, base: int = 0) -> int | None:
        """The index after the JSON value at `start`; None while it may go on."""
        if text[start] in "{[":
            end = self._object_end(text, start, base)
        elif text[start] == '"':
            end = self._string_end(text, start + 1, base)
        else:
            literal = next((w for w in _LITERALS if text.startswith(w, start)), None)
            number = _NUMBER.match(text, start)
            rest = text[start:start + 6]  # a literal's start is shorter
            if literal is not None:
                end = start + len(literal)
            elif number is not None and (final or number.end() < len(text)):
                end = number.end()
            elif not final and ((len(rest) < 6 and any(w.startswith(rest) for w in _LITERALS))
                                or _NUMBER_SO_FAR.fullmatch(text, start)):
                end = None
            else:
                raise _Malformed
        if end is None and final:
            raise _Malformed
        return end

    def _argued(self, parts: list[Part], index: int, name: str, text: str,
                arguments: tuple[int, int | None], done: bool, call_id: str | None) -> None:
        """The call at parts[index], its arguments as far as they are written. Arguments
        written as a JSON string (some models quote them) are returned once whole."""
        start, end = arguments
        raw = text[start:len(text) if end is None else end]
        if raw.startswith('"'):
            decoded = json.loads(raw) if end is not None else ""
            raw = decoded if isinstance(decoded, str) else raw
        del parts[index:]
        self._call(parts, name, raw, done, call_id)

    def _llama_objects(self, text: str, pos: int, final: bool, parts: list[Part]) -> int | None:
        """Call objects, one after another (separated by `;` or space), to the end."""
        while True:
            pos = _skip_space(text, pos)
            if pos >= len(text):
                return pos if final else None
            if text[pos] != "{":
                if len(parts) and parts[-1].kind == "call":
                    return pos
                raise _Malformed
            end = self._object_call(text[pos:], final, parts, ("parameters", "arguments"), pos)
            if end is None:
                return None
            pos = _skip_space(text, pos + end)
            if text.startswith(";", pos):
                pos += 1

    def _mistral_list(self, text: str, pos: int, final: bool, parts: list[Part]) -> int | None:
        pos = _skip_space(text, pos)
        if pos >= len(text):
            return len(text) if final else None
        if text[pos] != "[":
            raise _Malformed
        pos += 1
        while True:
            pos = _skip_space(text, pos)
            if pos >= len(text):
                return len(text) if final else None
            if text[pos] == "]":
                return pos + 1
            if text[pos] == ",":
                pos += 1
                continue
            end = self._object_call(text[pos:], final, parts, ("arguments",), pos)
            if end is None:
                return None
            pos += end

    def _mistral_args(self, text: str, pos: int, final: bool, parts: list[Part]) -> int | None:
        """NAME[ARGS]{...} (Mistral Small 3.2: NAME[CALL_ID]ID[ARGS]{...}), again after each
        [TOOL_CALLS]. A later call cut short before its arguments is left as text."""
        first = True
        while True:
            sep = self._find(text, "[ARGS]", pos)
            name, _, call_id = text[pos:sep if sep >= 0 else len(text)].partition("[CALL_ID]")
            name, call_id = name.strip(), call_id.strip() or None
            if sep < 0 and not final and len(text) - pos <= 128:
                return None
            if sep < 0 or name not in self.toolbox.functions:
                if first:
                    raise _Malformed
                return pos - len("[TOOL_CALLS]")
            args = _skip_space(text, sep + len("[ARGS]"))
            end = self._object_end(text, args) if args < len(text) else None
            if args < len(text) and text[args] != "{":
                raise _Malformed
            self._call(parts, name, text[args:end if end else len(text)], end is not None,
                       call_id)
            if end is None:
                return len(text) if final else None
            following = _skip_space(text, end)
            if not text.startswith("[TOOL_CALLS]", following):
                return end
            pos, first = following + len("[TOOL_CALLS]"), False

    def _deepseek(self, text: str, start: int, opener: str, final: bool,
                  parts: list[Part]) -> int | None:
        """<｜tool▁call▁begin｜>[function<｜tool▁sep｜>]NAME[\\n```json\\n]<｜tool▁sep｜>{...}...
        inside <｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜> (R1 and V3 write `function`, the
        separator, the name and the arguments fenced; V3.1 the name, the separator, the JSON)."""
        begin, end_all = "<｜tool▁call▁begin｜>", "<｜tool▁calls▁end｜>"
        pos = start + (len(opener) if opener != begin else 0)
        while True:
            pos = _skip_space(text, pos)
            if text.startswith(end_all, pos):
                return pos + len(end_all)
            if pos >= len(text) or not text.startswith(begin, pos):
                rest = text[pos:pos + len(begin) + len(end_all)]  # longer than either
                if pos < len(text) and not begin.startswith(rest) and \
                        not end_all.startswith(rest):
                    return pos  # calls without their closing marker, then text
                return len(text) if final else None
            head = pos + len(begin)
            sep = self._find(text, "<｜tool▁sep｜>", head)
            if sep < 0:
                return len(text) if final else None
            name, after = text[head:sep].strip(), sep + len("<｜tool▁sep｜>")
            if name == "function":  # R1: the name on the line after the separator
                newline = self._find(text, "\n", after)
                if newline < 0:
                    return len(text) if final else None
                name, after = text[after:newline].strip(), newline
            args = self._find(text, "{", after)
            if args < 0:
                return len(text) if final else None
            end = self._object_end(text, args)
            self._call(parts, name, text[args:end if end else len(text)], end is not None)
            if end is None:
                return len(text) if final else None
            close = self._find(text, "<｜tool▁call▁end｜>", end)
            if close < 0:
                return len(text) if final else None
            pos = close + len("<｜tool▁call▁end｜>")

    def _xml_call(self, inner: str, whole: bool, parts: list[Part], base: int) -> None:
        """<function=NAME><parameter=KEY>\\nVALUE\\n</parameter>...</function>"""
        head = re.match(r"\s*<function=([^>\n]+)>", inner)
        if head is None:
            if whole:
                raise _Malformed
            return
        params = self._pairs(inner, head.end(), XML_PARAMETER, base)
        rest = self._pairs_read[params[-1][2]][2] - base if params else head.end()
        done = whole or inner.startswith("</function>", _skip_space(inner, rest))
        self._params(parts, head.group(1).strip(), params, done)

    def _glm_call(self, inner: str, whole: bool, parts: list[Part], base: int) -> None:
        """NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>..."""
        head = re.match(r"\s*([^<\n]+?)\s*(?:\n|<arg_key>|$)", inner)
        if head is None or (not whole and "\n" not in inner and "<arg_key>" not in inner):
            if whole:
                raise _Malformed
            return
        params = self._pairs(inner, 0, GLM_PARAMETER, base)
        self._params(parts, head.group(1).strip(), params, whole)

    def _pairs(self, body: str, pos: int, parameter: Parameter,
               base: int) -> list[tuple[str, str, int]]:
        """The parameters written whole in `body` (the answer from `base` on) from `pos`, as
        (key, value, where): each key between `parameter`'s key markers, its value after it
        between its value markers (one newline trimmed at each end). Each is read once."""
        key = (parameter.key_open, parameter.key_close)
        value = (parameter.value_open, parameter.value_close)
        pairs = []
        while True:
            known = self._pairs_read.get(base + pos)
            if known is not None and known[2] - base <= len(body):
                pairs.append((known[0], known[1], base + pos))
                pos = known[2] - base
                continue
            start = self._find(body, key[0], pos, base)
            if start < 0:
                return pairs
            key_end = self._find(body, key[1], start + len(key[0]), base)
            opened = self._find(body, value[0], key_end + len(key[1]), base) \
                if key_end >= 0 else -1
            closed = self._find(body, value[1], opened + len(value[0]), base) \
                if opened >= 0 else -1
            if closed < 0:
                return pairs
            text = body[opened + len(value[0]):closed]
            pair = (body[start + len(key[0]):key_end],
                    text.removeprefix("\n").removesuffix("\n"), base + closed + len(value[1]))
            self._pairs_read[base + pos] = pair
            pairs.append((pair[0], pair[1], base + pos))
            pos = closed + len(value[1])

    def _closing_after_values(self, text: str, pos: int, closing: str,
                              parameter: Parameter) -> int:
        """Where `closing` is first written from `pos` outside a parameter's value (a value
        may hold `</tool_call>`, as code or a template does); -1 while it is not written or a
        value is open."""
        while (close := self._find(text, closing, pos)) >= 0:
            start = self._find(text, parameter.key_open, pos)
            if start < 0 or start > close:
                return close
            value_end = self._find(text, parameter.value_close, start + len(parameter.key_open))
            if value_end < 0:
                return -1
            pos = value_end + len(parameter.value_close)
        return -1

    def _params(self, parts: list[Part], name: str, params: list[tuple[str, str, int]],
                whole: bool) -> None:
        """Parameters written as text, as JSON arguments: each value typed by the tool's
        schema (a string stays a string; anything else is read as JSON when it parses)."""
        if name not in self.toolbox.functions:
            raise _Malformed
        schema = self.toolbox.functions[name]["parameters"].get("properties", {})
        members = []
        for key, value, where in params:
            member = self._members.get(where)
            if member is None:
                member = self._members[where] = \
                    f"{json.dumps(key.strip())}: {_typed(value, schema.get(key.strip(), {}))}"
            members.append(member)
        self._call(parts, name, "{" + ", ".join(members) + ("}" if whole else ""), whole)


@dataclass(frozen=True)
class Parameter:
    """How a format writes a parameter as text: its key between two markers, then its value
    between two more. A value may hold any text but `value_close`."""

    key_open: str
    key_close: str
    value_open: str
    value_close: str


XML_PARAMETER = Parameter("<parameter=", ">", "", "</parameter>")  # Qwen3-Coder
GLM_PARAMETER = Parameter("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")


def call_grammar_of(parser: OutputParser | None) -> Grammar | None:
    """The grammar of a request's tool calls; None when its answer is plain."""
    return parser.call_grammar() if parser is not None else None


class _Harmony:
    """gpt-oss: messages `<|channel|>CHANNEL[ to=functions.NAME][ <|constrain|>json]<|message|>
    CONTENT` ending in <|end|> (then `<|start|>assistant` and the next), <|call|> or
    <|return|>. analysis is reasoning, final the answer, a commentary to a function a call,
    commentary to no one text (a preamble)."""

    ENDS = ("<|end|>", "<|call|>", "<|return|>")

    def __init__(self, parser: OutputParser, final: bool) -> None:
        self.parser, self.final = parser, final

    def parse(self, text: str) -> list[Part]:
        parser = self.parser
        pos, parts = (parser._resume()[::2] if parser._settled is not None else (0, []))
        while pos < len(text):
            parser._settle(pos, False, parts)  # the messages before it ended
            if text.startswith("<|start|>", pos):
                pos = parser._find(text, "<|channel|>", pos)
                if pos < 0:
                    break
            head_end = parser._find(text, "<|message|>", pos)
            if head_end < 0:
                if self.final and not parts:
                    _add_text(parts, text[pos:])  # not harmony at all: text
                break
            header = text[pos:head_end]
            body = head_end + len("<|message|>")
            ends = [(i, e) for e in self.ENDS if (i := parser._find(text, e, body)) >= 0]
            end, marker = min(ends) if ends else (None, "")
            content = text[body:end] if end is not None else (
                text[body:] if self.final else text[body:_held_end(text, body, self.ENDS)])
            self._message(header, content, end is not None or self.final, parts)
            if end is None:
                break
            pos = end + len(marker)
        return parts

    def _message(self, header: str, content: str, whole: bool, parts: list[Part]) -> None:
        channel = re.search(r"<\|channel\|>\s*(\w+)", header)
        recipient = re.search(r"to=functions\.([\w.-]+)", header)
        if recipient is not None and self.parser.toolbox is not None:
            try:
                self.parser._call(parts, recipient.group(1), content.strip() if whole
                                  else content.lstrip(), whole)
                return
            except _Malformed:
                pass
        if channel is not None and channel.group(1) == "analysis":
            parts.append(Part("reasoning", content))
        else:
            _add_text(parts, content)


# ----- pieces ----------------------------------------------------------------------------

def _add_text(parts: list[Part], text: str) -> None:
    if not text:
        return
    if parts and parts[-1].kind == "text":
        parts[-1].text += text
    else:
        parts.append(Part("text", text))


def _own_last(parts):
    """`parts` (a list or tuple) with a text part at its end copied: the one part that a
    later read may extend (_add_text)."""
    if parts and parts[-1].kind == "text":
        parts = [*parts[:-1], dataclasses.replace(parts[-1])]
    return parts


def _held_end(text: str, start: int, markers: tuple[str, ...]) -> int:
    """Where text[start:] ends without its end when that end may be the start of a marker (or
    of whitespace before one): what is held back until the next output says."""
    cut = len(text)
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text) - start), 0, -1):
            if text.endswith(marker[:n]):
                cut = min(cut, len(text) - n)
                break
    if markers and cut > start and text[cut - 1].isspace():
        cut = start + len(text[start:cut].rstrip())
    return cut


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


_STRUCTURE = re.compile(r'[{}\[\]"]')


def _string_close(text: str, i: int, search: int | None = None) -> int | None:
    """The index after the `"` that closes a string whose content begins at `i`; `search`:
    where to look for it from (every quote between `i` and there is escaped)."""
    pos = i if search is None else search
    while (quote := text.find('"', pos)) >= 0:
        escape = quote
        while escape > i and text[escape - 1] == "\\":
            escape -= 1
        if (quote - escape) % 2 == 0:
            return quote + 1
        pos = quote + 1
    return None


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NUMBER_SO_FAR = re.compile(r"-?[\d.eE+-]*")
_LITERALS = ("true", "false", "null")


def _typed(value: str, schema: dict) -> str:
    """A parameter written as text, as JSON of the type its schema gives."""
    if schema.get("type") in (None, "string") and not (schema.get("type") is None
                                                       and _is_json(value)):
        return json.dumps(value)
    return value.strip() if _is_json(value) else json.dumps(value)


def _is_json(value: str) -> bool:
    try:
        json.loads(value)
    except ValueError:
        return False
    return True
