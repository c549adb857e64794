"""`pagedllm serve --kv-cache-backend vattention`: serves completions, refuses n > 1 with a
400 in OpenAI's shape, exports the KV memory gauges, and serves the dashboard's state
(reserved and resident pages per request). Its API key comes from the environment
(PAGEDLLM_API_KEY; the --api-key flag is test_auth.py's)."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.entrypoints.test_metrics_disconnect import wait_all_blocks_free
from tests.entrypoints.utils import SMALL_SERVER_ARGS, RemoteServer, metric_value

MODEL = "SmolLM2-135M-Instruct"
ENV_KEY = "key-from-the-environment"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vattn_server():
    srv = RemoteServer(SMALL_SERVER_ARGS + ["--kv-cache-backend", "vattention"], env={"PAGEDLLM_API_KEY": ENV_KEY})
    srv.api_key = ENV_KEY  # /metrics needs it (test_metrics_disconnect.metrics)
    yield srv
    srv.stop()


def test_vattention_server(vattn_server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=vattn_server.base_url, api_key="EMPTY", max_retries=0).models.list()
    client = openai.OpenAI(base_url=vattn_server.base_url, api_key=ENV_KEY, max_retries=0, timeout=120)
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert out.usage.completion_tokens == 8
    with pytest.raises(openai.BadRequestError, match="vattention KV backend.*n > 1"):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, n=2)
    text = wait_all_blocks_free(vattn_server)
    labels = {"model_name": MODEL}
    # Deferred reclamation: the finished request's pages stay resident, holding no token.
    assert metric_value(text, "pagedllm:kv_cache_resident_bytes", labels) > 0
    assert metric_value(text, "pagedllm:kv_cache_token_bytes", labels) == 0
    assert metric_value(text, "pagedllm:kv_cache_fragmentation_ratio", labels) == 1.0
    assert httpx.get(vattn_server.url + "/health").status_code == 200


def _state(server) -> dict:
    response = httpx.get(
        server.url + "/dashboard/state", headers={"Authorization": f"Bearer {ENV_KEY}"}, timeout=60
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_dashboard_state_shows_pages_per_request(vattn_server):
    """The state works on this backend (it used to kill the engine core) and shows, for a
    running request, its slot's resident pages out of the reserved ones."""
    client = openai.OpenAI(base_url=vattn_server.base_url, api_key=ENV_KEY, max_retries=0, timeout=120)
    seen: list[dict] = []
    stream = client.completions.create(
        model=MODEL, prompt="Count slowly: one, two, three,", max_tokens=64, temperature=0,
        stream=True, extra_body={"ignore_eos": True},
    )
    done = threading.Event()

    def poll() -> None:
        while not done.is_set() and not seen:
            kv = _state(vattn_server)["kv"]
            if any(s["request"] is not None for s in kv["slots"]):
                seen.append(kv)

    poller = threading.Thread(target=poll)
    poller.start()
    num_chunks = sum(1 for _ in stream)
    done.set()
    poller.join()
    assert num_chunks > 0
    assert seen, "no snapshot showed the running request"
    kv = seen[0]
    assert kv["kind"] == "pages" and kv["page_bytes"] > 0 and kv["num_pages"] > 0
    running = [s for s in kv["slots"] if s["request"] is not None]
    assert len(running) == 1
    slot = running[0]
    assert 0 < slot["resident_pages"] <= slot["reserved_pages"]
    assert slot["num_tokens"] > 0
    # Afterwards (once the shared snapshot is fresh): no request holds a slot; deferred
    # reclamation keeps the idle slot's pages.
    deadline = time.monotonic() + 30
    kv = _state(vattn_server)["kv"]
    while any(s["request"] is not None for s in kv["slots"]):
        assert time.monotonic() < deadline, kv
        time.sleep(0.2)
        kv = _state(vattn_server)["kv"]
    assert kv["num_in_use"] == 0
    assert any(s["resident_pages"] > 0 for s in kv["slots"])
    state = _state(vattn_server)
    assert state["requests"]["running"] == 0
    # The engine core lives on: another request is served.
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens == 2


def test_dashboard_state_under_load(vattn_server):
    """/dashboard/state polled while 6 streams run: every poll answers 200, some show the
    concurrent requests each in its own slot, and every stream finishes in full (a snapshot
    that raised in the engine core used to end it)."""
    import asyncio

    client = openai.AsyncOpenAI(base_url=vattn_server.base_url, api_key=ENV_KEY, max_retries=0, timeout=120)
    headers = {"Authorization": f"Bearer {ENV_KEY}"}

    async def one(i: int) -> int:
        stream = await client.completions.create(
            model=MODEL, prompt=f"Story number {i}: once upon a time", max_tokens=48, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        return sum([len(c.choices[0].text) > 0 async for c in stream if c.choices])

    async def poll(http: httpx.AsyncClient, done: asyncio.Event) -> list[tuple[int, int]]:
        seen = []  # (status, requests holding a slot)
        while not done.is_set():
            r = await http.get(vattn_server.url + "/dashboard/state", headers=headers)
            running = sum(s["request"] is not None for s in r.json()["kv"]["slots"]) if r.status_code == 200 else -1
            seen.append((r.status_code, running))
            await asyncio.sleep(0.05)
        return seen

    async def run():
        done = asyncio.Event()
        async with httpx.AsyncClient(timeout=60) as http:
            pollers = [asyncio.create_task(poll(http, done)) for _ in range(3)]
            counts = await asyncio.gather(*(one(i) for i in range(6)))
            done.set()
            return counts, [x for p in pollers for x in await p]

    counts, seen = asyncio.run(run())
    assert all(status == 200 for status, _ in seen), seen
    assert max(running for _, running in seen) >= 2, seen
    assert all(c >= 40 for c in counts), counts  # about one non-empty chunk per token
    wait_all_blocks_free(vattn_server)


PAGES_DOM = """
const rows = document.querySelectorAll('#backend-slots > div');
return {
  status: document.getElementById('status').textContent,
  map_shown: getComputedStyle(document.getElementById('blocks')).display !== 'none',
  pages_shown: getComputedStyle(document.getElementById('backend')).display !== 'none',
  rows: rows.length,
  running_rows: [...rows].filter((r) => r.dataset.request).map((r) => r.textContent),
  units: document.getElementById('fig-blocks').textContent,
};
"""


def test_dashboard_page_draws_pages_in_headless_chromium(vattn_server):
    """The page on this backend: no block map; one bar per slot, the running request's named."""
    import shutil
    import tempfile

    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    from tests.entrypoints.test_dashboard import make_driver

    user_data_dir = tempfile.mkdtemp(prefix="pagedllm-chromium-")
    driver = make_driver(user_data_dir)
    client = openai.OpenAI(base_url=vattn_server.base_url, api_key=ENV_KEY, max_retries=0, timeout=120)
    try:
        driver.get(vattn_server.url + "/dashboard")
        alert = WebDriverWait(driver, 30).until(expected_conditions.alert_is_present())
        alert.send_keys(ENV_KEY)
        alert.accept()
        WebDriverWait(driver, 60).until(lambda d: d.execute_script(PAGES_DOM)["status"].startswith("live"))
        running: list[str] = []
        thread = threading.Thread(target=lambda: client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=96, temperature=0, extra_body={"ignore_eos": True}))
        thread.start()
        while thread.is_alive():
            dom = driver.execute_script(PAGES_DOM)
            running = running or dom["running_rows"]
            time.sleep(0.1)
        thread.join()
        time.sleep(1.0)  # a few polls after the request
        dom = driver.execute_script(PAGES_DOM)
    finally:
        driver.quit()
        shutil.rmtree(user_data_dir, ignore_errors=True)
    kv = _state(vattn_server)["kv"]
    assert dom["status"].startswith("live"), dom
    assert dom["pages_shown"] and not dom["map_shown"], dom
    assert dom["rows"] == len(kv["slots"]) > 0, (dom, kv)
    assert dom["units"].endswith(f"/ {kv['num_pages']}"), dom
    assert running and "pages resident" in running[0], running
