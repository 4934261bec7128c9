"""A real Prometheus (Debian's `prometheus` package, installed by `make system-deps`) on a loopback
port, run with the repo's own deploy/prometheus/prometheus.yml: only the scrape target and the
intervals are rewritten, and the rule files it names are laid beside it as compose mounts them."""

from __future__ import annotations

import json
import math
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from loadtest.gateway_process import ServerProcess

CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "prometheus.yml"
JOB = "prefixgate"


def binary(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is not installed (make test installs Debian's prometheus package)"
    return path


def rule_files() -> list[Path]:
    """The rule files prometheus.yml loads, relative to it as Prometheus resolves them."""
    config = yaml.safe_load(CONFIG.read_text())
    return [CONFIG.parent / name for name in config.get("rule_files") or []]


def alert_names() -> list[str]:
    """Every alert of the rule files prometheus.yml loads."""
    return [rule["alert"] for path in rule_files()
            for group in yaml.safe_load(path.read_text())["groups"]
            for rule in group["rules"] if "alert" in rule]


def rewritten_config(target: str, interval: str) -> dict[str, Any]:
    """The repo's config scraping `target` every `interval` (and evaluating rules as often)."""
    config = yaml.safe_load(CONFIG.read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == JOB)
    job["static_configs"] = [{"targets": [target]}]
    job["scrape_interval"] = job["scrape_timeout"] = interval
    config["global"]["evaluation_interval"] = interval
    return config


class Prometheus(ServerProcess):
    def __init__(self, workdir: Path, target: str, interval: str) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / CONFIG.name
        config.write_text(yaml.safe_dump(rewritten_config(target, interval)))
        for rules in rule_files():
            shutil.copy(rules, workdir / rules.name)
        super().__init__([binary("prometheus"), f"--config.file={config}",
                          f"--storage.tsdb.path={workdir / 'data'}",
                          "--web.listen-address=127.0.0.1:{port}"],
                         "/-/ready", workdir / "prometheus.log")

    def api(self, path: str, **params: Any) -> Any:
        """The `data` of a successful /api/v1 answer."""
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.base_url}/api/v1/{path}?{query}",
                                        timeout=30) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as exc:  # a query that does not parse: Prometheus's word
            body = json.loads(exc.read())
        assert body["status"] == "success", body
        return body["data"]

    def value(self, expr: str) -> float | None:
        """An instant query's single value, None when it has no result."""
        result = self.api("query", query=expr)["result"]
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, expr: str, expected: float, timeout: float = 60) -> None:
        """Until Prometheus has scraped a value of `expr` equal to `expected`."""
        deadline = time.monotonic() + timeout
        while (seen := self.value(expr)) != expected:
            assert time.monotonic() < deadline, f"{expr} is {seen}, never {expected}"
            time.sleep(0.2)


def has_data(result: dict[str, Any]) -> bool:
    """Whether a range query's answer has a series with at least one number (a panel line):
    histogram_quantile over no observations, or 0/0, give NaN only."""
    return any(math.isfinite(float(v)) for series in result["result"]
               for _, v in series["values"])
