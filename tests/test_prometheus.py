"""The monitoring files against real parts: a real Prometheus scrapes a real gateway (with its
Redis tier, serving both real models one at a time) through deploy/prometheus/prometheus.yml,
and every query of every Grafana panel is evaluated through Prometheus's HTTP API as Grafana
would send it, for each instance and each model the dashboard's variables offer."""

from __future__ import annotations

import itertools
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from gateway.workers.model_store import GEMMA3_270M
from gateway.workers.model_store import model_path as stored_model
from loadtest.gateway_process import GatewayProcess, redis_server, scrape
from tests.conftest import DEFAULT_ARGS, openai_client
from tests.dashboards import (
    dashboard_files,
    dashboard_queries,
    multi_value,
    panel_queries,
    rate_interval,
    substitute,
)
from tests.prometheus import CONFIG, JOB, Prometheus, alert_names, binary, has_data
from tests.test_cache_controls import ADMIN, admin
from tests.test_prefix_cache import ask, system_chat

SCRAPE_SECONDS = 1  # the repo's 5 s, shortened so that a few seconds of traffic fill the panels
# Grafana's $__interval is the time range over the panel's data points (its width in pixels),
# never below the datasource's scrape interval: for a minute of data, the scrape interval.
MAX_DATA_POINTS = 1000
SYSTEM = "You keep the ferry timetable of the northern islands and answer in one line. " * 8
VARIABLE_QUERY = re.compile(r"label_values\((\w+),\s*(\w+)\)")
GEMMA = stored_model(GEMMA3_270M).stem
METRIC = re.compile(r"\bprefixgate_[a-z0-9_]+")


@pytest.fixture(scope="module")
def monitored(model_path, tmp_path_factory):
    """A gateway with the Redis tier and the admin API, serving SmolLM2 and Gemma with room
    for one loaded (each request to the other swaps them), and a Prometheus scraping it (and
    evaluating the alert rules)."""
    with redis_server() as (url, _):
        gateway = GatewayProcess(model_path, *DEFAULT_ARGS, "--redis-url", url,
                                 "--admin-key", ADMIN, "--model", str(stored_model(GEMMA3_270M)),
                                 "--models-max", "1")
        try:
            prometheus = Prometheus(tmp_path_factory.mktemp("prometheus"),
                                    f"127.0.0.1:{gateway.port}", f"{SCRAPE_SECONDS}s")
            try:
                prometheus.wait_for(f'up{{job="{JOB}"}}', 1)
                yield gateway, prometheus
            finally:
                prometheus.stop()
        finally:
            gateway.stop()


def traffic(gateway: GatewayProcess, model: str) -> None:
    """What lights every panel for `model`: its load (the other model unloaded), streamed
    answers (latencies), two requests on one new prefix at once (pool and live sharing), and
    the same prefix again after the local pool was dropped, so that it comes back from
    Redis."""
    client = openai_client(gateway)
    questions = ["When does the first ferry leave?", "Is there a night ferry?"]
    with ThreadPoolExecutor(len(questions)) as pool:
        usages = [u for _, u in pool.map(
            lambda q: ask(client, model, system_chat(q, SYSTEM)), questions)]
    for chunk in client.completions.create(model=model, stream=True, max_tokens=8,
                                           prompt="The harbour master's log, day one:",
                                           extra_body={"ignore_eos": True}):
        assert chunk.choices
    deadline = time.monotonic() + 30
    while tier(gateway, model, "stores") < usages[0].prompt_tokens // 64:
        assert time.monotonic() < deadline, "the blocks never reached Redis"
        time.sleep(0.05)
    assert admin(gateway, "DELETE", f"/v1/cache/prefixes?model={model}")[1]["dropped_blocks"]
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=system_chat("And on Sundays?", SYSTEM), max_tokens=8,
        temperature=0)
    usage = raw.parse().usage
    assert usage.prompt_tokens_details.cached_tokens > 0
    assert raw.headers["x-prefix-cache"] == (f"cached={usage.prompt_tokens_details.cached_tokens}"
                                             f"; prompt={usage.prompt_tokens}; source=redis")
    assert tier(gateway, model, "hits") > 0


def tier(gateway: GatewayProcess, model: str, name: str) -> float:
    """What the Redis tier counted for `model` (`name`: stores or hits)."""
    return sum(s.value for s in scrape(gateway.base_url)
               if s.name == f"prefixgate_prefix_cache_tier_{name}_total"
               and s.labels == {"model": model, "tier": "redis"})


def selections(prometheus: Prometheus, queries: list[str], variable: str) -> dict[str, str]:
    """A variable's values as Grafana fills it in: All (its allValue), each value its own
    label_values query lists, and all of them selected together."""
    metrics = {m.group(1) for q in queries if (m := VARIABLE_QUERY.search(q))
               and m.group(2) == variable}
    assert len(metrics) == 1, f"the dashboard's {variable} variable reads {metrics or 'nothing'}"
    (metric,) = metrics
    listed = prometheus.api(f"label/{variable}/values", **{"match[]": metric})
    return {"All": ".*", **{value: multi_value([value]) for value in listed},
            " and ".join(listed): multi_value(listed)}


def test_every_panel_query_returns_data_for_each_instance_and_model(monitored) -> None:
    """Every panel query returns data whichever instance and model the variables select (each
    model loaded and used in turn), and none for a model not served: every panel filters by
    the model variable."""
    gateway, prometheus = monitored
    start = time.time()
    traffic(gateway, GEMMA)  # loads Gemma (unloading SmolLM2), then SmolLM2 again
    traffic(gateway, gateway.model_name)
    finished = gateway.wait_idle()["prefixgate_generation_tokens_total"]
    prometheus.wait_for("sum(prefixgate_generation_tokens_total)", finished)
    # The panels as they look a rate window after the traffic, once Prometheus has scraped
    # that far: then every window around it, the last increments' too, lies in the range.
    interval = SCRAPE_SECONDS  # at these time ranges, under MAX_DATA_POINTS points
    window = rate_interval(interval, SCRAPE_SECONDS)
    end = time.time() + window
    prometheus.wait_for(f'timestamp(up{{job="{JOB}"}}) >= bool {end}', 1)
    assert (end - start) / MAX_DATA_POINTS < interval
    variables = {"__rate_interval": f"{window:g}s", "__interval": f"{interval:g}s"}

    def data(expr: str) -> bool:
        return has_data(prometheus.api("query_range", query=expr, start=start, end=end,
                                       step=interval))

    queries, empty, unfiltered = [], [], []
    for dashboard in dashboard_files():
        asked = dashboard_queries(dashboard)
        instances, models = selections(prometheus, asked, "instance"), \
            selections(prometheus, asked, "model")
        assert {GEMMA, gateway.model_name} < set(models), models
        for query in panel_queries(dashboard):
            queries.append(query)
            for (instance, i_value), (model, m_value) in itertools.product(
                    instances.items(), models.items()):
                expr = substitute(query.expr, {**variables, "instance": i_value,
                                               "model": m_value})
                if not data(expr):
                    empty.append((query, f"{query.dashboard} {query.panel!r} {query.ref_id} "
                                         f"(instance {instance}, model {model}): {expr}"))
            expr = substitute(query.expr, {**variables, "instance": ".*", "model": "no-such"})
            if data(expr):
                unfiltered.append(f"{query.dashboard} {query.panel!r} {query.ref_id}: {expr}")
    answered = len(queries) - len({query for query, _ in empty})
    print(f"\n{answered} of {len(queries)} panel queries returned data "
          f"(instance {', '.join(instances)}; model {', '.join(models)})")
    assert queries and not empty, "\n".join(line for _, line in empty)
    assert not unfiltered, "\n".join(unfiltered)


def test_alert_rules_evaluate_on_a_live_gateway(monitored) -> None:
    """Prometheus loaded alerts.yml through prometheus.yml, evaluates every rule without an
    error, and every metric a rule reads is one the gateway exports."""
    gateway, prometheus = monitored
    ask(openai_client(gateway), gateway.model_name, system_chat("Any ferry today?"), 4)
    deadline = time.monotonic() + 60
    while True:
        rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
        if rules and all(r["health"] != "unknown" for r in rules):
            break
        assert time.monotonic() < deadline, "the rules were never evaluated"
        time.sleep(0.2)
    assert {r["name"] for r in rules} == set(alert_names())
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r["lastError"]) for r in rules]
    for name in sorted({m for r in rules for m in METRIC.findall(r["query"])}):
        prometheus.wait_for(f"count({name}) > bool 0", 1)


def test_promtool_checks_the_config() -> None:
    """The config as shipped (with the rule files it loads), by Prometheus's own checker."""
    result = subprocess.run([binary("promtool"), "check", "config", str(CONFIG)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
