"""The dashboard in a real headless Chromium (Debian's chromium + chromium-driver, selenium).

1. A real ``rl-controller run`` trains while the page is open: the reward/lag chart
   gains steps, the event table gains rows and the page's latency samples (arrival in
   the browser minus the ts the controller stamped right before each append) are
   printed. Then the run ends and the page says so, with the audit status. The run is
   held (``tests.plugin_tasks.RewardHeldWhileMarked``) after one step until the page is
   open, then after two until the page has seen it progress, so "live" holds by
   construction, not because the run is slower than the browser.
2. A finished run, served under the read-only ACL user: every finished step is drawn,
   the type filter works, the trace of some steps is drawn by the page's viewer, and no
   page or answer carries the store's password.

Screenshots go to pytest's tmp dir, or to $RLC_SCREENSHOT_DIR when set (docs/observe.md
shows two of them).
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest

from events.redis_store import RedisEventStore
from events.redis_store.acl import acl_rules
from tests.chaos.harness import TINY
from tests.e2e.test_readonly_cli import write_log
from tests.plugin_tasks import HELD_TASK, held_env, hold_rewards_after
from tests.unit.random_log import random_run

pytestmark = [pytest.mark.integration, pytest.mark.browser]

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
STEPS = 400  # enough live events for the latency figures (docs/observe.md)
#: rewards per step under TINY: train.groups_per_step x rollout.samples_per_group
STEP_REWARDS = 2 * 4


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not (Path(CHROMIUM).exists() and Path(DRIVER).exists()):
        pytest.skip("chromium / chromium-driver not installed (scripts/setup.sh installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="rlc-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
                "--window-size=1400,1100"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def screenshot(driver: Any, name: str, tmp_path: Path) -> Path:
    where = Path(os.environ.get("RLC_SCREENSHOT_DIR") or tmp_path)
    where.mkdir(parents=True, exist_ok=True)
    path = where / name
    assert driver.save_screenshot(str(path))
    return path


def wait_for(what: str, check: Callable[[], Any], timeout_s: float = 300.0,
             explain: Callable[[], str] = lambda: "") -> Any:
    """Poll ``check`` until it is truthy; fail naming ``what`` (no wall-clock assertion
    on the thing measured: only a budget for the wait)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what} {explain()}")


class Dashboard:
    """``rl-controller dashboard --port 0`` as a subprocess; ``url`` from its first line."""

    def __init__(self, redis_url: str) -> None:
        self.errors = tempfile.TemporaryFile("w+")  # a file: a full pipe would stall the server
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "dashboard", "--redis-url", redis_url,
             "--port", "0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=self.errors, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        if not found:
            self.proc.wait(timeout=30)
            self.errors.seek(0)
            raise AssertionError(f"dashboard did not start: {line!r} {self.errors.read()[-2000:]}")
        self.url = found.group(0)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def rlc(driver: Any) -> dict[str, Any]:
    return driver.execute_script("return window.rlc")


def table_positions(driver: Any) -> list[int]:
    return [int(p) for p in driver.execute_script(
        "return [...document.querySelectorAll('#events tbody tr')].map(r => r.dataset.position)")]


def test_a_live_run_updates_the_page(browser, redis_url: str, tmp_path: Path) -> None:
    store = RedisEventStore(redis_url)
    dashboard = Dashboard(redis_url)
    browser.get(dashboard.url + "run/none-yet")
    log = tmp_path / "run.log"  # a file, not a pipe: a full pipe would stall the run
    hold = tmp_path / "hold"
    hold_rewards_after(hold, STEP_REWARDS)  # one step, until the page is open
    run = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "run", "--run-id", "live", "--steps", str(STEPS),
         "--redis-url", redis_url, "--data-dir", str(tmp_path / "data"), *TINY,
         "--set", "controller.stall_timeout_s=600",
         *HELD_TASK],
        cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **held_env(hold)})
    try:
        wait_for("the run to start", lambda: store.run_exists("live") and store.last_position("live") >= 1)
        browser.get(dashboard.url + "run/live")
        wait_for("the snapshot", lambda: rlc(browser)["updates"] >= 1)
        steps0, last0 = rlc(browser)["steps"], max(table_positions(browser), default=0)
        hold_rewards_after(hold, 2 * STEP_REWARDS)  # one more step, which the page must see

        def explain() -> str:
            screenshot(browser, "dashboard-stuck.png", tmp_path)
            dashboard.errors.seek(0)
            page = {k: v for k, v in rlc(browser).items() if k != "latenciesMs"}
            return (f"(page: {page}, steps at first {steps0}, log at "
                    f"{store.last_position('live')}, run exit {run.poll()}, dashboard said: "
                    f"{dashboard.errors.read()[-1500:]!r})")

        def progressed() -> bool:
            if run.poll() is not None:  # say why rather than wait out the budget
                raise AssertionError(f"the run ended (exit {run.returncode}) before the page saw "
                                     f"it progress {explain()}: {log.read_text()[-1500:]}")
            return rlc(browser)["steps"] > steps0 and max(table_positions(browser)) > last0

        wait_for("new steps and events in the page", progressed, explain=explain)
        assert run.poll() is None, "the run ended before the page saw it run"
        assert "live" in browser.find_element("id", "live").text
        screenshot(browser, "dashboard-live.png", tmp_path)
        hold.unlink()  # on to the end
        assert run.wait(timeout=600) == 0, log.read_text()[-3000:]
        end = store.last_position("live")
        wait_for("the run's last event in the page", lambda: rlc(browser)["position"] == end)
        assert browser.find_element("id", "live").text == "finished"
        assert browser.find_element("id", "audit").text.startswith("audit: ok")
        assert rlc(browser)["steps"] == STEPS and max(table_positions(browser)) == end
        latencies = rlc(browser)["latenciesMs"]
        assert latencies, "no live update reached the page"
        q = statistics.quantiles(latencies, n=20)
        print(f"\nappend -> browser latency over {len(latencies)} live events: median "
              f"{statistics.median(latencies):.0f} ms, p95 {q[18]:.0f} ms, max {max(latencies):.0f} ms")
        screenshot(browser, "dashboard-finished.png", tmp_path)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        dashboard.close()
        store.close()


def test_a_finished_run_under_the_reader_user(browser, redis_url: str, shared_redis_server,
                                              tmp_path: Path) -> None:
    b = random_run(9, 25, p_abort=0.1, p_restart=0.05)
    write_log(redis_url, b)
    password = "reader-secret-pw"
    reply = shared_redis_server.command("ACL", "SETUSER", "rlc-reader", "on", f">{password}",
                                        *acl_rules("reader"))
    assert reply == b"+OK", reply
    reader_url = redis_url.replace("redis://", f"redis://rlc-reader:{password}@")
    dashboard = Dashboard(reader_url)
    try:
        browser.get(dashboard.url)
        link = wait_for("the runs list", lambda: browser.find_elements("link text", b.run_id))
        link[0].click()
        state = b.fold()
        finished = len(state.finished_steps())
        wait_for("every finished step drawn", lambda: rlc(browser)["steps"] == finished)
        assert browser.find_element("id", "audit").text.startswith("audit: ok")
        assert browser.find_element("id", "live").text == "finished"
        assert max(table_positions(browser)) == b.last_position
        # the type filter asks the server for older matches too
        from selenium.webdriver.support.ui import Select

        wait_for("the filter's event types", lambda: browser.find_elements(
            "css selector", "select[name=type] option[value=StepAborted]"))
        Select(browser.find_element("name", "type")).select_by_value("StepAborted")
        browser.find_element("css selector", "#filters button").click()
        aborted = sum(1 for s in b.events if type(s.event).__name__ == "StepAborted")
        wait_for("the filtered table", lambda: browser.execute_script(
            "return [...document.querySelectorAll('#events tbody tr')]"
            ".every(r => r.dataset.type === 'StepAborted')") and len(table_positions(browser)) == aborted)
        screenshot(browser, "dashboard-filtered.png", tmp_path)
        # the trace of steps 10..14 drawn by the page's small viewer (views.trace's JSON)
        browser.get(dashboard.url + f"run/{b.run_id}/trace?steps=10:14")
        drawn = wait_for("the trace drawn", lambda: browser.execute_script(
            "return window.rlcTrace.drawn && window.rlcTrace"))
        assert drawn["slices"] > 0 and drawn["flows"] > 0
        screenshot(browser, "trace-viewer.png", tmp_path)
        pages = [browser.page_source] + [
            urllib.request.urlopen(dashboard.url + path, timeout=30).read().decode()
            for path in ("api/runs", f"api/runs/{b.run_id}/events?limit=500")]
        assert not any(password in page for page in pages)
    finally:
        dashboard.close()
        shared_redis_server.command("ACL", "DELUSER", "rlc-reader")
