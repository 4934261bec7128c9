"""The grammars of calls in each model family's syntax, run by llama.cpp's own grammar sampler
over the test model's tokens: each accepts its family's scripted calls and refuses calls to tools
not offered or with arguments off their schema; a lazy one lets text through until a call
begins."""

from __future__ import annotations

import json

import llama_cpp as lc
import pytest

from engine.llama import Sampler
from engine.messages import SamplerSettings
from gateway.core.conversation import NamedToolChoice, Tool
from gateway.edge.errors import APIError
from gateway.formats.chat_formats import OutputParser, Part, detect
from gateway.formats.tools import Toolbox
from tests.chat_outputs import CODE, OUTPUTS, TEXT_CALLS, TOOLS, WEATHER, WRITE, write_call
from tests.templates import template

CALLS = [(family, case) for family, (_, cases) in OUTPUTS.items() if family != "json"
         for case, scripted in cases.items()
         if scripted.calls() and not scripted.text() and not scripted.reasoning()]


def grammar_of(family: str, choice: object = "required", tools: list[dict] = TOOLS):
    text = template(OUTPUTS[family][0])
    toolbox = Toolbox.of([Tool.model_validate(t) for t in tools], choice)
    return detect(text, "tools" in text).grammar(toolbox)


def accepts(model, grammar, text: str) -> bool:
    """Whether llama.cpp's grammar sampler lets every token of `text` through, then its end."""
    sampler = Sampler(SamplerSettings(grammar=grammar.gbnf, grammar_triggers=grammar.triggers),
                      model, penalty_window=64)
    try:
        for token in model.tokenize(text, add_special=False, parse_special=True):
            if not sampler._grammar_allows(token):
                return False
            lc.llama_sampler_accept(sampler.grammar, token)
        return sampler._grammar_allows(model.eos_token)
    finally:
        sampler.close()


@pytest.mark.parametrize(("family", "case"), CALLS)
def test_a_required_call_in_the_familys_syntax_is_accepted(local_model, family, case):
    output = OUTPUTS[family][1][case].output
    assert accepts(local_model, grammar_of(family), output)


@pytest.mark.parametrize("family", sorted({family for family, _ in CALLS}))
def test_calls_off_the_tools_are_refused(local_model, family):
    output = OUTPUTS[family][1]["call"].output if "call" in OUTPUTS[family][1] else \
        next(s.output for c, s in OUTPUTS[family][1].items() if (family, c) in CALLS)
    assert not accepts(local_model, grammar_of(family), output.replace("get_weather",
                                                                        "get_wether"))
    assert not accepts(local_model, grammar_of(family), output.replace("city", "town"))
    assert not accepts(local_model, grammar_of(family, "required"), "Just text.")


def test_a_named_call_allows_only_that_tool(local_model):
    named = {"type": "function", "function": {"name": "get_time"}}
    output = OUTPUTS["hermes"][1]["call"].output
    assert not accepts(local_model, grammar_of("hermes", _named(named)), output)
    assert accepts(local_model, grammar_of("hermes", _named(named)),
                   '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>')


def test_typed_parameters_are_json_of_their_schema(local_model):
    """Qwen3-Coder writes parameters as text: an integer one must be an integer."""
    output = OUTPUTS["qwen3-coder"][1]["call"].output
    assert accepts(local_model, grammar_of("qwen3-coder"), output)
    assert not accepts(local_model, grammar_of("qwen3-coder"), output.replace("\n3\n", "\nthree\n"))


@pytest.mark.parametrize("family", ["hermes", "qwen3-coder", "mistral", "deepseek", "glm"])
def test_auto_lets_text_through_and_holds_a_call_to_the_syntax(local_model, family):
    lazy = grammar_of(family, "auto")
    assert lazy.triggers
    assert accepts(local_model, lazy, "Just an answer, no call at all.")
    text_then_call = OUTPUTS[family][1].get("text_then_call") or OUTPUTS[family][1][
        "thinking_then_call"]
    assert accepts(local_model, lazy, text_then_call.output)
    assert not accepts(local_model, lazy, text_then_call.output.replace("get_", "got_"))


def _named(choice: dict) -> NamedToolChoice:
    return NamedToolChoice.model_validate(choice)


def test_parallel_tool_calls_false_allows_one_call(local_model):
    tools = [Tool.model_validate(t) for t in TOOLS]
    fmt = detect(template(OUTPUTS["hermes"][0]), True)
    one = fmt.grammar(Toolbox.of(tools, "required", parallel=False))
    several = fmt.grammar(Toolbox.of(tools, "required"))
    parallel = OUTPUTS["hermes"][1]["parallel"].output
    assert accepts(local_model, several, parallel)
    assert not accepts(local_model, one, parallel)
    assert accepts(local_model, one, OUTPUTS["hermes"][1]["call"].output)


def test_a_required_call_comes_after_the_reasoning_the_prompt_opened(local_model):
    """DeepSeek R1's prompt opens <think>: the required call's grammar lets the reasoning run
    to its closing tag first, and a call must follow it."""
    fmt = detect(template(OUTPUTS["deepseek-r1"][0]), True)
    toolbox = Toolbox.of([Tool.model_validate(t) for t in TOOLS], "required")
    opened = fmt.grammar(toolbox, thinking=True)
    output = OUTPUTS["deepseek-r1"][1]["thinking_then_call"].output
    assert accepts(local_model, opened, output)
    assert not accepts(local_model, fmt.grammar(toolbox), output)
    assert not accepts(local_model, opened, "The weather, then.\n</think>\n\nSunny.")


WRITE_CHOICES = {"required": "required",
                 "named": NamedToolChoice.model_validate({"type": "function",
                                                          "function": {"name": "Write"}})}


def parsed_as_it_streams(parser: OutputParser, output: str) -> list[Part]:
    """The parts of `output` parsed whole, after checking that at every prefix (as a stream
    grows, read by one reader) they only grew, and a call once done no longer changed."""
    before: list[Part] = []
    reader = parser.reader()
    for n in range(len(output) + 1):
        parts = reader.read(output[:n], final=False)
        assert parts == parser.parse(output[:n], final=False), n
        for old, new in zip(before, parts, strict=False):
            assert (old.kind, old.name) == (new.kind, new.name), n
            assert new.text.startswith(old.text) and not (old.done and new.text != old.text), n
        before = parts
    return parser.parse(output, final=True)


@pytest.mark.parametrize("choice", WRITE_CHOICES)
@pytest.mark.parametrize("code", CODE)
@pytest.mark.parametrize("family", TEXT_CALLS)
def test_a_forced_call_writing_code_comes_through_the_grammar_and_the_parser_whole(
        local_model, family, code, choice):
    """A string parameter is any text but the format's closing of a value: C, HTML and
    TypeScript (`<` everywhere) and even the format's own call markers pass llama.cpp's
    grammar sampler, and the parser gives the arguments back as they were written."""
    output = write_call(family, CODE[code])
    grammar = grammar_of(family, WRITE_CHOICES[choice], [WRITE, *TOOLS])
    assert accepts(local_model, grammar, output)
    toolbox = Toolbox.of([Tool.model_validate(WRITE)], WRITE_CHOICES[choice])
    fmt = detect(template(OUTPUTS[family][0]), True)
    (call,) = parsed_as_it_streams(fmt.parser(toolbox, ""), output)
    assert (call.name, call.done) == ("Write", True)
    assert json.loads(call.text) == {"file_path": "main.c", "content": CODE[code]}


@pytest.mark.parametrize("family", TEXT_CALLS)
def test_a_string_parameter_ends_at_its_closing_and_nowhere_else(local_model, family):
    grammar = grammar_of(family, "required", [WRITE])
    closing = {"qwen3-coder": "</parameter>", "glm": "</arg_value>"}[family]
    assert accepts(local_model, grammar, write_call(family, f"a {closing[:-1]} b"))
    assert not accepts(local_model, grammar, write_call(family, f"a {closing} b"))


# Families whose required call may follow reasoning the prompt opened, and what opens the
# reasoning in their scripted outputs (the prompt writes it).
THINKING_CALLS = {"hermes-thinking": "<think>\n", "glm": "<think>", "deepseek-r1": ""}


@pytest.mark.parametrize("family", THINKING_CALLS)
def test_reasoning_before_a_required_call_may_hold_code(local_model, family):
    """The reasoning runs to its closing tag, whatever it holds before it."""
    scripted = OUTPUTS[family][1]["thinking_then_call"]
    reasoning = "Write main.c: #include <stdio.h>, return a < b; and <div><p>x</p></div>."
    output = scripted.output.removeprefix(THINKING_CALLS[family]).replace(
        scripted.reasoning(), reasoning)
    fmt = detect(template(OUTPUTS[family][0]), True)
    toolbox = Toolbox.of([Tool.model_validate(t) for t in TOOLS], "required")
    assert accepts(local_model, fmt.grammar(toolbox, thinking=True), output)
    parts = OutputParser(fmt, toolbox, thinking=True).parse(output, final=True)
    assert [(p.kind, p.text if p.kind == "reasoning" else p.name) for p in parts] == \
        [("reasoning", reasoning), ("call", scripted.calls()[0][0])]


# Property names JSON allows that a grammar's literals must escape.
ODD_NAMES = ('say "hi"', "back\\slash", "two\nlines")
ODD = {"type": "function", "function": {"name": "odd", "parameters": {
    "type": "object", "properties": {name: {"type": "string"} for name in ODD_NAMES},
    "required": list(ODD_NAMES)}}}
ODD_CALLS = {
    "hermes": '<tool_call>\n{{"name": "odd", "arguments": {arguments}}}\n</tool_call>',
    "qwen3-coder": "<tool_call>\n<function=odd>\n{parameters}</function>\n</tool_call>",
    "glm": "<tool_call>odd\n{parameters}</tool_call>",
}
ODD_PARAMETERS = {"qwen3-coder": "<parameter={key}>\n{value}\n</parameter>\n",
                  "glm": "<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n"}


@pytest.mark.parametrize("family", ODD_CALLS)
def test_property_names_holding_quotes_backslashes_and_line_breaks_are_escaped(local_model,
                                                                                family):
    """Such a name is written into the grammar escaped (it broke the grammar llama.cpp
    parses, in the worker), and a call using it comes back under its own name."""
    arguments = {name: f"value of {name}" for name in ODD_NAMES}
    output = ODD_CALLS[family].format(arguments=json.dumps(arguments), parameters="".join(
        ODD_PARAMETERS.get(family, "").format(key=k, value=v) for k, v in arguments.items()))
    assert accepts(local_model, grammar_of(family, "required", [ODD]), output)
    fmt = detect(template(OUTPUTS[family][0]), True)
    (call,) = fmt.parser(Toolbox.of([Tool.model_validate(ODD)], "required"), "").parse(
        output, final=True)
    assert (call.name, json.loads(call.text)) == ("odd", arguments)


@pytest.mark.parametrize("name", ["<path>", "a>b", " path"])
@pytest.mark.parametrize("family", TEXT_CALLS)
def test_a_name_a_text_parameter_format_cannot_write_is_a_400(family, name):
    tool = {"type": "function", "function": {"name": "Write", "parameters": {
        "type": "object", "properties": {name: {"type": "string"}}}}}
    with pytest.raises(APIError) as refused:
        grammar_of(family, "auto", [tool])
    assert (refused.value.status, refused.value.param) == (400, "tools")


# What Claude Code's own tools hold: bounds no grammar enforces, formats it has no rule for.
UNENFORCEABLE = {"type": "object", "required": ["city"], "properties": {
    "city": {"type": "string", "maxLength": 100_000, "format": "uri"},
    "days": {"type": "integer", "minimum": 1, "exclusiveMaximum": 15}}}


@pytest.mark.parametrize("family", sorted({family for family, _ in CALLS} | {"json"}))
def test_a_tool_not_strict_is_held_to_what_a_grammar_enforces_of_it(local_model, family):
    """As llama.cpp's converter does, a tool that is not strict (Claude Code's, Codex's) is
    called under the grammar of its schema without the keywords no grammar enforces, the client
    left to check them; before, the whole request was a 400 on models with a call format of
    their own. A strict tool holding them is still refused: its schema is a promise."""
    weather = {"type": "function", "function": {**WEATHER["function"],
                                                 "parameters": UNENFORCEABLE}}
    grammar = grammar_of(family, "required", [weather])
    output = OUTPUTS[family][1]["call"].output if "call" in OUTPUTS[family][1] else \
        next(s.output for c, s in OUTPUTS[family][1].items() if (family, c) in CALLS)
    if family == "json":
        output = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
    assert grammar is not None and accepts(local_model, grammar, output)
    strict = {"type": "function", "function": {**weather["function"], "strict": True}}
    with pytest.raises(APIError) as refused:
        grammar_of(family, "required", [strict])
    assert (refused.value.status, refused.value.param) == (400, "tools")
