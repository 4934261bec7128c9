from __future__ import annotations

from pathlib import Path

import openai
import pytest

from engine.llama import Model
from gateway.workers.model_store import default_model_path
from loadtest.gateway_process import GatewayProcess, redis_server, started_together
from tests.clocked_gateway import TestClock

# The default mode: F16 KV in one unified pool of cells, live prefixes shared between sequences.
DEFAULT_ARGS = ("--parallel", "8", "--ctx-size", "8192")
# The deterministic mode: Q8_0 KV, one stream of 2,048 cells per sequence.
DETERMINISTIC_ARGS = ("--parallel", "8", "--ctx-size", "16384", "--deterministic")


def openai_client(server: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def model_path() -> Path:
    return default_model_path()


def serve(model_path: Path, *args: str):
    """A gateway for a fixture's lifetime."""
    server = GatewayProcess(model_path, *args)
    yield server
    server.stop()


def cached_and_uncached(model_path: Path, *args: str):
    """Two gateways for a fixture's lifetime: with the prefix cache, and without it (the
    reference)."""
    servers = started_together(GatewayProcess(model_path, *args, wait=False),
                               GatewayProcess(model_path, *args, "--no-prefix-cache", wait=False))
    yield servers
    for server in servers:
        server.stop()


def greedy_completion(server: GatewayProcess, prompt: str, max_tokens: int, logprobs: int):
    """(text, top logprobs per token, usage) of a greedy completion."""
    r = openai_client(server).completions.create(
        model=server.model_name, prompt=prompt, max_tokens=max_tokens, temperature=0,
        logprobs=logprobs)
    return r.choices[0].text, r.choices[0].logprobs.top_logprobs, r.usage


def across_a_restart(model_path: Path, args: tuple[str, ...], ask):
    """What `ask(server)` gives from a gateway, and then from the same gateway started again."""
    answers = []
    for _ in range(2):
        server = GatewayProcess(model_path, *args)
        try:
            answers.append(ask(server))
        finally:
            server.stop()
    return answers


@pytest.fixture(scope="session")
def gateway(model_path: Path):
    """One real gateway on the default model, shared by the HTTP tests."""
    yield from serve(model_path, *DEFAULT_ARGS)


@pytest.fixture(scope="session")
def uncached_gateway(model_path: Path):
    """The same gateway with the prefix cache off: the reference for cached outputs."""
    yield from serve(model_path, *DEFAULT_ARGS, "--no-prefix-cache")


@pytest.fixture(scope="session")
def deterministic_gateway(model_path: Path):
    yield from serve(model_path, *DETERMINISTIC_ARGS)


@pytest.fixture(scope="session")
def deterministic_uncached_gateway(model_path: Path):
    yield from serve(model_path, *DETERMINISTIC_ARGS, "--no-prefix-cache")


@pytest.fixture(scope="session")
def client(gateway: GatewayProcess) -> openai.OpenAI:
    return openai_client(gateway)


@pytest.fixture(scope="session")
def uncached_client(uncached_gateway: GatewayProcess) -> openai.OpenAI:
    return openai_client(uncached_gateway)


@pytest.fixture(scope="session")
def model_name(gateway: GatewayProcess) -> str:
    return gateway.model_name


@pytest.fixture(scope="session")
def local_model(model_path: Path):
    """The model loaded in the test process, for its tokenizer."""
    model = Model(str(model_path))
    yield model
    model.close()


@pytest.fixture
def pin_clock(tmp_path: Path) -> TestClock:
    """The clock of a gateway's pins, for gateways started with `pin_clock.gateway(...)`: it
    stands still until the test moves it, so a pin expires where the test says, never while a
    busy machine is still on the requests before."""
    return TestClock(tmp_path / "pin-clock")


@pytest.fixture
def redis_url():
    with redis_server() as server:
        yield server
