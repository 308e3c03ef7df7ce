"""The live KV-cache dashboard: its JSON state (block map, counts, requests, tiers), the metrics
of offload tiers, and the page itself in headless Chromium, screenshotted while requests run.

The screenshot goes to the test's tmp dir and to ``tests/artifacts/dashboard.png`` (git-ignored).
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from server_utils import client as http_client
from server_utils import running_server

from pagedkv.engine.config import EngineConfig

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
NUM_BLOCKS = 160
SHARED_PREFIX = ("System: you are a storyteller who writes vivid, concise fables about animals, "
                 "machines and the weather. Keep every sentence short. Story: ")


@pytest.fixture(scope="module")
def server():
    # A real CPU offload tier, so the tier panel has something to show.
    with running_server(EngineConfig(num_kv_blocks=NUM_BLOCKS, max_num_seqs=16, max_model_len=512,
                                     kv_offload="cpu:16MiB")) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with http_client(server) as c:
        yield c


def stream_until_first_chunk(server, payload: dict) -> tuple[httpx.Client, object, object]:
    """Open a streaming completion and return once its first chunk arrived (the request runs)."""
    client = httpx.Client(base_url=server.url, timeout=120)
    cm = client.stream("POST", "/v1/completions", json={**payload, "stream": True})
    resp = cm.__enter__()
    assert resp.status_code == 200
    lines = resp.iter_lines()
    for line in lines:
        if line.startswith("data: {"):
            break
    return client, cm, lines


def test_state_shape_and_block_map(http):
    st = http.get("/dashboard/state").json()
    assert st["num_blocks"] == NUM_BLOCKS and len(st["blocks"]) == NUM_BLOCKS and st["block_size"] == 16
    assert st["blocks"][0] == "n" and set(st["blocks"][1:]) <= set("fcus")
    assert sum(st["counts"].values()) == NUM_BLOCKS - 1
    for key in ("usage", "prefix_cache", "num_running", "num_waiting", "num_preemptions", "running",
                "waiting", "tiers", "model", "healthy", "generation_tokens"):
        assert key in st
    assert set(st["tiers"]) == {"cpu"} and st["healthy"] is True
    assert st["tiers"]["cpu"]["capacity_bytes"] > 0 and st["tiers"]["cpu"]["medium"] == "CPU"
    page = http.get("/dashboard")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "/state" in page.text and "<canvas" in page.text


def test_state_shows_shared_in_use_and_cached_blocks(server, http):
    # n=3 samples fork from one prefill: their full prompt blocks are shared (ref_cnt 3).
    payload = dict(prompt=SHARED_PREFIX + "the fox and the lighthouse.", n=3, max_tokens=48,
                   ignore_eos=True, temperature=0.9, seed=1)
    client, cm, lines = stream_until_first_chunk(server, payload)
    try:
        st = http.get("/dashboard/state").json()
        assert st["counts"]["shared"] >= 2, st["counts"]  # the prompt's full blocks
        assert st["counts"]["used"] >= 3  # each sample's own last block
        assert st["num_running"] == 3 and st["usage"] > 0
        assert {r["id"].split("#")[0] for r in st["running"]} == {st["running"][0]["id"].split("#")[0]}
        assert all(r["blocks"] >= 3 for r in st["running"])
        for _ in lines:  # drain to the end
            pass
    finally:
        cm.__exit__(None, None, None)
        client.close()
    st = http.get("/dashboard/state").json()
    assert st["counts"]["used"] == 0 and st["counts"]["shared"] == 0 and st["counts"]["cached"] >= 2
    assert "c" in st["blocks"] and st["num_running"] == 0


@dataclass
class FakeTierStats:
    name: str
    medium: str
    capacity_bytes: int
    usage_bytes: int
    hits: int
    misses: int
    bytes_read: int
    bytes_written: int
    healthy: bool


class FakeOffloadManager:
    def get_stats(self):
        return {"cpu": FakeTierStats("cpu", "CPU", 4 << 30, 1 << 30, 30, 10, 123456, 654321, True),
                "redis": FakeTierStats("redis", "REMOTE", 8 << 30, 0, 0, 5, 0, 0, False)}


def test_offload_tiers_appear_in_state_and_metrics(server, http):
    engine = server.app.state.pagedkv.async_llm.engine
    engine.offload_manager = FakeOffloadManager()
    try:
        st = http.get("/dashboard/state").json()  # a command: refreshes the stats snapshot too
        assert st["tiers"]["cpu"]["usage_bytes"] == 1 << 30 and st["tiers"]["redis"]["healthy"] is False
        metrics = http.get("/metrics").text
        assert 'pagedkv:offload_usage_bytes{medium="CPU",model_name="SmolLM2-135M-Instruct",tier="cpu"} 1.073741824e+09' in metrics
        assert 'pagedkv:offload_hits_total{medium="CPU",model_name="SmolLM2-135M-Instruct",tier="cpu"} 30.0' in metrics
        assert 'pagedkv:offload_healthy{medium="REMOTE",model_name="SmolLM2-135M-Instruct",tier="redis"} 0.0' in metrics
        assert "pagedkv:offload_bytes_written_total" in metrics and "pagedkv:offload_capacity_bytes" in metrics
    finally:
        del engine.offload_manager
    # Back to the engine's own (real) CPU tier, which has stored the blocks of earlier requests.
    st = http.get("/dashboard/state").json()
    assert set(st["tiers"]) == {"cpu"} and st["tiers"]["cpu"]["bytes_written"] > 0
    metrics = http.get("/metrics").text
    assert 'tier="cpu"' in metrics and 'tier="redis"' not in metrics


# ---- the page in a real browser --------------------------------------------------------------------


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture()
def browser():
    webdriver = pytest.importorskip("selenium.webdriver")
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver)")
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="pagedkv-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1400,1000"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(10)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def wait_js(driver, expr: str, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(f"return {expr};")
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what} ({expr})")


def test_dashboard_page_updates_live_in_chromium(server, browser, tmp_path):
    browser.get(server.url + "/dashboard")
    wait_js(browser, "window.__pagedkv && window.__pagedkv.polls >= 2", 20, "the first polls")

    stop = threading.Event()
    errors: list[BaseException] = []

    def load() -> None:
        """Streams with a shared prefix (prefix hits), n=2 (shared blocks), until told to stop."""
        try:
            with httpx.Client(base_url=server.url, timeout=120) as c:
                for i in range(40):
                    if stop.is_set():
                        return
                    ths = [threading.Thread(target=c.post, args=("/v1/completions",), kwargs=dict(json=dict(
                        prompt=SHARED_PREFIX + f"tale number {i}-{j}.", n=2, max_tokens=40, ignore_eos=True,
                        temperature=0.8, seed=i * 10 + j))) for j in range(3)]
                    for t in ths:
                        t.start()
                    for t in ths:
                        t.join(120)
        except BaseException as e:
            errors.append(e)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    try:
        # The page saw blocks in use, shared blocks and cached blocks while the requests ran.
        wait_js(browser, "window.__pagedkv.maxInUse > 0 && window.__pagedkv.maxShared > 0", 60, "in-use blocks")
        wait_js(browser, "window.__pagedkv.lastState && window.__pagedkv.lastState.num_running > 0 && "
                         "window.__pagedkv.lastState.counts.cached > 0", 60, "a live state with cached blocks")
        # More polls while the load goes on, so the charts have some history to draw.
        wait_js(browser, "window.__pagedkv.polls >= 14 && window.__pagedkv.lastState.num_running > 0", 30,
                "more polls during the load")
        shot = tmp_path / "dashboard.png"
        assert browser.save_screenshot(str(shot))
    finally:
        stop.set()
        worker.join(180)
    assert not errors, errors
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(shot, ARTIFACTS / "dashboard.png")

    dbg = browser.execute_script("return window.__pagedkv;")
    assert dbg["errors"] == 0 and dbg["polls"] >= 4
    # The DOM shows the numbers of the last state.
    last = dbg["lastState"]
    assert browser.find_element("id", "n-cached").text == str(last["counts"]["cached"])
    assert browser.find_element("id", "model").text == "SmolLM2-135M-Instruct"
    assert "%" in browser.find_element("id", "c-hit").text
    # The block map canvas really is painted with the state colours (free, cached, in use).
    colours = browser.execute_script("""
        const cv = document.getElementById('map'); const ctx = cv.getContext('2d');
        const d = ctx.getImageData(0, 0, cv.width, cv.height).data; const seen = {};
        for (let i = 0; i < d.length; i += 4) seen[d[i] + ',' + d[i+1] + ',' + d[i+2]] = 1;
        return Object.keys(seen);""")
    assert {"43,49,64", "59,130,246"} <= set(colours), colours[:20]  # free, cached
    # The tier panel shows the CPU tier.
    assert browser.find_element("id", "tiers-section").get_attribute("hidden") is None
    assert "cpu" in browser.find_element("id", "tiers").text
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not severe, severe
