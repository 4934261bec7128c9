"""Engine workers in their own processes, sharing one block pool: a prefix one worker computed is
loaded by another; a worker killed with SIGKILL fails only its own requests, leaks nothing and
is replaced; SIGTERM drains; arenas are owner-only and a dead gateway's is swept."""

from __future__ import annotations

import json
import os
import signal
import stat
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from cache.arena import SHM_DIR
from loadtest.gateway_process import GatewayProcess
from tests.conftest import openai_client
from tests.test_prefix_cache import ask, system_chat

# Two workers of one thread each: this machine has two cores.
TWO_WORKERS = ("--workers", "2", "--threads", "1", "--parallel", "4", "--ctx-size", "4096",
               "--routing", "round-robin")
SYSTEM = "You are the harbour master's assistant on the island of Utö. Answer briefly. " * 8


def complete(client: openai.OpenAI, model: str, prompt: str, max_tokens: int = 16):
    r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                  temperature=0)
    return r.choices[0].text


def wait_for_health(server: GatewayProcess, status: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = server.health()[1]
        if body["status"] == status:
            return body
        time.sleep(0.05)
    raise AssertionError(f"/health never said {status!r}: {server.health()}")


def wait_running(server: GatewayProcess, worker: str, timeout: float) -> None:
    """Until the worker's published snapshot shows one request running (it follows the step's
    outputs, so a stream's first event can come before it)."""
    deadline = time.monotonic() + timeout
    while server.per_worker("prefixgate_worker_requests_running")[worker] != 1:
        assert time.monotonic() < deadline, f"worker {worker} does not run the stream"
        time.sleep(0.05)


def stream_events(server: GatewayProcess, model: str, prompt: str, started: threading.Event,
                  events: list[dict | str]) -> None:
    """A streamed completion, every event kept (a JSON object or "[DONE]")."""
    body = {"model": model, "prompt": prompt, "max_tokens": 400, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with urllib.request.urlopen(_request(server, body), timeout=120) as response:
        for line in response:
            if line.startswith(b"data: "):
                data = line[6:].strip().decode()
                events.append(data if data == "[DONE]" else json.loads(data))
                started.set()


def _request(server: GatewayProcess, body: dict) -> urllib.request.Request:
    return urllib.request.Request(server.base_url + "/v1/completions",
                                  data=json.dumps(body).encode(),
                                  headers={"Content-Type": "application/json"})


def test_a_prefix_one_worker_computed_is_loaded_by_the_other(
        model_path, model_name, deterministic_uncached_gateway):
    server = GatewayProcess(model_path, *TWO_WORKERS, "--ctx-size", "8192", "--deterministic")
    try:
        wait_for_health(server, "ok")  # both workers: /health is 200 once the first serves
        client = openai_client(server)
        ask(client, model_name, system_chat("When does the ferry leave?", SYSTEM))
        text, usage = ask(client, model_name, system_chat("Where is the pilot boat?", SYSTEM))
        # Round-robin: the two requests ran on different workers.
        assert set(server.per_worker("prefixgate_routing_decisions_total").values()) == {1}
        hits = server.per_worker("prefixgate_worker_prefix_cache_hits_total")
        assert sorted(hits.values())[0] == 0 and sorted(hits.values())[1] > 100
        assert usage.prompt_tokens_details.cached_tokens == sorted(hits.values())[1]
        cold, _ = ask(openai_client(deterministic_uncached_gateway), model_name,
                      system_chat("Where is the pilot boat?", SYSTEM))
        assert text == cold
        assert server.settled()["prefixgate_kv_pool_blocks_held"] == 0
    finally:
        server.stop()


@pytest.fixture
def two_workers(model_path):
    server = GatewayProcess(model_path, *TWO_WORKERS)
    wait_for_health(server, "ok")  # both workers: round-robin's order is then known
    yield server
    server.stop()


def test_a_killed_worker_fails_its_requests_leaks_nothing_and_is_replaced(
        two_workers, model_path, model_name):
    server, client = two_workers, openai_client(two_workers)
    prompts = [f"{SYSTEM}Question {i}: how deep is the harbour?" for i in range(3)]
    first = complete(client, model_name, prompts[0])  # on one worker (round-robin)
    victim = next(w for w in server.health()[1]["workers"] if w["id"] == 0)
    # The next request goes to worker 0: stream it, and kill the worker under it.
    started, events = threading.Event(), []
    reader = threading.Thread(target=stream_events,
                              args=(server, model_name, prompts[1], started, events))
    reader.start()
    assert started.wait(60)
    wait_running(server, "0", timeout=10)
    os.kill(victim["pid"], signal.SIGKILL)
    reader.join(60)
    # The stream ends with an error event in OpenAI's shape, then [DONE].
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "engine_unavailable"
    assert all("choices" in e for e in events[:-2])
    degraded = wait_for_health(server, "degraded", timeout=10)
    assert [w["state"] for w in degraded["workers"]] != ["ready", "ready"]
    ready = wait_for_health(server, "ok")
    assert next(w for w in ready["workers"] if w["id"] == 0)["pid"] != victim["pid"]
    assert server.per_worker("prefixgate_worker_restarts_total") == {"0": 1, "1": 0}
    after = [complete(client, model_name, p) for p in (prompts[0], prompts[2], prompts[0])]
    assert after[0] == after[2] == first
    metrics = server.settled()
    assert metrics["prefixgate_kv_pool_blocks_held"] == 0
    assert metrics["prefixgate_kv_cells_used"] == 0
    # Nothing of the killed request stayed in the pool: the same requests on a fresh gateway,
    # without it, leave exactly as many blocks.
    fresh = GatewayProcess(model_path, *TWO_WORKERS)
    try:
        wait_for_health(fresh, "ok")
        fresh_client = openai_client(fresh)
        expected = [complete(fresh_client, model_name, p)
                    for p in (prompts[0], prompts[0], prompts[2], prompts[0])]
        assert expected[1:] == after
        assert fresh.settled()["prefixgate_kv_pool_blocks_used"] == \
            metrics["prefixgate_kv_pool_blocks_used"]
    finally:
        fresh.stop()


def test_a_request_on_a_killed_worker_gets_a_503(two_workers, model_name):
    server, client = two_workers, openai_client(two_workers)
    complete(client, model_name, "Warm-up.", max_tokens=2)  # worker 1; the next goes to 0
    victim = next(w for w in server.health()[1]["workers"] if w["id"] == 0)
    threading.Timer(1.0, os.kill, args=(victim["pid"], signal.SIGKILL)).start()
    with pytest.raises(openai.InternalServerError) as raised:
        client.completions.create(model=model_name, prompt="Tell a very long story.",
                                  max_tokens=2000, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert raised.value.status_code == 503
    assert raised.value.body["code"] == "engine_unavailable"
    # Worker 1 served on meanwhile.
    assert complete(client, model_name, "Name a colour.", max_tokens=4) is not None


def test_sigterm_drains_requests_in_flight_then_removes_the_arena(model_path, model_name):
    arena = SHM_DIR / f"prefixgate-test-drain-{os.getpid()}"
    server = GatewayProcess(model_path, "--parallel", "2", "--ctx-size", "2048",
                            "--shared-memory", str(arena), "--drain-seconds", "600")
    try:
        _drain(server, arena, model_name)
    finally:
        server.stop()


def _drain(server: GatewayProcess, arena: Path, model_name: str) -> None:
    worker_pids = [w["pid"] for w in server.health()[1]["workers"]]
    assert stat.S_IMODE(arena.stat().st_mode) == 0o600  # owner-only: prompts live in it
    started, events = threading.Event(), []
    reader = threading.Thread(target=stream_events,
                              args=(server, model_name, "Once upon a time", started, events))
    reader.start()
    assert started.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    # Draining from its log line on (it refuses new requests from then), however long a busy
    # machine takes to get there.
    deadline = time.monotonic() + 60
    while "stopping:" not in server.log_path.read_text():
        assert time.monotonic() < deadline, "the gateway never began to drain"
        time.sleep(0.05)
    status, body = _post(server, {"model": model_name, "prompt": "Too late.", "max_tokens": 2})
    assert status == 503 and body["error"]["code"] == "engine_unavailable"
    # The drain ends when the stream does: its 400 tokens took over 60 s on a busy machine.
    reader.join(600)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(60) == 0
    assert not arena.exists()
    assert not any(Path(f"/proc/{pid}").exists() for pid in worker_pids)


def _post(server: GatewayProcess, body: dict) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(_request(server, body), timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_dead_gateways_arena_is_swept_and_a_live_ones_is_kept(model_path):
    small = ("--parallel", "2", "--ctx-size", "1024", "--cache-mb", "32")
    stale = SHM_DIR / f"prefixgate-test-stale-{os.getpid()}"
    stale.write_bytes(b"left by a gateway killed with SIGKILL: nobody holds its lock")
    live_path = SHM_DIR / f"prefixgate-test-live-{os.getpid()}"
    live = GatewayProcess(model_path, *small, "--shared-memory", str(live_path))
    try:
        assert not stale.exists()  # swept at start
        second = GatewayProcess(model_path, *small)
        second.stop()
        assert live_path.exists() and live.health()[1]["status"] == "ok"
        # Asked for the live gateway's arena, a gateway refuses to start and says why.
        with pytest.raises(RuntimeError, match="exited with status 1"):
            GatewayProcess(model_path, *small, "--shared-memory", str(live_path))
        assert live_path.exists() and live.health()[1]["status"] == "ok"
    finally:
        live.stop()
    assert not live_path.exists()


def test_another_tenants_requests_count_as_load(model_path, model_name, tmp_path):
    """Tenant A's streams run on one worker; tenant B's request goes to the idle one. (Before,
    each tenant saw only its own requests, so A's busy worker looked idle to B.)"""
    keys = tmp_path / "keys"
    keys.write_text("key-a tenant-a\nkey-b tenant-b\n")
    server = GatewayProcess(model_path, "--workers", "2", "--threads", "1", "--parallel", "4",
                            "--ctx-size", "4096", "--api-keys-file", str(keys))
    try:
        wait_for_health(server, "ok")
        tenant_a, tenant_b = (openai.OpenAI(base_url=server.base_url + "/v1", api_key=key,
                                            max_retries=0) for key in ("key-a", "key-b"))
        # Three choices of one request: routed together, to one worker.
        stream = tenant_a.completions.create(
            model=model_name, prompt=SYSTEM + "Tell a long story.", max_tokens=300, n=3,
            temperature=0, stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        busy = next(w for w, n in server.per_worker(
            "prefixgate_routing_decisions_total").items() if n == 1)
        complete(tenant_b, model_name, "Name a bird.", max_tokens=4)
        routed = server.per_worker("prefixgate_routing_decisions_total")
        assert routed[busy] == 1 and sum(routed.values()) == 2
        stream.close()
        server.settled()
    finally:
        server.stop()


def test_a_clean_shutdown_never_kills_a_worker_that_is_exiting(model_path):
    """Only the reader thread reaps its worker. (Before, stop() joined it too, and on about one
    shutdown in three the loser of that race saw a reaped worker as alive, killed it and logged
    that it "did not stop in 30 s" 0.1 s after stopping began.)"""
    for _ in range(4):
        server = GatewayProcess(model_path, "--workers", "2", "--threads", "1", "--parallel",
                                "1", "--ctx-size", "512")
        wait_for_health(server, "ok")
        server.stop()
        log = server.log_path.read_text()
        assert "did not stop" not in log and log.count("stopped") >= 2


def test_a_stuck_worker_is_detected_killed_and_replaced(model_path, model_name):
    """SIGSTOP: the worker is there but says nothing, as one stuck inside llama.cpp would. Past
    --step-timeout its request gets a 503 and a replacement serves. (Before, it stayed in
    service, its requests hanging until their own timeout.)"""
    server = GatewayProcess(model_path, "--parallel", "2", "--ctx-size", "2048",
                            "--step-timeout", "3")
    try:
        wait_for_health(server, "ok")
        pid = server.health()[1]["workers"][0]["pid"]
        started, events = threading.Event(), []
        reader = threading.Thread(target=stream_events, args=(
            server, model_name, "Tell a long story.", started, events), daemon=True)
        reader.start()
        assert started.wait(60)
        os.kill(pid, signal.SIGSTOP)
        reader.join(30)
        assert not reader.is_alive() and events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "engine_unavailable"
        body = wait_for_health(server, "ok", timeout=60)
        assert body["workers"][0]["restarts"] == 1 and body["workers"][0]["pid"] != pid
        assert complete(openai_client(server), model_name, "Hello", max_tokens=4)
        server.settled()
    finally:
        server.stop()


def test_workers_come_from_the_fork_server_and_nothing_outlives_a_killed_gateway(model_path):
    """Workers are forked from multiprocessing's fork server (their imports done once, not at
    every load or restart); a gateway killed with SIGKILL takes the fork server and every
    worker with it."""
    server = GatewayProcess(model_path, "--workers", "2", "--threads", "1", "--parallel", "1",
                            "--ctx-size", "512")
    try:
        workers = [w["pid"] for w in wait_for_health(server, "ok")["workers"]]
        parents = {_parent(pid) for pid in workers}
        assert len(parents) == 1 and parents != {server.proc.pid}
        fork_server = parents.pop()
        assert b"multiprocessing.forkserver" in Path(f"/proc/{fork_server}/cmdline").read_bytes()
        assert _parent(fork_server) == server.proc.pid
    finally:
        server.proc.kill()
        server.proc.wait(30)
    deadline = time.monotonic() + 60
    while left := [pid for pid in (fork_server, *workers) if _alive(pid)]:
        assert time.monotonic() < deadline, f"still running after the gateway died: {left}"
        time.sleep(0.1)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper is not: its parent is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
