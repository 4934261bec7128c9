"""deploy/prometheus/alerts.yml through promtool: the rules check, and the unit tests of
alerts_test.yml, which must make every alert fire and then clear."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from tests.prometheus import CONFIG, alert_names, binary

TESTS = CONFIG.parent / "alerts_test.yml"


def promtool(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([binary("promtool"), *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def test_promtool_checks_the_rules() -> None:
    rules = yaml.safe_load(TESTS.read_text())["rule_files"]
    result = promtool("check", "rules", *(TESTS.parent / name for name in rules))
    assert result.returncode == 0, result.stdout + result.stderr


def seconds(duration: str) -> int:
    """A Prometheus duration of one unit (`90s`, `15m`, `2h`)."""
    return int(duration[:-1]) * {"s": 1, "m": 60, "h": 3600}[duration[-1]]


def test_every_alert_fires_and_clears() -> None:
    """The unit tests pass, and each alert has a test group in which it fires and, later in
    the same series, has cleared (a file that only ever expects silence would pass too)."""
    result = promtool("test", "rules", TESTS)
    assert result.returncode == 0, result.stdout + result.stderr
    fired_and_cleared = set()
    for group in yaml.safe_load(TESTS.read_text())["tests"]:
        cases: dict[str, list[tuple[int, bool]]] = {}
        for case in group["alert_rule_test"]:
            cases.setdefault(case["alertname"], []).append(
                (seconds(case["eval_time"]), bool(case.get("exp_alerts"))))
        for alert, timeline in cases.items():
            fired = [t for t, fires in timeline if fires]
            if fired and any(t > min(fired) and not fires for t, fires in timeline):
                fired_and_cleared.add(alert)
    assert set(alert_names()) <= fired_and_cleared, \
        f"never fired and then cleared: {sorted(set(alert_names()) - fired_and_cleared)}"
