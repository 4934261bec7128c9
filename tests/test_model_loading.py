"""Models loaded on first use and unloaded when idle, out of room or asked to (gateway/core/
models.py), with both real models: a request for a model that is not loaded waits for it and
gets its own model's answer; a model is never unloaded under a request; one model's failure
leaves the others serving."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from gateway.workers.model_store import GEMMA3_270M, default_model_path, model_path
from loadtest.gateway_process import GatewayProcess
from tests.conftest import openai_client
from tests.test_cache_controls import admin

BASE = ("--parallel", "2", "--ctx-size", "2048", "--temperature", "0", "--cache-mb", "128")
# Deterministic: an answer is the same alone, beside others, or from the cache (but Gemma's
# sliding window is cached only in the default mode).
ARGS = (*BASE, "--deterministic")
ADMIN = "admin-key"
SMOL = default_model_path().stem
GEMMA = model_path(GEMMA3_270M).stem
SYSTEM = "You answer in one short sentence, and only about fruit. " * 12


def states(server: GatewayProcess) -> dict[str, str]:
    return {m.id: m.model_extra["status"]["value"] for m in openai_client(server).models.list()}


def ask(server: GatewayProcess, model: str, question: str = "Name a yellow fruit.",
        max_tokens: int = 8):
    return openai_client(server).chat.completions.create(
        model=model, max_tokens=max_tokens,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])


def post_admin(server: GatewayProcess, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(server.base_url + path, json.dumps(body).encode(),
                                     {"Authorization": f"Bearer {ADMIN}",
                                      "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def wait_for(condition, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def one_at_a_time():
    """Both models, room for one: SmolLM2 loads at start, Gemma on first use."""
    server = GatewayProcess(default_model_path(), *ARGS, "--model", str(model_path(GEMMA3_270M)),
                            "--models-max", "1", "--admin-key", ADMIN, "--drain-seconds", "600",
                            "--model-alias", "claude-*")
    yield server
    server.stop()


def test_the_start_up_log_lists_what_is_served(one_at_a_time):
    """A line for each model (id, file, state, aliases, workers, its share of --cache-mb), then
    the address, logged before /health said ready."""
    log = one_at_a_time.log_path.read_text()
    share = "1 worker(s), cache 64 MiB (50% of 128 MiB)"
    assert f"model {SMOL!r}: {default_model_path()}, loaded, aliases claude-*, {share}" in log
    assert (f"model {GEMMA!r}: {model_path(GEMMA3_270M)}, not loaded (loads on first use), "
            f"no aliases, {share}") in log
    assert f"serving 2 model(s) on {one_at_a_time.base_url}\n" in log


def test_requests_swap_the_models_and_each_gets_its_own_answer(one_at_a_time):
    server = one_at_a_time
    assert states(server) == {SMOL: "loaded", GEMMA: "unloaded"}
    alone = {model: ask(server, model).choices[0].message.content for model in (SMOL, GEMMA)}
    assert states(server) == {SMOL: "unloaded", GEMMA: "loaded"}
    assert alone[SMOL] != alone[GEMMA]
    # Both at once, interleaved: every request waits for its model and gets its answer.
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        asked = [(model, pool.submit(ask, server, model)) for model in (SMOL, GEMMA) * 3]
        for model, answer in asked:
            assert answer.result().choices[0].message.content == alone[model]
            assert answer.result().model == model
    assert sorted(states(server).values()) == ["loaded", "unloaded"]
    # What /metrics says of it, by model.
    loads = server.labelled("prefixgate_model_loads_total", "model")
    unloads = server.labelled("prefixgate_model_unloads_total", "model")
    assert loads[SMOL] >= 1 and loads[GEMMA] >= 1 and unloads[SMOL] >= 1
    assert abs(loads[SMOL] + loads[GEMMA] - unloads[SMOL] - unloads[GEMMA]) == 1
    loaded = {s.labels["model"] for s in server._samples()
              if s.name == "prefixgate_model_state" and s.labels["state"] == "loaded" and s.value}
    assert loaded == {m for m, state in states(server).items() if state == "loaded"}


def test_an_unload_lets_the_requests_in_flight_finish(one_at_a_time):
    server = one_at_a_time
    assert post_admin(server, "/models/load", {"model": SMOL}) == (
        200, {"success": True, "model": SMOL, "status": "loaded"})
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        long = pool.submit(ask, server, SMOL, "Tell a long story about a pear.", 160)
        wait_for(lambda: server.labelled("prefixgate_num_requests_running", "model").get(SMOL)
                 == 1, "started the long request")
        assert post_admin(server, "/models/unload", {"model": SMOL})[1]["status"] == "unloaded"
        answer = long.result()
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 160
    assert states(server)[SMOL] == "unloaded"
    assert post_admin(server, "/models/unload", {"model": "nope"})[0] == 404
    assert post_admin(server, "/models/load", {"model": SMOL})[0] == 200


def test_an_idle_model_unloads_and_finds_its_prefixes_again(tmp_path: Path):
    server = GatewayProcess(default_model_path(), *ARGS, "--idle-unload-seconds", "1",
                            "--cache-dir", str(tmp_path / "cache"))
    try:
        first = ask(server, SMOL)
        wait_for(lambda: states(server)[SMOL] == "unloaded", "unloaded when idle")
        # No worker of an unloaded model is down: it has none (PrefixgateWorkerDown would
        # fire on its stopped workers' prefixgate_worker_up 0).
        assert SMOL not in server.labelled("prefixgate_worker_up", "model")
        again = ask(server, SMOL)
        assert states(server)[SMOL] == "loaded"
        assert again.choices[0].message.content == first.choices[0].message.content
        assert again.usage.prompt_tokens_details.cached_tokens > 100  # from --cache-dir
    finally:
        server.stop()


def test_a_model_that_cannot_load_leaves_the_others_serving(tmp_path: Path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a GGUF at all" * 100)
    (tmp_path / "gemma.gguf").symlink_to(model_path(GEMMA3_270M))
    # A pool of 8 MiB each: a few blocks, that a flood of one model's prompts evicts.
    server = GatewayProcess(default_model_path(), *BASE, "--models-dir", str(tmp_path),
                            "--cache-mb", "16", "--admin-key", ADMIN)
    try:
        listed = {m.id: m.model_extra["status"] for m in openai_client(server).models.list()}
        assert listed[SMOL] == {"value": "loaded"} and listed["gemma"] == {"value": "loaded"}
        assert listed["broken"]["value"] == "failed" and listed["broken"]["error"]
        with pytest.raises(openai.InternalServerError, match="`broken` failed to load"):
            ask(server, "broken")
        assert ask(server, "gemma").choices[0].message.content
        status, health = server.health()
        assert status == 200 and health["status"] == "degraded"
        # Each model has its own pool: a flood of one's prompts evicts none of the other's.
        def evictions() -> dict[str, int]:
            return {model: admin(server, "GET", f"/v1/cache/stats?model={model}", ADMIN)[1][
                "evictions"] for model in (SMOL, "gemma")}

        before = evictions()
        for topic in range(8):
            ask(server, SMOL, f"Topic {topic}: " + "pears and plums " * 60, max_tokens=1)
        after = evictions()
        assert after[SMOL] > before[SMOL] and after["gemma"] == before["gemma"]
        assert ask(server, "gemma").usage.prompt_tokens_details.cached_tokens > 100
        # One model's worker killed: it is replaced, and the other model serves meanwhile.
        smol_worker = next(w for w in health["workers"] if w["model"] == SMOL)
        os.kill(smol_worker["pid"], signal.SIGKILL)
        assert ask(server, "gemma").choices[0].message.content
        wait_for(lambda: any(w["model"] == SMOL and w["state"] == "ready" and w["restarts"]
                             for w in server.health()[1]["workers"]), "replaced the worker")
        assert ask(server, SMOL).choices[0].message.content
    finally:
        server.stop()
