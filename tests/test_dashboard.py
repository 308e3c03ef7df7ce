"""The live KV-cache dashboard: its JSON state (block map, per-block details, counts, requests,
latencies, tiers), the metrics of offload tiers, and the page itself in headless Chromium at
1,400 px, screenshotted while requests run.

The server has the default model's default pool (1,456 blocks: 1 GiB of float32 KV) and real
CPU, disk and (when ``redis-server`` is installed) Redis tiers; the Redis server has no
``maxmemory``, so its tier is unbounded. The screenshot goes to the test's tmp dir, to
``tests/artifacts/dashboard.png`` (git-ignored) and to ``/tmp/pagedkv-dashboard.png``.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from redis_server import REDIS_SERVER, RedisServer, free_port
from server_utils import client as http_client
from server_utils import running_server

from pagedkv import LLM
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.stats import KVConnectorStats, SchedulerStats, TierStats
from pagedkv.entrypoints.dashboard import dashboard_state, kv_transfer_state
from pagedkv.kv_transfer.stats import KVTransferStats

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
STABLE_SCREENSHOT = Path(tempfile.gettempdir()) / "pagedkv-dashboard.png"
NUM_BLOCKS = 1456  # what `pagedkv serve` allocates by default (1 GiB, float32)
SHARED_PREFIX = (
    "System: you are a storyteller who writes vivid, concise fables about animals, "
    "machines and the weather. Keep every sentence short. Story: "
)


@pytest.fixture(scope="module")
def redis():
    """A real redis-server without maxmemory (an unbounded tier); None when not installed."""
    if REDIS_SERVER is None:
        yield None
        return
    srv = RedisServer(maxmemory="0").start()
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture(scope="module")
def tier_names(redis):
    return {"cpu", "disk", "redis"} if redis is not None else {"cpu", "disk"}


@pytest.fixture(scope="module")
def server(redis, tmp_path_factory):
    # Real offload tiers, so the tier panel has something to show.
    spec = f"cpu:16MiB,disk:{tmp_path_factory.mktemp('kv-disk')}:64MiB"
    if redis is not None:
        spec += f",{redis.url}/0"
    with running_server(
        EngineConfig(num_kv_blocks=NUM_BLOCKS, max_num_seqs=16, max_model_len=512, kv_offload=spec)
    ) as srv:
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


@pytest.mark.slow
def test_state_shape_and_block_map(http, tier_names):
    st = http.get("/dashboard/state").json()
    assert (
        st["num_blocks"] == NUM_BLOCKS
        and len(st["blocks"]) == NUM_BLOCKS
        and st["block_size"] == 16
    )
    assert st["blocks"][0] == "n" and set(st["blocks"][1:]) <= set("fcus")
    assert sum(st["counts"].values()) == NUM_BLOCKS - 1
    for key in (
        "usage",
        "prefix_cache",
        "num_running",
        "num_waiting",
        "num_preemptions",
        "running",
        "waiting",
        "tiers",
        "model",
        "healthy",
        "generation_tokens",
        "latency",
        "ref_cnt",
        "hashes",
        "owners",
        "owner_ids",
    ):
        assert key in st
    assert len(st["ref_cnt"]) == NUM_BLOCKS and st["owners"] == {} and st["owner_ids"] == []
    assert set(st["tiers"]) == tier_names and st["healthy"] is True
    assert st["tiers"]["cpu"]["capacity_bytes"] > 0 and st["tiers"]["cpu"]["medium"] == "CPU"
    assert st["tiers"]["disk"]["capacity_bytes"] == 64 << 20
    page = http.get("/dashboard")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "/state" in page.text and "<canvas" in page.text


def test_root_redirects_to_the_dashboard(http):
    r = http.get("/", follow_redirects=False)
    assert r.status_code in (302, 303, 307) and r.headers["location"] == "/dashboard"
    assert "<canvas" in http.get("/", follow_redirects=True).text


def test_redis_tier_without_maxmemory_reports_unbounded_capacity(server, http, redis):
    if redis is None:
        pytest.skip("redis-server binary not found (apt-get install -y redis-server)")
    deadline = time.monotonic() + 20  # the tier reads INFO memory on an I/O thread
    while time.monotonic() < deadline:
        tier = http.get("/dashboard/state").json()["tiers"]["redis"]
        if tier["capacity_unbounded"]:
            break
        time.sleep(0.2)
    assert (
        tier["capacity_unbounded"] is True
        and tier["capacity_bytes"] == 0
        and tier["usage_bytes"] > 0
    )
    line = next(
        x
        for x in http.get("/metrics").text.splitlines()
        if x.startswith("pagedkv:offload_capacity_bytes{") and 'tier="redis"' in x
    )
    assert line.endswith(" +Inf"), line


@pytest.mark.slow
def test_state_shows_shared_in_use_and_cached_blocks(server, http):
    # n=3 samples fork from one prefill: their full prompt blocks are shared (ref_cnt 3).
    payload = dict(
        prompt=SHARED_PREFIX + "the fox and the lighthouse.",
        n=3,
        max_tokens=48,
        ignore_eos=True,
        temperature=0.9,
        seed=1,
    )
    client, cm, lines = stream_until_first_chunk(server, payload)
    try:
        st = http.get("/dashboard/state").json()
        assert st["counts"]["shared"] >= 2, st["counts"]  # the prompt's full blocks
        assert st["counts"]["used"] >= 3  # each sample's own last block
        assert st["num_running"] == 3 and st["usage"] > 0
        assert {r["id"].split("#")[0] for r in st["running"]} == {
            st["running"][0]["id"].split("#")[0]
        }
        assert all(r["blocks"] >= 3 for r in st["running"])
        # Per-block details: the owners of every held block are its block tables (ref_cnt),
        # a shared block is owned by all three samples, and full prompt blocks have a hash.
        rid = st["running"][0]["id"].split("#")[0]
        assert sorted(st["owner_ids"]) == sorted([rid, f"{rid}#1", f"{rid}#2"])
        held = [i for i, ch in enumerate(st["blocks"]) if ch in "us"]
        assert held and all(st["ref_cnt"][i] == len(st["owners"][str(i)]) for i in held)
        shared = [i for i in held if st["blocks"][i] == "s"]
        assert all(len(st["owners"][str(i)]) == 3 and str(i) in st["hashes"] for i in shared)
        assert all(len(h) == 16 and int(h, 16) >= 0 for h in st["hashes"].values())
        assert all(st["ref_cnt"][i] == 0 for i, ch in enumerate(st["blocks"]) if ch in "fcn")
        # The first token's latency is in the dashboard's window (the last 30 s) ...
        assert st["latency"]["ttft_count"] >= 1 and st["latency"]["ttft_p50"] > 0
        for _ in lines:  # drain to the end
            pass
        # ... and so are the gaps between the last tokens.
        lat = http.get("/dashboard/state").json()["latency"]
        assert lat["itl_count"] >= 1 and 0 < lat["itl_p50"] <= lat["itl_p99"]
    finally:
        cm.__exit__(None, None, None)
        client.close()
    st = http.get("/dashboard/state").json()
    assert st["counts"]["used"] == 0 and st["counts"]["shared"] == 0 and st["counts"]["cached"] >= 2
    assert "c" in st["blocks"] and st["num_running"] == 0 and st["owners"] == {}


# Tier counters the real tiers cannot show on demand (a Redis tier that is down).
GIVEN_TIERS = [
    TierStats(
        "cpu",
        "CPU",
        capacity_bytes=4 << 30,
        usage_bytes=1 << 30,
        hits=30,
        misses=10,
        bytes_read=123456,
        bytes_written=654321,
    ),
    TierStats("redis", "REMOTE", capacity_bytes=8 << 30, misses=5, healthy=False),
]


def test_offload_tiers_appear_in_state_and_metrics(server, http, tier_names):
    engine = server.app.state.pagedkv.async_llm.engine
    real_make_stats = engine.make_stats

    def make_stats() -> SchedulerStats:
        """The engine's own snapshot with `GIVEN_TIERS` in place of its tiers' counters."""
        stats = real_make_stats()
        stats.kv_connector_stats = KVConnectorStats(tiers=[replace(t) for t in GIVEN_TIERS])
        return stats

    engine.make_stats = make_stats  # an instance attribute: `del` brings the method back
    try:
        st = http.get("/dashboard/state").json()  # a command: refreshes the stats snapshot too
        assert (
            st["tiers"]["cpu"]["usage_bytes"] == 1 << 30
            and st["tiers"]["redis"]["healthy"] is False
        )
        metrics = http.get("/metrics").text
        assert (
            'pagedkv:offload_usage_bytes{medium="CPU",model_name="SmolLM2-135M-Instruct",tier="cpu"} 1.073741824e+09'
            in metrics
        )
        assert (
            'pagedkv:offload_hits_total{medium="CPU",model_name="SmolLM2-135M-Instruct",tier="cpu"} 30.0'
            in metrics
        )
        assert (
            'pagedkv:offload_healthy{medium="REMOTE",model_name="SmolLM2-135M-Instruct",tier="redis"} 0.0'
            in metrics
        )
        assert (
            "pagedkv:offload_bytes_written_total" in metrics
            and "pagedkv:offload_capacity_bytes" in metrics
        )
    finally:
        del engine.make_stats
    # Back to the engine's own (real) tiers: a request of its own (the test may run alone) has
    # the CPU tier store its blocks.
    r = http.post(
        "/v1/completions", json={"prompt": "Offload me: " + "tier " * 40, "max_tokens": 2}
    )
    assert r.status_code == 200, r.text
    st = http.get("/dashboard/state").json()
    assert set(st["tiers"]) == tier_names and st["tiers"]["cpu"]["bytes_written"] > 0
    metrics = http.get("/metrics").text
    fake_down = 'pagedkv:offload_healthy{medium="REMOTE",model_name="SmolLM2-135M-Instruct",tier="redis"} 0.0'
    assert 'tier="cpu"' in metrics and fake_down not in metrics


# ---- the page in a real browser --------------------------------------------------------------------


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture()
def browser():
    webdriver = pytest.importorskip("selenium.webdriver")
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip(
            "needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver)"
        )
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="pagedkv-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--window-size=1400,1000",
    ):
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


HELD_PROMPT = (
    "Notes of a lighthouse keeper, written every evening in a green notebook: the wind, the "
    "ships that passed, the colour of the sea, and the birds that rested on the railing. "
)
CHARTS = ("chart-kv", "chart-tput", "chart-ttft", "chart-itl", "chart-req")
P50_RGB = "59,130,246"  # --cached: the p50 lines (and cached blocks)


def open_held_stream(server) -> tuple[httpx.Client, object, object, str]:
    """A long streaming completion with a prompt of its own (its blocks have ref_cnt 1): returns
    once it runs, with its line iterator (dropping it would close the stream: an abort) and
    its request id."""
    client = httpx.Client(base_url=server.url, timeout=120)
    cm = client.stream(
        "POST",
        "/v1/completions",
        json=dict(prompt=HELD_PROMPT, max_tokens=380, ignore_eos=True, temperature=0, stream=True),
    )
    resp = cm.__enter__()
    assert resp.status_code == 200
    lines = resp.iter_lines()
    for line in lines:
        if line.startswith("data: {"):
            return client, cm, lines, json.loads(line[6:])["id"]
    raise AssertionError("no chunk")


def hover_block_of(browser, request_id: str) -> int:
    """Move the mouse over a hashed block that ``request_id`` owns; returns the block id."""
    from selenium.webdriver.common.action_chains import ActionChains

    block = wait_js(
        browser,
        f"""(() => {{
        const st = window.__pagedkv.lastState; const k = st.owner_ids.indexOf({json.dumps(request_id)});
        if (k < 0) return null;
        for (const [b, os] of Object.entries(st.owners)) if (os.includes(k) && st.hashes[b]) return +b;
        return null; }})()""",
        30,
        "a hashed block of the held request",
    )
    x, y, w, h = browser.execute_script(f"""
        const g = window.__pagedkv.mapGeom, i = {block}, r = document.getElementById('map').getBoundingClientRect();
        return [g.gutter + (i % g.cols) * g.cell + g.cell / 2, Math.floor(i / g.cols) * g.cell + g.cell / 2,
                r.width, r.height];""")
    canvas = browser.find_element("id", "map")
    ActionChains(browser).move_to_element_with_offset(
        canvas, int(x - w / 2), int(y - h / 2)
    ).perform()
    return block


def canvas_colours(browser, canvas_id: str) -> set[str]:
    return set(
        browser.execute_script(f"""
        const cv = document.getElementById('{canvas_id}'); const ctx = cv.getContext('2d');
        const d = ctx.getImageData(0, 0, cv.width, cv.height).data; const seen = {{}};
        for (let i = 0; i < d.length; i += 4) seen[d[i] + ',' + d[i+1] + ',' + d[i+2]] = 1;
        return Object.keys(seen);""")
    )


@pytest.mark.slow
def test_dashboard_page_updates_live_in_chromium(server, browser, tmp_path, redis, tier_names):
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
                    ths = [
                        threading.Thread(
                            target=c.post,
                            args=("/v1/completions",),
                            kwargs=dict(
                                json=dict(
                                    prompt=SHARED_PREFIX + f"tale number {i}-{j}.",
                                    n=2,
                                    max_tokens=40,
                                    ignore_eos=True,
                                    temperature=0.8,
                                    seed=i * 10 + j,
                                )
                            ),
                        )
                        for j in range(3)
                    ]
                    for t in ths:
                        t.start()
                    for t in ths:
                        t.join(120)
        except BaseException as e:
            errors.append(e)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    held = None
    try:
        # The page saw blocks in use, shared blocks and cached blocks while the requests ran.
        wait_js(
            browser,
            "window.__pagedkv.maxInUse > 0 && window.__pagedkv.maxShared > 0",
            60,
            "in-use blocks",
        )
        wait_js(
            browser,
            "window.__pagedkv.lastState && window.__pagedkv.lastState.num_running > 0 && "
            "window.__pagedkv.lastState.counts.cached > 0",
            120,
            "a live state with cached blocks",
        )
        held = open_held_stream(server)
        held_id = held[3]
        # More polls while the load goes on, so the charts have some history to draw.
        wait_js(
            browser,
            "window.__pagedkv.polls >= 14 && window.__pagedkv.lastState.num_running > 0 && "
            "window.__pagedkv.lastState.latency.itl_count > 0",
            30,
            "more polls during the load",
        )

        # Hovering a block shows its owner, ref count and hash.
        block = hover_block_of(browser, held_id)
        wait_js(
            browser,
            "!document.getElementById('tip').hidden && "
            f"document.getElementById('tip-owners').textContent.includes({json.dumps(held_id)})",
            10,
            "the block tooltip",
        )
        # Read in one script: the tooltip is redrawn at every poll.
        tip = browser.execute_script(f"""const st = window.__pagedkv.lastState,
                t = (id) => document.getElementById(id).textContent;
            return {{block: t('tip-block'), ref: t('tip-ref'), hash: t('tip-hash'), state: t('tip-state'),
                     owners: t('tip-owners'), stRef: st.ref_cnt[{block}], stHash: st.hashes['{block}']}};""")
        assert tip["block"] == f"block {block}" and tip["state"] == "in use", tip
        assert tip["ref"] == "1" == str(tip["stRef"]) and held_id in tip["owners"], tip
        assert tip["hash"] == tip["stHash"] + "…" and len(tip["stHash"]) == 16, tip

        # Every chart has a time axis (wall-clock tick labels); TTFT and ITL are drawn.
        axes = browser.execute_script("return window.__pagedkv.axes;")
        for chart in CHARTS:
            assert axes.get(chart) and all(
                re.fullmatch(r"\d\d:\d\d:\d\d", t) for t in axes[chart]
            ), (chart, axes)
        for chart in ("chart-ttft", "chart-itl"):
            assert P50_RGB in canvas_colours(browser, chart), chart  # a p50 line is drawn
        # The cards show p50 and p99 whenever the window has samples (a busy 2-core machine may
        # see no first token for a while: wait for one).
        for card in ("c-ttft", "c-itl"):
            wait_js(
                browser,
                rf"/^\d+(\.\d+)? m?s$/.test(document.getElementById('{card}').textContent) && "
                rf"/^p99 \d+(\.\d+)? m?s · \d+ /.test(document.getElementById('{card}-sub').textContent)",
                120,
                f"p50 and p99 in #{card}",
            )
        assert re.fullmatch(r"\d+\.\d", browser.find_element("id", "c-tput").text)
        assert "prompt" in browser.find_element("id", "c-tps").text

        # The block map of 1,456 blocks: cells large enough to aim at, the map in one screen.
        geom = browser.execute_script("return window.__pagedkv.mapGeom;")
        assert geom["n"] == NUM_BLOCKS and geom["cell"] >= 8 and geom["height"] <= 560, geom
        big = browser.execute_script(
            "return window.__pagedkv.layoutMap(20000, document.getElementById('map').clientWidth);"
        )
        assert big["cell"] >= 5, big

        # At 1,400 px nothing overflows sideways, the tier table included.
        widths = browser.execute_script("""const t = document.getElementById('tiers');
            return [window.innerWidth, document.documentElement.scrollWidth, t.scrollWidth, t.clientWidth];""")
        assert widths[0] >= 1380 and widths[1] <= widths[0] and widths[2] <= widths[3], widths
        tiers_text = browser.find_element("id", "tiers").text
        assert all(name in tiers_text for name in tier_names)
        if redis is not None:
            wait_js(
                browser,
                "document.getElementById('tiers').textContent.includes('no limit')",
                20,
                "the unbounded Redis tier",
            )

        # A full-page screenshot, the tooltip still shown.
        height = browser.execute_script("return document.documentElement.scrollHeight;")
        browser.set_window_size(1400, min(max(height + 140, 1000), 4000))
        time.sleep(0.3)
        shot = tmp_path / "dashboard.png"
        assert browser.save_screenshot(str(shot))
    finally:
        stop.set()
        if held is not None:
            held[1].__exit__(None, None, None)
            held[0].close()
        worker.join(180)
    assert not errors, errors
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(shot, ARTIFACTS / "dashboard.png")
    shutil.copy(shot, STABLE_SCREENSHOT)

    # Read the last state and the DOM in one script: the page keeps polling, and a poll landing
    # between two WebDriver calls would compare the DOM with an older state.
    dbg = browser.execute_script(
        "return {errors: window.__pagedkv.errors, polls: window.__pagedkv.polls, "
        "lastState: window.__pagedkv.lastState, "
        "cached: document.getElementById('n-cached').textContent};"
    )
    assert dbg["errors"] == 0 and dbg["polls"] >= 4
    # The DOM shows the numbers of the last state.
    last = dbg["lastState"]
    assert dbg["cached"].strip() == str(last["counts"]["cached"])
    assert browser.find_element("id", "model").text == "SmolLM2-135M-Instruct"
    assert "%" in browser.find_element("id", "c-hit").text
    # The block map canvas really is painted with the state colours (free, cached).
    colours = canvas_colours(browser, "map")
    assert {"43,49,64", "59,130,246"} <= colours, sorted(colours)[:20]  # free, cached
    # The tier panel shows the tiers.
    assert browser.find_element("id", "tiers-section").get_attribute("hidden") is None
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not severe, severe


# ---- a PD connector's transfers ----------------------------------------------------------------------


def nixl_config(role: str) -> dict:
    return {
        "kv_connector": "NixlConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"backend": "tcp", "side_channel_port": free_port()},
    }


def test_kv_transfer_is_null_without_a_pd_connector(http):
    # The module's server has an offloading connector (tiers) but no transfers.
    st = http.get("/dashboard/state").json()
    assert st["tiers"] and st["kv_transfer"] is None
    assert kv_transfer_state(SchedulerStats()) is None  # no connector at all
    assert 'id="kvt-section"' in http.get("/dashboard").text


def test_kv_transfer_state_of_given_counters():
    t = KVTransferStats(
        role="kv_consumer",
        num_transfers=4,
        num_blocks=9,
        num_bytes=4096,
        num_failed=1,
        num_leases_expired=2,
        transfers_in_flight=3,
        peers=["p@127.0.0.1:5000"],
    )
    assert kv_transfer_state(
        SchedulerStats(kv_connector_stats=KVConnectorStats(transfer=t))
    ) == dict(
        role="kv_consumer",
        peers=["p@127.0.0.1:5000"],
        transfers_in_flight=3,
        transfers=4,
        failures=1,
        leases_expired=2,
        bytes=4096,
    )


@pytest.mark.slow
def test_dashboard_state_of_a_real_pd_engine():
    llm = LLM(num_kv_blocks=64, max_model_len=256, kv_transfer_config=nixl_config("kv_producer"))
    try:
        st = dashboard_state(llm.llm_engine)
        assert st["kv_transfer"] == dict(
            role="kv_producer",
            peers=[],
            transfers_in_flight=0,
            transfers=0,
            failures=0,
            leases_expired=0,
            bytes=0,
        )
        assert (
            st["tiers"] is None
            and json.loads(json.dumps(st))["kv_transfer"]["role"] == "kv_producer"
        )
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.slow
def test_kv_transfer_panel_in_chromium(browser):
    """The panel shows a PD server's role and counters, and stays hidden without one (the module's
    tier server is not needed: one small server with a NixlConnector)."""
    config = EngineConfig(
        num_kv_blocks=64, max_model_len=256, kv_transfer_config=nixl_config("kv_consumer")
    )
    with running_server(config) as srv:
        browser.get(srv.url + "/dashboard")
        wait_js(browser, "window.__pagedkv && window.__pagedkv.polls >= 2", 20, "the first polls")
        assert not browser.execute_script("return document.getElementById('kvt-section').hidden;")
        assert (
            browser.execute_script("return document.getElementById('kvt-role').textContent;")
            == "kv_consumer"
        )
        text = browser.find_element("id", "kvt").text
        assert "transfers" in text and "none" in text and "0 B" in text, text
        assert browser.execute_script("return window.__pagedkv.errors;") == 0
