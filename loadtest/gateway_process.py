"""Servers under test as subprocesses on free loopback ports: the real gateway, as a user would
start it, and the systems the benchmarks compare it with."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import redis
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def redis_server() -> Iterator[tuple[str, subprocess.Popen]]:
    """A real redis-server on a free loopback port, nothing saved: (its URL, its process)."""
    binary = shutil.which("redis-server")
    assert binary, "redis-server is not installed (make system-deps installs it)"
    port = free_port()
    server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no"], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    try:
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        yield url, server
    finally:
        server.kill()
        server.wait()


def totals(samples: list[Sample]) -> dict[str, float]:
    """Sample name -> value, for samples labelled by nothing but their model, summed over the
    models: the gateway's totals (a size such as prefixgate_kv_pool_block_tokens is one
    model's only on a gateway of one model; `labelled(name, "model")` has each's)."""
    out: dict[str, float] = {}
    for s in samples:
        if set(s.labels) <= {"model"}:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def scrape(base_url: str, metrics_key: str | None = None) -> list[Sample]:
    """Every sample of a server's Prometheus /metrics."""
    request = urllib.request.Request(base_url + "/metrics", headers={
        "Authorization": f"Bearer {metrics_key}"} if metrics_key else {})
    with urllib.request.urlopen(request, timeout=5) as r:
        text = r.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


class ServerProcess:
    """A server started as a subprocess on a free loopback port, stopped with SIGTERM.
    `host`: the address it is reached at, when it listens elsewhere (a network namespace)."""

    def __init__(self, command: list[str], health_path: str, log_path: Path,
                 cwd: Path = ROOT, env: dict[str, str] | None = None,
                 health_timeout: float = 180, host: str = "127.0.0.1",
                 wait: bool = True) -> None:
        """`wait`: return once it serves; False returns at once, and `serving()` waits (to
        start several together: see started_together)."""
        self.port = free_port()
        self.base_url = f"http://{host}:{self.port}"
        self.log_path = log_path
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen([part.replace("{port}", str(self.port)) for part in command],
                                     cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self._health = (health_path, health_timeout)
        if wait:
            self.serving()

    def serving(self) -> ServerProcess:
        """Waits until it answers its health path."""
        self._wait_healthy(*self._health)
        return self

    def _wait_healthy(self, path: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with status {self.proc.returncode}: "
                                   f"{self.log_path.read_text(errors='replace')[-3000:]}")
            try:
                with urllib.request.urlopen(self.base_url + path, timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.05)  # a look costs a refused connect; ~115 gateways start per suite
        raise TimeoutError(f"{self.base_url}{path} did not answer 200 in time")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


def started_together(*starting: ServerProcess) -> tuple:
    """Servers started with `wait=False`, once each serves: they load at the same time rather
    than one after the other. If one fails to, every one is stopped."""
    try:
        for server in starting:
            server.serving()
    except BaseException:
        for server in starting:
            server.stop()
        raise
    return starting


class GatewayProcess(ServerProcess):
    """The real gateway, as a user would start it."""

    def __init__(self, model_path: Path, *args: str, source: Path = ROOT,
                 env: dict[str, str] | None = None, module: str = "gateway",
                 health_timeout: float = 180, host: str = "127.0.0.1",
                 launcher: tuple[str, ...] = (), wait: bool = True) -> None:
        """`source`: the checkout whose gateway runs (another one for before/after figures);
        `env`: variables to add to this process's environment; `module`: the entry point
        (the tests' own, tests.replay_gateway or tests.clocked_gateway, for their hooks);
        `health_timeout`: how long it may take to serve (a software GPU compiles shaders);
        `host`: the address it listens on; `launcher`: what runs it (`ip netns exec NS`);
        `wait`: ServerProcess's."""
        self.model_name = model_path.stem
        self.metrics_key = args[args.index("--metrics-key") + 1] if "--metrics-key" in args \
            else None
        # The consistency check ends every fault test: each gateway started here has it on.
        if "--debug-key" not in args:
            args = (*args, "--debug-key", secrets.token_hex(16))
        self.debug_key = args[args.index("--debug-key") + 1]
        super().__init__([*launcher, sys.executable, "-m", module, "--model", str(model_path),
                          "--host", host, "--port", "{port}", *args], "/health",
                         ROOT / ".pytest_cache" / f"gateway-{os.getpid()}-{id(self)}.log",
                         cwd=source, env=env, health_timeout=health_timeout, host=host,
                         wait=wait)

    def metrics(self) -> dict[str, float]:
        """Sample name -> value, for samples labelled by nothing but their model, summed over
        the models (totals())."""
        return totals(self._samples())

    def per_worker(self, name: str) -> dict[str, float]:
        """Worker id -> value of a `prefixgate_worker_*` sample."""
        return self.labelled(name, "worker")

    def labelled(self, name: str, label: str) -> dict[str, float]:
        """A label's value -> the value of each `name` sample."""
        return {s.labels[label]: s.value for s in self._samples() if s.name == name}

    def _samples(self) -> list[Sample]:
        return scrape(self.base_url, self.metrics_key)

    def consistency(self) -> dict:
        """/debug/consistency: {"ok", "problems"}."""
        request = urllib.request.Request(self.base_url + "/debug/consistency", headers={
            "Authorization": f"Bearer {self.debug_key}"})
        with urllib.request.urlopen(request, timeout=30) as r:
            return json.loads(r.read())

    def health(self) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def wait_idle(self, timeout: float = 30) -> dict[str, float]:
        """Waits until no request holds or waits for a sequence; returns the last metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["prefixgate_num_requests_running"] == 0 and \
                    m["prefixgate_num_requests_waiting"] == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"engine still busy: {m}")
            time.sleep(0.1)

    def settled(self, timeout: float = 30) -> dict[str, float]:
        """wait_idle(), then the gateway's consistency check: nothing held, nothing leaked."""
        metrics = self.wait_idle(timeout)
        problems = self.consistency()["problems"]
        assert not problems, problems
        return metrics

