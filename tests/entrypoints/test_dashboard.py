"""The dashboard: GET /dashboard/state (JSON, behind the API key) and GET /dashboard driven
in real headless Chromium (Debian's chromium + chromium-driver, through selenium, with no
browser download): in-use, shared and cached blocks must appear in the page's DOM while
requests run (n > 1 and a shared prefix), and its counters must move."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.entrypoints.conftest import API_KEY
from tests.entrypoints.conftest import SERVED_NAME as MODEL
from tests.entrypoints.utils import RemoteServer

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# About 200 tokens shared by several prompts: whole 16-token blocks the prefix cache can share.
SHARED_PREFIX = "You are a careful assistant who answers in full sentences. " * 20


@pytest.fixture
def key_server(keyed_server):
    """The shared server behind --api-key (conftest.py; the auth tests use it too)."""
    return keyed_server


def get_state(server: RemoteServer, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.get(server.url + "/dashboard/state", headers=headers, timeout=60)


def wait_all_blocks_free(server: RemoteServer, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        state = get_state(server).json()
        if state["kv"]["num_in_use"] == 0 or time.monotonic() > deadline:
            assert state["kv"]["num_in_use"] == 0, "KV blocks still held after every request ended"
            return state
        time.sleep(0.3)


def test_state_json_requires_the_key_and_is_consistent(key_server):
    assert get_state(key_server, key=None).status_code == 401
    assert get_state(key_server, key="wrong").status_code == 401
    assert httpx.get(key_server.url + "/dashboard", timeout=30).status_code == 200  # the page asks

    client = openai.OpenAI(base_url=key_server.base_url, api_key=API_KEY, max_retries=0, timeout=300)
    for question in ("Name a colour.", "Name a fruit."):
        client.completions.create(model=MODEL, prompt=SHARED_PREFIX + question, max_tokens=4,
                                  temperature=0, extra_body={"ignore_eos": True})
    state = wait_all_blocks_free(key_server)
    kv = state["kv"]
    n = kv["num_blocks"]
    assert len(kv["block_state"]) == len(kv["ref_cnt"]) == len(kv["owner"]) == n > 100
    assert kv["block_state"][0] == kv["state_names"].index("null")
    # The two prompts computed the shared prefix's full blocks: they stay cached once freed,
    # and the second prompt found them (a prefix-cache hit).
    free_cached = kv["state_names"].index("free_cached")
    assert kv["num_free_cached"] == kv["block_state"].count(free_cached) >= 10
    assert kv["num_free"] + kv["num_free_cached"] == n - 1
    assert kv["usage"] == 0.0 and kv["num_shared"] == 0 and set(kv["owner"]) == {-1}
    assert state["prefix_cache"]["hits_total"] >= 10 * kv["block_size"]
    assert 0 < state["prefix_cache"]["hit_rate_total"] < 1
    assert state["throughput"]["generation_tokens_total"] >= 8
    assert state["throughput"]["prompt_tokens_total"] >= 2 * 200
    assert state["latency"]["ttft_s"]["count"] >= 2 and state["latency"]["ttft_s"]["p50"] > 0
    assert state["latency"]["itl_s"]["count"] >= 6
    assert state["requests"] == {"running": 0, "waiting": 0, "preempted": 0,
                                 "preemptions_total": state["requests"]["preemptions_total"]}
    assert state["engine"]["snapshot_seconds"] > 0 and state["engine"]["step_seconds_mean"] > 0


def make_driver(user_data_dir: str):
    """Headless Debian Chromium through its chromedriver, given by path so that selenium
    never runs Selenium Manager (which would go to the network)."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        pytest.fail(f"{', '.join(missing)} not found: install Debian's browser with "
                    "`apt-get install -y chromium chromium-driver` (`make test` does)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-dev-shm-usage", "--window-size=1400,1000",
                 f"--user-data-dir={user_data_dir}"):
        options.add_argument(flag)
    options.unhandled_prompt_behavior = "ignore"  # the test answers the API-key prompt itself
    # driver.get returns at DOMContentLoaded: the page's API-key prompt comes after load, and
    # a prompt open while chromedriver waits for a full load could hold driver.get forever.
    options.page_load_strategy = "eager"
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)


# Counts read from the page's DOM (the block map's cells and the figures table).
DOM_COUNTS = """
const cells = document.querySelectorAll('#blockmap .cell');
const count = (s) => document.querySelectorAll('#blockmap .cell[data-state="' + s + '"]').length;
const shared = document.querySelector('#blockmap .cell.shared');
return {
  cells: cells.length,
  in_use: count('in_use') + count('in_use_cached'),
  free_cached: count('free_cached'),
  shared: document.querySelectorAll('#blockmap .cell.shared').length,
  shared_title: shared ? shared.title : null,
  running: Number(document.getElementById('fig-running').textContent),
  gen_total: Number(document.getElementById('fig-gen-total').textContent),
  prompt_total: Number(document.getElementById('fig-prompt-total').textContent),
  status: document.getElementById('status').textContent,
};
"""


@pytest.mark.slow
def test_dashboard_page_in_headless_chromium(key_server, tmp_path):
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    user_data_dir = tempfile.mkdtemp(prefix="pagedllm-chromium-")
    driver = make_driver(user_data_dir)
    try:
        driver.get(key_server.url + "/dashboard")
        # The page asks for the API key once, then polls with it as a Bearer header.
        alert = WebDriverWait(driver, 30).until(expected_conditions.alert_is_present())
        alert.send_keys(API_KEY)
        alert.accept()
        WebDriverWait(driver, 60).until(lambda d: d.execute_script(DOM_COUNTS)["status"].startswith("live"))
        before = driver.execute_script(DOM_COUNTS)
        assert before["cells"] == get_state(key_server).json()["kv"]["num_blocks"]
        assert driver.execute_script("return sessionStorage.getItem('pagedllm-api-key')") == API_KEY

        client = openai.OpenAI(base_url=key_server.base_url, api_key=API_KEY, max_retries=0, timeout=300)
        errors: list[BaseException] = []

        def run(**kwargs) -> None:
            try:
                client.completions.create(model=MODEL, temperature=1.0, seed=0,
                                          extra_body={"ignore_eos": True}, **kwargs)
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)

        # n = 3 forks one prompt (shared blocks); two more prompts share its long prefix.
        jobs = [dict(prompt=SHARED_PREFIX + "Tell me a story.", n=3, max_tokens=48),
                dict(prompt=SHARED_PREFIX + "Describe the sea.", max_tokens=40),
                dict(prompt=SHARED_PREFIX + "Describe a forest.", max_tokens=40)]
        threads = [threading.Thread(target=run, kwargs=job) for job in jobs]
        for t in threads:
            t.start()
            time.sleep(0.5)

        seen = {"in_use": 0, "shared": 0, "running": 0}
        shared_title = None
        screenshot = tmp_path / "dashboard.png"
        while any(t.is_alive() for t in threads):
            counts = driver.execute_script(DOM_COUNTS)
            for k in seen:
                seen[k] = max(seen[k], counts[k])
            if counts["shared"] and counts["in_use"] and shared_title is None:
                shared_title = counts["shared_title"]
                driver.save_screenshot(str(screenshot))  # the page under load
            time.sleep(0.2)
        for t in threads:
            t.join()
        assert not errors, errors
        wait_all_blocks_free(key_server)
        time.sleep(1.0)  # a few polls of the page
        after = driver.execute_script(DOM_COUNTS)
        if shared_title is None:
            driver.save_screenshot(str(screenshot))
        print(f"\ndashboard screenshot: {screenshot}")
    finally:
        driver.quit()
        shutil.rmtree(user_data_dir, ignore_errors=True)

    assert seen["in_use"] > 0 and seen["running"] >= 1, seen
    assert seen["shared"] > 0, f"no shared block was ever shown: {seen}"
    # Hover text of a shared block names its owner, one of the running sequences.
    assert shared_title is not None and "(shared)" in shared_title and "owner " in shared_title, shared_title
    assert after["free_cached"] > 0 and after["in_use"] == 0, after
    # Counters moved by at least what the requests produced: 3 * 48 + 2 * 40 tokens.
    assert after["gen_total"] - before["gen_total"] >= 3 * 48 + 2 * 40, (before, after)
    assert after["prompt_total"] - before["prompt_total"] >= 3 * 200, (before, after)
    assert Path(screenshot).stat().st_size > 10_000
