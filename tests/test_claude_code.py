"""Claude Code itself (npm @anthropic-ai/claude-code, pinned, installed by `make agents`) against
the real server, in print mode: a session, a second session whose first question differs reading
the shared system prompt from the cache (its billing header differs: dropped), and --continue
reading its history. Its own model name is served through --model-alias, the server greedy."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from loadtest.gateway_process import GatewayProcess
from tests.agent_prompt import HARBOUR_PROMPT

ROOT = Path(__file__).resolve().parent.parent
CLAUDE = ROOT / ".agents" / "node_modules" / ".bin" / "claude"
SYSTEM = HARBOUR_PROMPT
# Claude Code writes its working directory into the prompt: one path for every run keeps the
# greedy answers the same from run to run (in a temporary directory, some made the test model
# ramble past the output limit, and Claude Code then continues the answer up to 3 more times).
WORKDIR = Path("/tmp/prefixgate-claude-code/project")


@pytest.fixture(scope="module")
def server(model_path):
    if not CLAUDE.exists():
        pytest.fail(f"{CLAUDE} is missing: `make agents` installs Claude Code")
    server = GatewayProcess(model_path, "--parallel", "2", "--ctx-size", "8192",
                            "--temperature", "0", "--model-alias", "claude-*")
    yield server
    server.stop()


def claude(server: GatewayProcess, home: Path, question: str, *args: str,
           tools: str = "", env: dict[str, str] | None = None) -> dict:
    """One `claude -p` run with `tools` (none by default) and `env` added to its environment;
    its JSON result. Replies are capped at 300 tokens, retries at one (a failure shows at
    once)."""
    home.mkdir(parents=True, exist_ok=True)
    WORKDIR.mkdir(parents=True, exist_ok=True)
    env = {"PATH": os.environ["PATH"], "HOME": str(home),
           "ANTHROPIC_BASE_URL": server.base_url, "ANTHROPIC_API_KEY": "unused",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "300", "CLAUDE_CODE_MAX_RETRIES": "1", **(env or {})}
    run = subprocess.run([str(CLAUDE), "-p", "--output-format", "json", "--system-prompt",
                          SYSTEM, "--tools", tools, *args, "--", question], cwd=WORKDIR, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr + run.stdout
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["type"] == "result" and not result["is_error"], result
    return result


@pytest.mark.timeout(900)  # three runs of Claude Code; a busy machine makes each slow
def test_claude_code_sessions_share_the_system_prompt_and_resume_from_the_cache(server,
                                                                                 tmp_path):
    # Questions with one-line answers: greedy decoding of an open question ("What is a tide?")
    # can run past the output limit, and whether it does turns on how the prompt was chunked.
    first = claude(server, tmp_path / "one", "What is the capital of France?")
    assert "paris" in first["result"].lower()
    usage = first["usage"]
    assert usage["cache_read_input_tokens"] < 16  # the template's opening at most
    assert usage["cache_creation_input_tokens"] > 800  # written up to its breakpoints
    other = claude(server, tmp_path / "two", "What is 2+2?")
    assert "4" in other["result"]
    # Another conversation, so another billing header: the system prompt is still shared.
    assert other["usage"]["cache_read_input_tokens"] >= 768
    again = claude(server, tmp_path / "two", "And what is the capital of Italy?", "--continue")
    assert again["result"].strip()
    assert again["session_id"] == other["session_id"]
    # Its whole history was the last request's prompt and answer: read, not computed.
    history = sum(other["usage"][k] for k in ("input_tokens", "cache_read_input_tokens",
                                              "cache_creation_input_tokens"))
    assert again["usage"]["cache_read_input_tokens"] >= history - 64
    server.settled()


def test_claude_codes_full_size_request_is_understood(server, tmp_path):
    """Its default system prompt and 12 tools (~10k tokens): more than this server's context,
    so the answer is a 400 for the length. Only a body every field of which was understood gets
    that far: a field a new client adds would be a 400 naming it instead."""
    workdir = tmp_path / "project"
    workdir.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path),
           "ANTHROPIC_BASE_URL": server.base_url, "ANTHROPIC_API_KEY": "unused",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "CLAUDE_CODE_MAX_RETRIES": "0"}
    run = subprocess.run([str(CLAUDE), "-p", "--output-format", "json", "What is 2+2?"],
                         cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["is_error"] and "maximum context length is 8192 tokens" in result["result"]
