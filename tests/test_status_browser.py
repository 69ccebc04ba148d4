"""The status page in a real browser: headless Debian Chromium through chromedriver (selenium).

Starts a gateway with its telemetry listener in front of the session's Triton, drives the
demo workload (``orchid_tools.demo``: every tenant, class and kind of request, the wrong
ones included), signs in on the page with the admin key and checks that the page shows the
values the metrics endpoint exports: the ladder step and offered demand of the full-v18
pool and a tenant's charged accelerator-ms. Then it saves the README's screenshot. A
non-admin key gets the page's refusal.

The envelope is narrow on purpose (``protected_utilization`` 0.03: 120 ms/s on the four
emulated devices) so that the demo mix climbs the ladder within seconds on two cores and
the page has step changes, evidence and rejections to show. To compare like with like, the
ladder's update loop is stopped once the load has climbed it: the evidence then holds
still while the page keeps polling, and page and scrape must agree (to the page's
rounding). Every wait is a condition with a deadline (WebDriverWait), never a sleep.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.backends.local import LocalTriton
from gateway.config import TelemetryConfig
from orchid_tools.demo import WorkloadResult, WorkloadSettings, build_scenarios, drive
from tests.conftest import OPS_KEY, ORCHID_KEY, TIME_FACTOR, ThreadedGateway, gateway_config

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
# Where the screenshot goes: a temporary file by default (a test run leaves the tree as it was);
# ORCHID_STATUS_SCREENSHOT=docs/img/status-page.png regenerates the README's image.
SCREENSHOT_TO = os.environ.get("ORCHID_STATUS_SCREENSHOT")
POOL = "local/full-v18"
WAIT_S = 30.0


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("needs Debian's chromium and chromium-driver (scripts/bootstrap.sh installs them)")
    options = Options()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.add_argument("--window-size=1400,1000")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def stack(triton: LocalTriton) -> Iterator[ThreadedGateway]:
    config = gateway_config(
        triton.address,
        protected_utilization=0.03,
        telemetry=TelemetryConfig(metrics_listen="127.0.0.1:0", tenant_labels=True),
    )
    running = ThreadedGateway(config)
    running.start()
    try:
        yield running
    finally:
        running.stop()


def base_url(running: ThreadedGateway) -> str:
    assert running.server.telemetry_listener is not None
    return running.server.telemetry_listener.url


def scrape(running: ThreadedGateway) -> str:
    with urllib.request.urlopen(base_url(running) + "/metrics", timeout=10) as reply:
        return str(reply.read().decode())


def metric(text: str, name: str, **labels: str) -> float:
    total, found = 0.0, False
    for line in text.splitlines():
        match = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            total, found = total + float(match.group(2)), True
    assert found, f"{name}{labels} not exported"
    return total


def ladder_step(running: ThreadedGateway) -> int:
    gateway = running.server.gateway
    assert gateway is not None
    return int(running.call_soon(lambda: gateway.loads[POOL].step if POOL in gateway.loads else 0))


def demand_samples(running: ThreadedGateway) -> int:
    board = running.server.status_board
    return int(running.call_soon(lambda: len(board._pools[POOL].samples) if POOL in board._pools else 0))


def stop_ladder_updates(running: ThreadedGateway) -> None:
    async def cancel() -> None:
        for task in running.server._tasks:
            if task.get_name() == "ladders":
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    running.call(cancel())


def sign_in(driver: WebDriver, url: str, key: str) -> None:
    """A fresh tab session (no stored key), the sign-in form, the key."""
    driver.get(url + "/status")
    driver.execute_script("window.sessionStorage.clear()")
    driver.get(url + "/status")
    wait = WebDriverWait(driver, WAIT_S)
    wait.until(lambda d: d.find_element(By.ID, "signin").is_displayed())
    driver.find_element(By.ID, "key").send_keys(key)
    driver.find_element(By.ID, "signin-submit").click()


def test_status_page_shows_live_values(stack: ThreadedGateway, browser: WebDriver, tmp_path: Path) -> None:
    screenshot = Path(SCREENSHOT_TO) if SCREENSHOT_TO else tmp_path / "status-page.png"
    url = base_url(stack)
    outcome: list[WorkloadResult] = []
    settings = WorkloadSettings(duration_s=12.0, rate=40.0, workers=8, seed=17, drain_s=20.0)
    load = threading.Thread(
        target=lambda: outcome.append(
            asyncio.run(drive(stack.address, build_scenarios(TIME_FACTOR), settings))
        ),
        name="demo-load",
    )
    load.start()
    try:
        sign_in(browser, url, OPS_KEY)
        WebDriverWait(browser, WAIT_S).until(
            lambda d: d.find_elements(By.CSS_SELECTOR, f'[data-pool="{POOL}"]')
        )
        # The demo mix must climb the narrow envelope (and the chart have some seconds of
        # history); then hold the evidence still.
        WebDriverWait(browser, WAIT_S, poll_frequency=0.1).until(
            lambda _: ladder_step(stack) >= 2 and demand_samples(stack) >= 8
        )
        stop_ladder_updates(stack)
    finally:
        load.join(timeout=settings.duration_s + settings.drain_s + 30)
    assert outcome and outcome[0].offered > 0

    def shown(css: str) -> str:
        """The element's text; the page re-renders on every poll, so an element found may be
        replaced before it is read: find it again then (a few times)."""
        for _ in range(20):
            try:
                return str(browser.find_element(By.CSS_SELECTOR, css).text)
            except StaleElementReferenceException:
                continue
        return str(browser.find_element(By.CSS_SELECTOR, css).text)

    def agrees(_: WebDriver) -> bool:
        metrics = scrape(stack)
        step = shown(f'[data-pool="{POOL}"] .step')
        offered = float(shown(f'[data-pool="{POOL}"] .offered'))
        charged = float(shown('[data-tenant="orchid"] .charged'))
        return (
            int(step) == metric(metrics, "orchid_ladder_step", pool=POOL)
            and abs(offered - metric(metrics, "orchid_pool_offered_accelerator_ms_per_second", pool=POOL))
            <= 0.051
            and abs(charged - metric(metrics, "orchid_charged_accelerator_ms_total", tenant="orchid"))
            <= 0.051
        )

    WebDriverWait(browser, WAIT_S, ignored_exceptions=(StaleElementReferenceException,)).until(agrees)
    metrics = scrape(stack)
    assert int(shown(f'[data-pool="{POOL}"] .step')) >= 2
    assert float(shown(f'[data-pool="{POOL}"] .offered')) > 0
    assert float(shown('[data-tenant="orchid"] .charged')) > 0
    assert metric(metrics, "orchid_pool_offered_accelerator_ms_per_second", pool=POOL) > metric(
        metrics, "orchid_pool_protected_accelerator_ms_per_second", pool=POOL
    )
    # The step history names its evidence; recent decisions are listed; backends are ready.
    evidence = shown(f'[data-pool="{POOL}"] .steps')
    assert "of protected" in evidence and "climb 0 ->" in evidence
    assert len(browser.find_elements(By.CSS_SELECTOR, "#decisions tbody tr")) > 10
    assert "ready" in shown("#backends tbody")
    assert browser.find_elements(By.CSS_SELECTOR, f'[data-pool="{POOL}"] svg.chart polyline')

    screenshot.parent.mkdir(parents=True, exist_ok=True)
    height = int(browser.execute_script("return document.documentElement.scrollHeight"))
    browser.set_window_size(1400, min(max(height, 1000), 4000))
    WebDriverWait(browser, WAIT_S, ignored_exceptions=(StaleElementReferenceException,)).until(
        lambda d: d.find_element(By.ID, "board").is_displayed()
    )
    assert browser.save_screenshot(str(screenshot))
    assert screenshot.stat().st_size > 10_000


def test_status_page_refuses_a_non_admin_key(stack: ThreadedGateway, browser: WebDriver) -> None:
    sign_in(browser, base_url(stack), ORCHID_KEY)
    WebDriverWait(browser, WAIT_S).until(lambda d: d.find_element(By.ID, "refused").is_displayed())
    assert "403" in browser.find_element(By.ID, "refused-reason").text
    assert not browser.find_element(By.ID, "board").is_displayed()
    assert "orchid" not in browser.find_element(By.ID, "pools").get_attribute("textContent")
