"""Each model family's output parsed into reasoning, text and calls: the format recognised from
its real chat template (llama.cpp's models/templates), whole and at every prefix as a stream
grows, where parts only ever grow; and a stream's reader, fed the output in any pieces, giving
at each what parsing the whole output so far gives."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.conversation import Tool
from gateway.formats.chat_formats import Part, detect
from gateway.formats.tools import Toolbox
from tests.chat_outputs import OUTPUTS, TOOLS
from tests.templates import template

CASES = [(family, case) for family, (_, cases) in OUTPUTS.items() for case in cases]


def family_format(family: str) -> str:
    """The format a family's template is recognised as (some families differ only in
    reasoning or ids)."""
    for suffix in ("-thinking", "-r1", "-ids"):
        family = family.removesuffix(suffix)
    return family


def toolbox() -> Toolbox:
    return Toolbox.of([Tool.model_validate(t) for t in TOOLS], "auto")


def parser_for(family: str):
    text = template(OUTPUTS[family][0])
    fmt = detect(text, "tools" in text)
    prompt = "<think>\n" if family == "deepseek-r1" else ""  # R1's template opens it
    return fmt, fmt.parser(toolbox(), prompt)


def described(parts: list[Part]) -> tuple:
    return tuple((p.kind, json.dumps(json.loads(p.text)) if p.kind == "call" else p.text,
                  p.name) for p in parts)


@pytest.mark.parametrize("family", OUTPUTS)
def test_format_recognised_from_template(family):
    fmt, _ = parser_for(family)
    assert fmt.name == family_format(family)


@pytest.mark.parametrize(("family", "case"), CASES)
def test_whole_output_parsed(family, case):
    scripted = OUTPUTS[family][1][case]
    _, parser = parser_for(family)
    parts = parser.parse(scripted.output, final=True)
    assert described(parts) == scripted.parts
    assert all(p.done for p in parts if p.kind == "call")


@pytest.mark.parametrize(("family", "case"), CASES)
def test_parts_only_grow_as_the_output_does(family, case):
    """At every character the parse extends the one before, and ends where the whole does."""
    scripted = OUTPUTS[family][1][case]
    _, parser = parser_for(family)
    before: list[Part] = []
    for n in range(len(scripted.output) + 1):
        parts = parser.parse(scripted.output[:n], final=False)
        assert len(parts) >= len(before), (n, parts, before)
        for old, new in zip(before, parts, strict=False):
            assert (old.kind, old.name) == (new.kind, new.name), n
            assert new.text.startswith(old.text), (n, old, new)
        before = parts
    whole = parser.parse(scripted.output, final=True)
    for old, new in zip(before, whole, strict=False):
        assert new.text.startswith(old.text)


def test_call_cut_by_the_length_limit_is_not_done():
    _, parser = parser_for("hermes")
    parts = parser.parse('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
                         final=True)
    assert [(p.kind, p.name, p.text, p.done) for p in parts] == \
        [("call", "get_weather", '{"city": "Pa', False)]


def test_plain_text_is_streamed_whole_but_for_a_possible_marker():
    _, parser = parser_for("hermes")
    assert described(parser.parse("Hello <tool", final=False)) == (("text", "Hello", ""),)
    assert described(parser.parse("Hello <tool", final=True)) == (("text", "Hello <tool", ""),)


def test_no_parser_for_plain_answers():
    fmt = detect(template("google-gemma-2-2b-it.jinja"), False)
    assert fmt.parser(None, "") is None


def test_mistral_call_ids_fit_its_template():
    fmt = detect(template("mistralai-Mistral-Nemo-Instruct-2407.jinja"), True)
    short = fmt.call_id("call_0123456789abcdef")
    assert len(short) == 9 and short.isalnum() and short == fmt.call_id("call_0123456789abcdef")
    assert fmt.call_id("a1b2c3d4e") == "a1b2c3d4e"


def test_a_later_call_cut_before_its_arguments_leaves_the_others():
    _, parser = parser_for("mistral-args")
    parts = parser.parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_t',
                         final=True)
    assert described(parts) == (("call", '{"city": "Paris"}', "get_weather"),
                                ("text", "[TOOL_CALLS]get_t", ""))


def test_strings_with_quotes_braces_and_backslashes_stay_inside_the_arguments():
    _, parser = parser_for("hermes")
    arguments = json.dumps({"city": 'Pa"ris} ]\\', "days": 2})
    output = f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
    for n in range(len(output)):  # never whole before its arguments are
        for part in parser.parse(output[:n], final=False):
            assert not part.done or part.text == arguments
    (call,) = parser.parse(output, final=True)
    assert call.done and json.loads(call.text) == json.loads(arguments)


def _streams() -> list[tuple[str, str]]:
    """Every family's outputs, and each with text before it and a second one after, and cut
    short: (family, output)."""
    streams = []
    for family, case in CASES:
        output = OUTPUTS[family][1][case].output
        streams += [(family, output), (family, f"Let me see. {output}\n\nAgain: {output}"),
                    (family, output[: len(output) * 2 // 3])]
    return streams


STREAMS = _streams()


def _state(parts: list[Part]) -> list[tuple]:
    return [(p.kind, p.text, p.name, p.id, p.done) for p in parts]


def _read_in_pieces(family: str, output: str, ends: list[int]) -> None:
    _, parser = parser_for(family)
    reader = parser.reader()
    for end in ends:
        assert _state(reader.read(output[:end], final=False)) == \
            _state(parser.parse(output[:end], final=False)), (family, output[:end])
    assert _state(reader.read(output, final=True)) == _state(parser.parse(output, final=True))


@pytest.mark.parametrize(("family", "output"), STREAMS)
def test_a_reader_fed_a_character_at_a_time_parses_as_the_whole_does(family, output):
    _read_in_pieces(family, output, list(range(len(output) + 1)))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_reader_fed_random_pieces_parses_as_the_whole_does(data):
    family, output = data.draw(st.sampled_from(STREAMS))
    ends = data.draw(st.lists(st.integers(0, len(output)), max_size=12))
    _read_in_pieces(family, output, sorted(ends))


def test_a_reader_reads_one_answer():
    _, parser = parser_for("hermes")
    reader = parser.reader()
    reader.read("Hello there", final=False)
    with pytest.raises(ValueError):
        reader.read("Hello", final=False)
