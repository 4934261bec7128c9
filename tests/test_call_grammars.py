"""The grammars of calls in each model family's syntax, run by llama.cpp's own grammar sampler
over the test model's tokens: each accepts its family's scripted calls and refuses calls to tools
not offered or with arguments off their schema; a lazy one lets text through until a call
begins."""

from __future__ import annotations

import llama_cpp as lc
import pytest

from engine.llama import Sampler
from engine.messages import SamplerSettings
from gateway.chat_formats import detect
from gateway.protocol import NamedToolChoice, Tool
from gateway.tools import Toolbox
from tests.chat_outputs import OUTPUTS, TOOLS
from tests.templates import template

CALLS = [(family, case) for family, (_, cases) in OUTPUTS.items() if family != "json"
         for case, scripted in cases.items()
         if scripted.calls() and not scripted.text() and not scripted.reasoning()]


def grammar_of(family: str, choice: object = "required"):
    text = template(OUTPUTS[family][0])
    toolbox = Toolbox.of([Tool.model_validate(t) for t in TOOLS], choice)
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
