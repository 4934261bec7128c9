"""Claude Code and Codex run the tool the model calls, and Claude Code sends its subagents to
the small fast model it is given. The model's turn is a call in Qwen 2.5's
own format (its real template from llama.cpp's tree, replayed through the test model's engine:
tests/replay_gateway.py); the client runs the command itself, sends its output back, and the
next turn answers after reading it. The command computes what it prints ($((6*7))), so only the
tool's real output, never the call's text, holds the mark the second turn is replayed on."""

from __future__ import annotations

import json

import pytest

from gateway.workers.model_store import GEMMA3_270M, default_model_path
from gateway.workers.model_store import model_path as served_model_path
from loadtest.gateway_process import GatewayProcess
from tests.templates import template_path
from tests.test_claude_code import CLAUDE, WORKDIR, claude
from tests.test_codex import CODEX, SMALL, codex, codex_home

COMMAND = "echo $((6*7))-harbour > harbour.log && cat harbour.log"
QUESTION = "Write the harbour log."
DONE = "The harbour log is written."


@pytest.fixture(scope="module")
def replayed(model_path, tmp_path_factory):
    if not CLAUDE.exists() or not CODEX.exists():
        pytest.fail("`make agents` installs Claude Code and Codex")
    rules = tmp_path_factory.mktemp("replay") / "rules.json"
    server = GatewayProcess(model_path, "--parallel", "2", "--ctx-size", "16384",
                            "--temperature", "0", "--model-alias", "*", "--chat-template-file",
                            str(template_path("Qwen-Qwen2.5-7B-Instruct.jinja")),
                            "--replay-rules", str(rules), module="tests.replay_gateway")
    yield server, rules
    server.stop()


def _replay(rules, tool: str, arguments: dict, *more: dict) -> None:
    """The question answered with a call of `tool`, the turn after `more` (first) or the
    command's output with DONE."""
    call = f'<tool_call>\n{json.dumps({"name": tool, "arguments": arguments})}\n</tool_call>'
    rules.write_text(json.dumps([{"when": "42-harbour", "output": DONE}, *more,
                                 {"when": QUESTION, "output": call}]))


@pytest.fixture(scope="module")
def two_models(model_path, tmp_path_factory):
    """The test model and Gemma 3 behind one replaying gateway, Claude Code's names (`claude-*`)
    answered by the first."""
    rules = tmp_path_factory.mktemp("replay") / "rules.json"
    server = GatewayProcess(model_path, "--model", str(served_model_path(GEMMA3_270M)),
                            "--parallel", "2", "--ctx-size", "8192", "--temperature", "0",
                            "--model-alias", "claude-*", "--chat-template-file",
                            str(template_path("Qwen-Qwen2.5-7B-Instruct.jinja")),
                            "--replay-rules", str(rules), module="tests.replay_gateway")
    yield server, rules
    server.stop()


@pytest.mark.timeout(600)
def test_claude_code_runs_the_command_the_model_calls(replayed, tmp_path):
    server, rules = replayed
    _replay(rules, "Bash", {"command": COMMAND, "description": "Write the harbour log"})
    log = WORKDIR / "harbour.log"
    log.unlink(missing_ok=True)
    result = claude(server, tmp_path / "home", QUESTION, "--allowedTools", "Bash",
                    tools="Bash")
    assert log.read_text().strip() == "42-harbour"  # Claude Code ran it
    assert result["result"] == DONE and result["num_turns"] >= 2
    server.settled()


@pytest.mark.timeout(600)
def test_codex_runs_the_command_the_model_calls(replayed, tmp_path):
    server, rules = replayed
    _replay(rules, "exec_command", {"cmd": COMMAND})
    work = tmp_path / "work"
    events = codex(codex_home(server, tmp_path / "home"), work,
                   "--dangerously-bypass-approvals-and-sandbox", QUESTION,
                   shrink=SMALL)
    assert (work / "harbour.log").read_text().strip() == "42-harbour"  # Codex ran it
    ran = [e["item"] for e in events if e["type"] == "item.completed"
           and e["item"]["type"] == "command_execution"]
    assert ran and "42-harbour" in ran[0]["aggregated_output"]
    messages = [e["item"]["text"] for e in events if e["type"] == "item.completed"
                and e["item"]["type"] == "agent_message"]
    assert messages[-1] == DONE
    server.settled()


@pytest.mark.timeout(600)
def test_claude_code_runs_its_subagent_on_the_small_fast_model(two_models, tmp_path):
    """The main model hands a task to a subagent on `haiku`: Claude Code sends the subagent's
    turn to the model its small-fast setting names (ANTHROPIC_SMALL_FAST_MODEL, read as
    ANTHROPIC_DEFAULT_HAIKU_MODEL by this version), the main model's turns to its own."""
    server, rules = two_models
    small = served_model_path(GEMMA3_270M).stem
    task = "Count the boats in the harbour."
    found = "There are 42-harbour boats."
    _replay(rules, "Agent", {"description": "Count boats", "prompt": task,
                             "subagent_type": "general-purpose", "model": "haiku"},
            {"when": task, "output": found})
    before = server.labelled("prefixgate_prompt_tokens_computed_total", "model")
    result = claude(server, tmp_path / "home", QUESTION, "--allowedTools", "Agent",
                    tools="Agent", env={"ANTHROPIC_SMALL_FAST_MODEL": small,
                                        "ANTHROPIC_DEFAULT_HAIKU_MODEL": small})
    assert result["result"] == DONE  # the main model read the subagent's answer
    assert result["subagent_stats"]["completed"] == 1
    assert small in result["modelUsage"] and len(result["modelUsage"]) == 2
    after = server.labelled("prefixgate_prompt_tokens_computed_total", "model")
    assert set(after) == {default_model_path().stem, small}
    assert all(after[m] > before[m] for m in after)  # both models computed its prompts
    server.settled()
