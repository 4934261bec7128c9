"""The Grafana dashboards under deploy/grafana/dashboards: their queries, and the variables Grafana
fills in before it sends one to Prometheus."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DASHBOARDS = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "dashboards"
# Grafana escapes these in a multi-value or include-all variable's values before putting them in
# a regex matcher (its Prometheus datasource's prometheusSpecialRegexEscape).
_REGEX_SPECIALS = re.compile(r"[$^*{}\[\]'+?.()|]")


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    ref_id: str
    expr: str


def walk(node: Any) -> Iterator[Any]:
    yield node
    if isinstance(node, dict):
        for value in node.values():
            yield from walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk(value)


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARDS.glob("*.json"))


def dashboard_queries(path: Path) -> list[str]:
    """Every PromQL expression of a dashboard: panel targets and template variable queries."""
    out = []
    for node in walk(json.loads(path.read_text())):
        if isinstance(node, dict):
            out += [v for k, v in node.items()
                    if k in {"expr", "query", "definition"} and isinstance(v, str)]
    return out


def panel_queries(path: Path) -> list[PanelQuery]:
    """The query of every target of every panel, rows' nested panels included."""
    out = []
    for node in walk(json.loads(path.read_text())):
        if isinstance(node, dict) and "targets" in node:
            out += [PanelQuery(path.name, node["title"], t["refId"], t["expr"])
                    for t in node["targets"] if t.get("expr")]
    return out


def multi_value(values: list[str]) -> str:
    """A multi-value variable's selection as Grafana writes it into a `=~` matcher: each value
    regex-escaped, several as an alternation."""
    escaped = [_REGEX_SPECIALS.sub(lambda m: "\\\\" + m.group(0), v.replace("\\", "\\\\\\\\"))
               for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def rate_interval(interval_s: float, scrape_interval_s: float) -> float:
    """Grafana's $__rate_interval: four scrapes at least, so that rate() always has two samples
    even when one scrape is late or lost."""
    return max(interval_s + scrape_interval_s, 4 * scrape_interval_s)


def substitute(expr: str, variables: dict[str, str]) -> str:
    """`$name` and `${name}` replaced, longest names first (`$__rate_interval` before a
    `$__rate` would be)."""
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", variables[name]).replace("$" + name,
                                                                         variables[name])
    assert "$" not in expr, f"a variable left unset in {expr!r}"
    return expr
