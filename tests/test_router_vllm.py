"""The router in front of vLLM replicas, tested against what vLLM itself produces.

Fixtures (tests/fixtures/vllm/, written by ``make_fixtures.py`` with vLLM 0.32's own code, never
pagedkv's): KV event batches encoded by vLLM's msgspec structs over block hashes from vLLM's
``hash_block_tokens`` (three algorithm/seed pairs), and a real vLLM CPU server's ``/metrics``,
``/v1/models``, completion answer and the event payloads it published for one prompt.

The end-to-end test fronts a real pagedkv server and a vLLM replica whose HTTP answers and KV
event bytes are those recorded from the real vLLM server, replayed over a real HTTP server and a
real ZMQ PUB/ROUTER pair (vLLM's wire framing, the payload bytes untouched): the router reads
its configuration the vLLM way, mirrors its cache from vLLM's bytes, and routes the prompt vLLM
cached to it.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from server_utils import running_server

from pagedkv.core.event_transport import ZmqEventPublisher
from pagedkv.core.events import decode_batch
from pagedkv.core.hashing import (
    DEFAULT_HASH_ALGO,
    DEFAULT_NONE_HASH_SEED,
    get_hash_fn_by_name,
    init_none_hash,
)
from pagedkv.engine.config import EngineConfig
from pagedkv.entrypoints.cli.serve import BackgroundServer
from pagedkv.entrypoints.openai.api_server import KVEventsOptions
from pagedkv.router.hashing import prompt_block_hashes
from pagedkv.router.index import PrefixIndex
from pagedkv.router.replica import ReplicaSpec
from pagedkv.router.server import RouterOptions, create_router_app
from pagedkv.router.tokens import PromptTokenizer
from pagedkv.router.vllm_replica import apply_flags, cache_config_labels, config_from_vllm

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "vllm"
EVENTS = json.loads((FIXTURES / "kv_events.json").read_text())
SERVER = json.loads((FIXTURES / "server.json").read_text())
BLOCK = EVENTS["block_size"]


def payloads(b64s: list[str]) -> list[bytes]:
    return [base64.b64decode(p) for p in b64s]


# ---- vLLM's event encoding ---------------------------------------------------------------------


@pytest.mark.parametrize("case", EVENTS["cases"], ids=lambda c: c["hash_algo"])
def test_vllm_encoded_events_index_the_blocks_the_router_hashes(case):
    """vLLM's structs (newer fields included: locality, ownership, session_id, extra_keys) decode,
    and vLLM's block hashes are the router's for the same tokens, algorithm and seed."""
    ids = EVENTS["prompt_token_ids"]
    seed = case["pythonhashseed"] or DEFAULT_NONE_HASH_SEED
    mine = prompt_block_hashes(ids, BLOCK, case["hash_algo"], seed)
    assert mine == case["block_hashes_low64"]
    index = PrefixIndex()
    stored_int, stored_bytes, removed, cleared = (
        decode_batch(p) for p in payloads(case["batches"])
    )
    assert stored_bytes.data_parallel_rank == 0
    index.apply_batch("vllm", stored_int.events)
    assert index.match(mine)["vllm"].device_blocks == 2
    index.apply_batch("vllm", stored_bytes.events)  # bytes hashes: the same keys
    assert index.match(mine)["vllm"].device_blocks == 3 == index.num_blocks("vllm")
    index.apply_batch("vllm", removed.events)
    assert index.match(mine)["vllm"].device_blocks == 2
    index.apply_batch("vllm", cleared.events)
    assert index.num_blocks("vllm") == 0 and index.match(mine) == {}


def test_the_router_tokenizes_a_completion_as_vllm_did(gguf_path):
    tok = PromptTokenizer.from_path(str(gguf_path))
    info = tok.prompt("/v1/completions", {"prompt": EVENTS["prompt"]})
    assert info is not None and info.token_ids == EVENTS["prompt_token_ids"]


# ---- a real vLLM server's answers ----------------------------------------------------------------


def test_config_from_a_real_vllm_servers_metrics_and_models():
    spec = ReplicaSpec.parse("http://127.0.0.1:8001,events=tcp://127.0.0.1:5557")
    labels = cache_config_labels(SERVER["metrics"])
    assert labels is not None and labels["block_size"] == str(BLOCK)
    cfg = config_from_vllm(SERVER["metrics"], SERVER["models"], spec)
    assert (cfg.kind, cfg.block_size, cfg.hash_algo, cfg.hash_seed) == (
        "vllm",
        BLOCK,
        "sha256",
        None,
    )
    assert cfg.events == "tcp://127.0.0.1:5557" and cfg.replay is None
    assert cfg.model_path == SERVER["models"]["data"][0]["root"] and cfg.num_blocks > 0
    # The seed: the replicas' PYTHONHASHSEED from --hash-seed, else vLLM's fixed sha256 seed.
    assert apply_flags(cfg, None, None, "0").hash_seed == "0"
    assert apply_flags(cfg, None, None, None).hash_seed == DEFAULT_NONE_HASH_SEED
    with pytest.raises(ValueError, match="block_size=128 but --block-size is 16"):
        apply_flags(cfg, 16, None, None)
    with pytest.raises(ValueError, match="--prefix-caching-hash-algo is 'sha256_cbor'"):
        apply_flags(cfg, None, "sha256_cbor", None)
    xx = config_from_vllm(
        SERVER["metrics"].replace(
            'prefix_caching_hash_algo="sha256"', 'prefix_caching_hash_algo="xxhash"'
        ),
        SERVER["models"],
        spec,
    )
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        apply_flags(xx, None, None, None)
    with pytest.raises(ValueError, match="neither a pagedkv nor a vLLM server"):
        config_from_vllm("# nothing\n", SERVER["models"], spec)


def test_a_real_vllm_servers_published_events_match_the_router(gguf_path):
    """What vLLM published for the recorded completion: its blocks, hashed with
    PYTHONHASHSEED=0 (how it ran), are the router's hashes of the same prompt."""
    assert SERVER["env"]["PYTHONHASHSEED"] == "0"
    tok = PromptTokenizer.from_path(str(gguf_path))
    ids = tok.prompt("/v1/completions", SERVER["completion_request"]).token_ids
    mine = prompt_block_hashes(ids, BLOCK, "sha256", "0")
    index = PrefixIndex()
    for p in payloads([x["payload"] for x in SERVER["published"]]):
        index.apply_batch("vllm", decode_batch(p).events)
    assert len(mine) >= 3 and index.match(mine)["vllm"].device_blocks == len(mine)
    assert SERVER["completion_response"]["usage"]["prompt_tokens"] == len(ids)


# ---- end to end: one router, a pagedkv replica and a (recorded) vLLM replica --------------------


class _RecordedVLLM(BaseHTTPRequestHandler):
    """Answers as the recorded vLLM server did: /health, /metrics, /v1/models, and the recorded
    completion for the recorded prompt; no /v1/kv_cache_config (404), as vLLM."""

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/health":
            self._send(200, b"", "text/plain")
        elif self.path == "/metrics":
            self._send(200, SERVER["metrics"].encode(), "text/plain; version=0.0.4")
        elif self.path == "/v1/models":
            self._send(200, json.dumps(SERVER["models"]).encode(), "application/json")
        else:
            self._send(404, b'{"detail":"Not Found"}', "application/json")

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/completions" and body.get("prompt") == SERVER["prompt"]:
            self._send(200, json.dumps(SERVER["completion_response"]).encode(), "application/json")
        else:
            self._send(404, b'{"detail":"Not Found"}', "application/json")

    def _send(self, status: int, data: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def recorded_vllm():
    http = ThreadingHTTPServer(("127.0.0.1", 0), _RecordedVLLM)
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    pub = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    for x in SERVER["published"]:  # vLLM's bytes, numbered and buffered for replay
        pub.publish_payload(base64.b64decode(x["payload"]))
    try:
        yield f"http://127.0.0.1:{http.server_address[1]}", pub
    finally:
        pub.shutdown()
        http.shutdown()
        http.server_close()


@pytest.fixture
def pythonhashseed_0(monkeypatch):
    """PYTHONHASHSEED=0 for this process's block hashes (as the recorded vLLM server ran)."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    init_none_hash(get_hash_fn_by_name("sha256"))
    yield
    monkeypatch.undo()
    init_none_hash(get_hash_fn_by_name(DEFAULT_HASH_ALGO))


def test_one_router_fronts_pagedkv_and_vllm_replicas(recorded_vllm, pythonhashseed_0, gguf_path):
    vllm_url, pub = recorded_vllm
    # The pagedkv replica hashes as the vLLM one ran: block 128, sha256, PYTHONHASHSEED=0.
    cfg = EngineConfig(
        num_kv_blocks=64,
        block_size=BLOCK,
        max_model_len=1024,
        prefix_caching_hash_algo="sha256",
        enable_kv_cache_events=True,
    )
    events = KVEventsOptions("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    with running_server(cfg, kv_events=events) as pkv:
        replicas = [
            pkv.url,
            f"{vllm_url},events={pub.endpoint},replay={pub.replay_endpoint}",
        ]
        options = RouterOptions(hash_seed="0", tokenizer=str(gguf_path), startup_timeout=30)
        app = create_router_app(replicas, options)
        state = app.state.router
        kinds = {u: r.config.kind for u, r in state.replicas.items()}
        assert kinds == {pkv.url: "pagedkv", vllm_url: "vllm"}
        assert state.index.num_blocks(vllm_url) >= 3  # mirrored from vLLM's own bytes
        with BackgroundServer(app) as router, httpx.Client(base_url=router.url, timeout=120) as c:
            r = c.post("/v1/completions", json=SERVER["completion_request"])
            assert r.status_code == 200, r.text
            assert r.headers["x-pagedkv-replica"] == vllm_url
            assert r.headers["x-pagedkv-route-reason"] == "kv_hit"
            assert int(r.headers["x-pagedkv-predicted-cached-tokens"]) >= 3 * BLOCK
            assert r.json() == SERVER["completion_response"]
            # A prompt the pagedkv replica served (directly) is routed to it, by its events.
            other = {"prompt": "Blocks of sixteen tokens each. " * 40, "max_tokens": 2}
            assert httpx.post(pkv.url + "/v1/completions", json=other, timeout=120).is_success
            deadline = time.monotonic() + 20
            hashes = prompt_block_hashes(
                state.tokenizer.prompt("/v1/completions", other).token_ids, BLOCK, "sha256", "0"
            )
            while pkv.url not in state.index.match(hashes) and time.monotonic() < deadline:
                time.sleep(0.05)
            r = c.post("/v1/completions", json=other)
            assert r.status_code == 200, r.text
            assert r.headers["x-pagedkv-replica"] == pkv.url
            assert r.headers["x-pagedkv-route-reason"] == "kv_hit"
            listing = c.get("/router/state").json()
            assert {x["kind"] for x in listing["replicas"]} == {"pagedkv", "vllm"}
            assert listing["hash_seed"] == "0"


def test_a_vllm_replica_that_disagrees_is_refused(recorded_vllm, gguf_path):
    vllm_url, pub = recorded_vllm
    from pagedkv.router.state import RouterConfigError

    spec = f"{vllm_url},events={pub.endpoint},replay={pub.replay_endpoint}"
    with pytest.raises(RouterConfigError, match="block_size=128 but --block-size is 16"):
        create_router_app([spec], RouterOptions(block_size=16, tokenizer=str(gguf_path)))
    with pytest.raises(RouterConfigError, match="KV event endpoints"):
        create_router_app([vllm_url], RouterOptions(tokenizer=str(gguf_path), startup_timeout=5))


def test_the_command_passes_the_flags_and_refuses_a_bad_block_size(
    capsys, recorded_vllm, gguf_path
):
    from pagedkv.entrypoints.cli import main

    vllm_url, pub = recorded_vllm
    assert main(["router", "--replica", vllm_url, "--block-size", "0"]) == 2
    assert "invalid --block-size 0" in capsys.readouterr().err
    spec = f"{vllm_url},events={pub.endpoint},replay={pub.replay_endpoint}"
    argv = ["router", "--replica", spec, "--tokenizer", str(gguf_path), "--port", "0"]
    assert main([*argv, "--prefix-caching-hash-algo", "sha256_cbor"]) == 2
    assert "--prefix-caching-hash-algo is 'sha256_cbor'" in capsys.readouterr().err
