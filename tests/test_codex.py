"""Codex itself (npm @openai/codex, pinned, installed by `make agents`) against the real server
through /v1/responses, as `codex exec --json` with a custom provider in a temporary CODEX_HOME:
a turn completes, a second session reads the shared instructions from the cache, and `codex exec
resume --last` reads its history. The server is greedy (--temperature 0)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from loadtest.gateway_process import GatewayProcess
from tests.agent_prompt import HARBOUR_PROMPT

ROOT = Path(__file__).resolve().parent.parent
CODEX = ROOT / ".agents" / "node_modules" / ".bin" / "codex"
INSTRUCTIONS = HARBOUR_PROMPT  # in place of Codex's own 17 kB
# What keeps the prompt small: no skills or permission texts, no tools but the command runner
# (exec_command, its shell tool) where a test asks for it.
SMALL = ["-c", "include_permissions_instructions=false", "-c", "skills.include_instructions=false",
         "-c", "include_environment_context=false", "-c", "web_search=disabled",
         "-c", "tools.experimental_request_user_input.enabled=false",
         *[arg for feature in ("multi_agent", "goals", "view_image", "plugins")
           for arg in ("--disable", feature)]]
SHRINK = [*SMALL, "--disable", "shell_tool", "--disable", "unified_exec"]


@pytest.fixture(scope="module")
def server(model_path):
    if not CODEX.exists():
        pytest.fail(f"{CODEX} is missing: `make agents` installs Codex")
    server = GatewayProcess(model_path, "--parallel", "2", "--ctx-size", "8192",
                            "--temperature", "0")
    yield server
    server.stop()


def codex_home(server: GatewayProcess, path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "instructions.md").write_text(INSTRUCTIONS)
    (path / "config.toml").write_text(f'''model = "{server.model_name}"
model_provider = "local"
model_instructions_file = "{path / 'instructions.md'}"

[model_providers.local]
name = "local"
base_url = "{server.base_url}/v1"
wire_api = "responses"
env_key = "LOCAL_API_KEY"
request_max_retries = 0
stream_max_retries = 0
''')
    return path


def codex(home: Path, workdir: Path, *args: str, shrink: list[str] = SHRINK) -> list[dict]:
    """One `codex exec --json` run: its JSONL events."""
    workdir.mkdir(exist_ok=True)
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home),
           "LOCAL_API_KEY": "unused"}
    run = subprocess.run([str(CODEX), "exec", *args[:-1], "--json", "--skip-git-repo-check",
                          *shrink, "-c", "analytics.enabled=false", args[-1]], cwd=workdir,
                         env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                         timeout=300)
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    assert any(e["type"] == "turn.completed" for e in events), events
    return events


def usage(events: list[dict]) -> dict:
    return next(e for e in events if e["type"] == "turn.completed")["usage"]


def answer(events: list[dict]) -> str:
    return next(e["item"]["text"] for e in events if e["type"] == "item.completed"
                and e["item"]["type"] == "agent_message")


@pytest.mark.timeout(900)  # three runs of Codex; a busy machine makes each slow
def test_codex_sessions_share_the_instructions_and_resume_from_the_cache(server, tmp_path):
    # A question with a one-line answer: greedy decoding of an open one can ramble on, and
    # whether it does turns on how the prompt was chunked (Claude Code's test failed so).
    one = codex(codex_home(server, tmp_path / "one"), tmp_path / "work",
                "What is the capital of France?")
    assert "paris" in answer(one).lower()
    assert usage(one)["cached_input_tokens"] < 16
    home = codex_home(server, tmp_path / "two")
    two = codex(home, tmp_path / "work", "What is 2+2?")
    assert "4" in answer(two)
    # Another session: the instructions (~800 tokens) are read, not computed.
    assert usage(two)["cached_input_tokens"] >= 768
    resumed = codex(home, tmp_path / "work", "resume", "--last", "And what is 3+3?")
    assert answer(resumed)
    # Codex adds up a thread's usage: the resumed turn's own is the difference.
    own_cached = usage(resumed)["cached_input_tokens"] - usage(two)["cached_input_tokens"]
    history = usage(two)["input_tokens"] + usage(two)["output_tokens"]
    assert own_cached >= history - 64
    server.settled()


def test_codexs_full_size_request_is_understood():
    """Codex 0.169.0's whole body (its instructions, 9 tools among them a namespace and a hosted
    web_search, reasoning and include), recorded: every field parses."""
    from gateway.core.requests import parse_request
    from gateway.responses.requests import ResponsesRequest

    body = (ROOT / "tests" / "fixtures" / "codex_0.169.0_request.json").read_bytes()
    request = parse_request(ResponsesRequest, body)
    assert request.hosted_tools() == ["web_search"]
    assert len(request.toolbox().functions) == 7 + 5  # 7 functions, 5 in multi_agent_v1
    turns = request.chat_messages()
    assert [t.role for t in turns] == ["system", "user", "user"]
