"""Runs the real gateway as a subprocess on a free loopback port, as a user would start it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GatewayProcess:
    def __init__(self, model_path: Path, *args: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.model_name = model_path.stem
        self.log_path = ROOT / ".pytest_cache" / f"gateway-{self.port}.log"
        self.log_path.parent.mkdir(exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "--model", str(model_path), "--port",
             str(self.port), *args],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=os.environ.copy())
        self.wait_ready()

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited: {self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise TimeoutError("gateway did not become healthy")

    def metrics(self) -> dict[str, float]:
        """Sample name -> value, for unlabelled samples."""
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        return {s.name: s.value for family in text_string_to_metric_families(text)
                for s in family.samples if not s.labels}

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

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()
