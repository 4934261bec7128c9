"""Claude Code and Codex run the tool the model calls. The model's turn is a call in Qwen 2.5's
own format (its real template from llama.cpp's tree, replayed through the test model's engine:
tests/replay_gateway.py); the client runs the command itself, sends its output back, and the
next turn answers after reading it. The command computes what it prints ($((6*7))), so only the
tool's real output, never the call's text, holds the mark the second turn is replayed on."""

from __future__ import annotations

import json

import pytest

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


def _replay(rules, tool: str, arguments: dict) -> None:
    call = f'<tool_call>\n{json.dumps({"name": tool, "arguments": arguments})}\n</tool_call>'
    rules.write_text(json.dumps([{"when": "42-harbour", "output": DONE},
                                 {"when": QUESTION, "output": call}]))


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
