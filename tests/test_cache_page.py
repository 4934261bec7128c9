"""The live cache page in a real browser (Debian's headless Chromium through selenium): its
figures follow the traffic and match /v1/cache/stats."""

from __future__ import annotations

import json
import os
import shutil
import urllib.request

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from gateway.core.service import HistorySample
from gateway.workers.model_store import GEMMA3_270M
from gateway.workers.model_store import model_path as stored_model
from loadtest.gateway_process import GatewayProcess
from tests.conftest import openai_client

ADMIN = "page-admin"


@pytest.fixture
def browser():
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver, "chromium and chromium-driver are not installed (make test " \
                                "installs them)"
    options = Options()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,900"):
        options.add_argument(flag)
    session = webdriver.Chrome(service=Service(driver), options=options)
    yield session
    session.quit()


def stats(server: GatewayProcess, model: str | None = None) -> dict:
    request = urllib.request.Request(server.base_url + "/v1/cache/stats" + (
        f"?model={model}" if model else ""), headers={"Authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(request, timeout=10) as r:
        return json.loads(r.read())


def test_the_page_follows_the_traffic_and_matches_the_stats(browser, model_path, model_name):
    server = GatewayProcess(model_path, "--parallel", "2", "--ctx-size", "2048", "--cache-mb",
                            "64", "--admin-key", ADMIN)
    try:
        browser.get(f"{server.base_url}/cache#key={ADMIN}")
        wait = WebDriverWait(browser, 30, poll_frequency=0.2)

        def shows(element_id: str, value: object) -> bool:
            return browser.find_element(By.ID, element_id).text == str(value)

        wait.until(lambda _: shows("blocks-used", stats(server)["pool"]["blocks_used"]))
        assert shows("cells-total", stats(server)["cells"]["total"])
        client = openai_client(server)
        for i, retention in enumerate(["24h", "in_memory", "in_memory"]):
            client.completions.create(
                model=model_name, max_tokens=4,
                prompt=f"Harbour log {i}: the ships that came in today were many. " * 6,
                extra_body={"prompt_cache_retention": retention})
        # An answer that copies its prompt: drafted from it (speculation is on by default).
        client.chat.completions.create(
            model=model_name, max_tokens=60, temperature=0, messages=[{
                "role": "user", "content": "Repeat exactly: the ships that came in today were "
                                           "the Lark, the Heron, the Swift and the Kestrel."}])
        after = stats(server)
        assert after["pool"]["blocks_used"] > 0
        wait.until(lambda _: shows("blocks-used", after["pool"]["blocks_used"]))
        assert shows("pinned", after["pins"]["blocks"])
        assert after["speculation"]["prompt"]["accepted"] > 0

        def shows_the_drafts() -> bool:
            """The page's draft counts are the stats' (read again: a worker's last snapshot
            may land after the answer did)."""
            prompt_drafts = stats(server)["speculation"]["prompt"]
            return f"prompt {prompt_drafts['accepted']} of {prompt_drafts['drafted']}" in \
                browser.find_element(By.ID, "drafts-by-source").text

        wait.until(lambda _: shows_the_drafts())
        boxes = browser.find_elements(By.CSS_SELECTOR, "#treemap .prefix")
        assert len(boxes) >= 3
        assert browser.find_elements(By.CSS_SELECTOR, "#treemap .prefix.pinned")
        assert not browser.find_element(By.ID, "error").text
        if os.environ.get("PREFIXGATE_SCREENSHOT"):  # docs/cache-page.png is made this way
            browser.save_screenshot(os.environ["PREFIXGATE_SCREENSHOT"])
    finally:
        server.stop()


def test_with_two_models_the_page_shows_the_one_selected(browser, model_path, model_name):
    """Gemma's cache holds a prompt read twice, SmolLM2's nothing: the page shows the first
    model's, and once Gemma is selected, Gemma's blocks, cells, hit rate and prefixes."""
    gemma = stored_model(GEMMA3_270M)
    server = GatewayProcess(model_path, "--model", str(gemma), "--parallel", "1", "--ctx-size",
                            "1024", "--cache-mb", "64", "--admin-key", ADMIN)
    try:
        for _ in range(2):
            openai_client(server).completions.create(
                model=gemma.stem, max_tokens=2, prompt="The lighthouse keeper's log. " * 20)
        browser.get(f"{server.base_url}/cache#key={ADMIN}")
        wait = WebDriverWait(browser, 30, poll_frequency=0.2)

        def shows(element_id: str, value: object) -> bool:
            return browser.find_element(By.ID, element_id).text == str(value)

        smol = stats(server)
        wait.until(lambda _: shows("blocks-used", smol["pool"]["blocks_used"])
                   and shows("cells-total", smol["cells"]["total"]))
        assert shows("hit-rate", "-") and not browser.find_elements(By.CSS_SELECTOR, ".prefix")
        choice = Select(browser.find_element(By.ID, "model"))
        assert [o.get_attribute("value") for o in choice.options] == [model_name, gemma.stem]
        choice.select_by_value(gemma.stem)
        after = stats(server, gemma.stem)
        assert after["pool"]["blocks_used"] > smol["pool"]["blocks_used"]
        wait.until(lambda _: shows("blocks-used", after["pool"]["blocks_used"])
                   and shows("cells-total", after["cells"]["total"]))
        assert after["hit_rate"]["all"] > 0

        def shows_the_hit_rate() -> bool:
            """The page's figure: the last minute's, else since the start (read again: a
            history sample may be taken meanwhile)."""
            rates = stats(server, gemma.stem)["hit_rate"]
            rate = rates["all"] if rates["1m"] is None else rates["1m"]
            return shows("hit-rate", f"{100 * rate:.1f}%")

        wait.until(lambda _: shows_the_hit_rate())
        assert browser.find_elements(By.CSS_SELECTOR, "#treemap .prefix")
        assert not browser.find_element(By.ID, "error").text
    finally:
        server.stop()


def test_the_page_is_absent_without_the_admin_api(gateway):
    import urllib.error

    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(gateway.base_url + "/cache", timeout=5)
    assert raised.value.code == 404


def test_the_history_counts_a_reloaded_models_counters_from_zero():
    """A model's pool counts start again at zero when it reloads: the minute across the
    reload has 40 evictions and a hit rate of a quarter (it had -960 evictions a minute and a
    hit rate of 7.5)."""
    before = HistorySample(at=0.0, wall=0.0, queried=4000, hit=3000, evictions=1000,
                           ttft_seconds=10.0, ttft_count=20)
    after = HistorySample(at=60.0, wall=60.0, queried=400, hit=100, evictions=40,
                          ttft_seconds=12.0, ttft_count=24)
    assert after.between(before) == {"time": 60.0, "hit_rate": 0.25, "ttft": 0.5,
                                     "evictions_per_minute": 40.0}
    steady = HistorySample(at=120.0, wall=120.0, queried=800, hit=300, evictions=100,
                           ttft_seconds=13.0, ttft_count=26)
    assert steady.between(after) == {"time": 120.0, "hit_rate": 0.5, "ttft": 0.5,
                                     "evictions_per_minute": 60.0}
