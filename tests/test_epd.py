"""Encoder-prefill-decode disaggregation (issue 38, part 3): encoder outputs cached on an
encoder instance and read by prefill/decode instances over both transfer backends; a dead or
refusing producer leaves the image to local encoding with the same tokens; the producer's
reservation is released by the consumer's read; `pagedkv proxy --encoder` routes image
requests encoder → prefill → decode over HTTP (real servers, real sockets)."""

from __future__ import annotations

import base64
import io
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis_server import free_port
from test_dashboard import browser  # noqa: F401  (a fixture; skips without chromium)
from test_multimodal import IMAGE_TOKEN, _write_tokenizer, expand, hf_run, image, llava  # noqa: F401

from pagedkv import LLM, SamplingParams
from pagedkv.transfer import nixl_import_error

GREEDY = SamplingParams(max_tokens=8, temperature=0)
PROMPT = [1, 5, 9, IMAGE_TOKEN, 17, 33, 40]


def backends() -> list[str]:
    return ["tcp"] if nixl_import_error() else ["nixl", "tcp"]


def ec(role: str, backend: str, **extra: Any) -> dict[str, Any]:
    return {"ec_role": role, "ec_connector_extra_config": {"backend": backend, **extra}}


def engine(path: Path, **kw: Any) -> LLM:
    return LLM(
        model=str(path), max_model_len=192, num_kv_blocks=64, max_num_batched_tokens=16, **kw
    )


def request(img: Any, params: dict[str, Any] | None = None) -> dict[str, Any]:
    req: dict[str, Any] = {"prompt_token_ids": PROMPT, "multi_modal_data": {"image": img}}
    if params is not None:
        req["ec_transfer_params"] = params
    return req


def tokens(llm: LLM, req: dict[str, Any]) -> list[int]:
    return llm.generate([req], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("backend", backends())
def test_consumer_reads_the_encoders_outputs_and_never_encodes(llava, backend: str) -> None:
    path = llava[2]
    want = hf_run(llava, expand(PROMPT), [image(31)])[0]
    producer = engine(path, ec_transfer_config=ec("ec_producer", backend))
    consumer = engine(path, ec_transfer_config=ec("ec_consumer", backend))
    try:
        pe = producer.llm_engine
        _, items = pe.process_images(request(image(31)), PROMPT)
        params = pe.encode_images(items)
        key = bytes.fromhex(params["items"][0])
        assert key in pe.ec.producer.store._pins  # reserved until the consumer reads it
        assert tokens(consumer, request(image(31), params)) == want
        ce = consumer.llm_engine
        assert ce.runner.encoder_cache.stats.misses == 0  # no local encoding
        assert ce.ec.stats.fetched == 1 and ce.ec.stats.bytes_received == ce.ec.item_bytes
        assert key not in pe.ec.producer.store._pins  # the read released the reservation
    finally:
        producer.llm_engine.shutdown()
        consumer.llm_engine.shutdown()


def test_dead_or_refusing_producer_means_local_encoding(llava, tmp_path: Path) -> None:
    path = llava[2]
    want = hf_run(llava, expand(PROMPT), [image(32)])[0]
    consumer = engine(path, ec_transfer_config=ec("ec_consumer", "tcp", timeout_s=1.0))
    other = tmp_path / "copy"  # the same weights under another identity: a refused handshake
    shutil.copytree(path, other)
    producer = engine(other, ec_transfer_config=ec("ec_producer", "tcp"))
    try:
        dead = {"ec_host": "127.0.0.1", "ec_port": free_port(), "items": ["00" * 32]}
        assert tokens(consumer, request(image(32), dead)) == want
        _, items = producer.llm_engine.process_images(request(image(32)), PROMPT)
        params = producer.llm_engine.encode_images(items)
        consumer.llm_engine.runner.encoder_cache.entries.clear()
        assert tokens(consumer, request(image(32), params)) == want
        st = consumer.llm_engine.ec.stats
        assert st.fetched == 0 and st.fetch_failures == 1  # the dead one lists no such image
        assert consumer.llm_engine.runner.encoder_cache.stats.misses == 2  # encoded here
    finally:
        producer.llm_engine.shutdown()
        consumer.llm_engine.shutdown()


def test_bad_configs_are_refused(llava) -> None:
    with pytest.raises(ValueError, match="ec_role"):
        engine(llava[2], ec_transfer_config={"ec_role": "encoder"})
    with pytest.raises(ValueError, match="unknown keys"):
        engine(llava[2], ec_transfer_config={"ec_role": "ec_producer", "port": 1})
    with pytest.raises(ValueError, match="needs a vision-language model"):
        LLM(max_model_len=256, ec_transfer_config={"ec_role": "ec_consumer"})
    consumer = engine(llava[2])  # no EC config: params are ignored, the image encoded here
    assert tokens(consumer, request(image(33), {"ec_host": "x", "ec_port": 1, "items": []}))


# ---- over HTTP: pagedkv proxy --encoder -------------------------------------------------------


@pytest.fixture(scope="module")
def epd(llava) -> Iterator[dict[str, Any]]:
    """An encoder, a prefill and a decode server (in this process, real sockets) and a proxy
    over them; everything stopped at the end."""
    from pagedkv.engine.config import EngineConfig
    from pagedkv.entrypoints.cli.serve import BackgroundServer
    from pagedkv.entrypoints.openai.api_server import create_app
    from pagedkv.entrypoints.proxy import create_proxy_app

    path = llava[2]
    _write_tokenizer(path)

    def config(**kw: Any) -> EngineConfig:
        return EngineConfig(model=str(path), max_model_len=192, num_kv_blocks=64, **kw)

    def pd(role: str) -> dict[str, Any]:
        return {
            "kv_connector": "NixlConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"side_channel_port": free_port(), "backend": "tcp"},
        }

    servers = {
        "encoder": BackgroundServer(
            create_app(config(ec_transfer_config=ec("ec_producer", "tcp")))
        ),
        "prefill": BackgroundServer(
            create_app(
                config(
                    ec_transfer_config=ec("ec_consumer", "tcp"),
                    kv_transfer_config=pd("kv_producer"),
                )
            )
        ),
        "decode": BackgroundServer(
            create_app(
                config(
                    ec_transfer_config=ec("ec_consumer", "tcp"),
                    kv_transfer_config=pd("kv_consumer"),
                )
            )
        ),
    }
    started = []
    try:
        for s in servers.values():
            s.__enter__()
            started.append(s)
        proxy = BackgroundServer(
            create_proxy_app(
                [servers["prefill"].url],
                [servers["decode"].url],
                cooldown=30.0,
                timeout=60.0,
                retry_window=1.0,
                encoder=[servers["encoder"].url],
            )
        )
        proxy.__enter__()
        started.append(proxy)
        yield {**servers, "proxy": proxy}
    finally:
        for s in reversed(started):
            s.__exit__(None, None, None)


def chat_body(img: Any) -> dict[str, Any]:
    from PIL import Image

    png = io.BytesIO()
    Image.fromarray(img).save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "w7 w9"}]
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "temperature": 0,
        "return_token_ids": True,
    }


CHAT_IDS = [3, 5, IMAGE_TOKEN, 7, 9, 4, 5]  # "user : <image> w7 w9 assistant :"


def test_proxy_routes_images_encoder_prefill_decode(llava, epd) -> None:
    want = hf_run(llava, expand(CHAT_IDS), [image(41)], 6)[0]
    with httpx.Client(base_url=epd["proxy"].url, timeout=60) as http:
        r = http.post("/v1/chat/completions", json=chat_body(image(41)))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want
        # Text only: no encoder stage.
        r = http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "w7 w9"}], "max_tokens": 2},
        )
        assert r.status_code == 200, r.text
    state = epd["proxy"].app.state.proxy
    assert [u for _, u in state.encoded] == [epd["encoder"].url]
    prefill = epd["prefill"].app.state.pagedkv.async_llm.engine
    assert prefill.ec.stats.fetched == 1 and prefill.runner.encoder_cache.stats.misses == 0
    # A bad image: the encoder's 400, as it is.
    body = chat_body(image(42))
    body["messages"][0]["content"][0]["image_url"]["url"] = "data:image/png;base64,AAAA"
    with httpx.Client(base_url=epd["proxy"].url, timeout=60) as http:
        r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_killed_encoder_falls_back_to_local_encoding(llava, epd) -> None:
    want = hf_run(llava, expand(CHAT_IDS), [image(43)], 6)[0]
    epd["encoder"].__exit__(None, None, None)  # the encoder instance dies
    with httpx.Client(base_url=epd["proxy"].url, timeout=60) as http:
        r = http.post("/v1/chat/completions", json=chat_body(image(43)))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want
    state = epd["proxy"].app.state.proxy
    assert state.encoded[-1][1] is None  # no encoder served it: the prefill instance encoded


def test_encoder_cache_and_ec_transfer_on_metrics_and_dashboard(llava, epd, browser) -> None:
    """After the proxied image request: the prefill instance's /metrics carries the encoder
    cache and EPD counters; its dashboard shows both in headless Chromium."""
    from test_dashboard import wait_js

    url = epd["prefill"].url
    with httpx.Client(base_url=url, timeout=60) as http:
        text = http.get("/metrics").text
        state = http.get("/dashboard/state").json()["encoder_cache"]
    assert "pagedkv:encoder_cache_budget_tokens" in text
    fetched = [ln for ln in text.splitlines() if ln.startswith("pagedkv:ec_transfer_fetched_total")]
    assert fetched and float(fetched[0].split()[-1]) >= 1
    assert state["ec_role"] == "ec_consumer" and state["ec_fetched"] >= 1
    assert state["usage_tokens"] <= state["budget_tokens"]
    browser.get(url + "/dashboard")
    wait_js(browser, "!document.getElementById('enc-section').hidden", 30, "the encoder section")
    section = browser.find_element("id", "enc-section").text
    assert "ec_consumer" in section and "fetched" in section
