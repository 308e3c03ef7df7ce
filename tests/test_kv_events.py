"""KV events over ZMQ in vLLM's wire format: live subscription, replay, the ``pagedkv events``
command, and ``pagedkv serve`` end to end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import msgspec
import pytest
import zmq

from pagedkv.core.event_transport import (
    KVEventSubscriber,
    ZmqEventPublisher,
    seq_bytes,
)
from pagedkv.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from pagedkv.engine.config import EngineConfig
from pagedkv.entrypoints.cli.serve import BackgroundServer
from pagedkv.entrypoints.openai.api_server import KVEventsOptions, create_app

BLOCK = 16
NUM_BLOCKS = 24  # small: a few distinct prompts force evictions (BlockRemoved)
PROMPT = (
    "In a paged KV cache every sequence owns a table of fixed-size blocks; full blocks are "
    "hashed so that a later request with the same prefix can reuse them without recomputing."
)


@pytest.fixture(scope="module")
def server():
    app = create_app(
        EngineConfig(num_kv_blocks=NUM_BLOCKS, max_num_seqs=4, max_model_len=256),
        kv_events=KVEventsOptions("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_steps=1000),
    )
    with BackgroundServer(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def publisher(server):
    return server.app.state.pagedkv.kv_event_publisher


@pytest.fixture(scope="module")
def device_medium(server) -> str:
    """The medium device-cache events must report: where the engine's KV cache lives."""
    return "CPU" if server.app.state.pagedkv.async_llm.engine.device.type == "cpu" else "GPU"


@pytest.fixture(scope="module")
def tokenizer(server):
    return server.app.state.pagedkv.async_llm.tokenizer


def complete(server, prompt, max_tokens: int = 2) -> dict:
    r = httpx.post(
        server.url + "/v1/completions",
        timeout=60,
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    return r.json()


def drain(sub: KVEventSubscriber, until, timeout: float = 20.0) -> list[tuple[int, KVEventBatch]]:
    got = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        item = sub.recv(timeout=0.2)
        if item is not None:
            got.append(item)
            if until(got):
                return got
    raise AssertionError(f"timed out; received {len(got)} batches")


def stored(batches) -> list[BlockStored]:
    return [e for _, b in batches for e in b.events if isinstance(e, BlockStored)]


@pytest.mark.slow
def test_subscriber_receives_block_stored_and_replays_from_zero(
    server, publisher, tokenizer, device_medium
):
    ids = tokenizer.encode(PROMPT)
    assert len(ids) >= 2 * BLOCK
    with KVEventSubscriber(publisher.endpoint, publisher.replay_endpoint) as sub:
        time.sleep(0.3)  # PUB/SUB: let the subscription reach the publisher first
        complete(server, PROMPT)
        got = drain(sub, lambda g: sum(len(e.block_hashes) for e in stored(g)) >= len(ids) // BLOCK)
        events = stored(got)
        first = events[0]
        assert (
            first.parent_block_hash is None
            and first.block_size == BLOCK
            and first.medium == device_medium
        )
        assert first.token_ids[:BLOCK] == ids[:BLOCK]
        tokens = [t for e in events for t in e.token_ids]
        assert tokens[: len(ids) // BLOCK * BLOCK] == ids[: len(ids) // BLOCK * BLOCK]
        hashes = [h for e in events for h in e.block_hashes]
        assert len(hashes) == len(set(hashes)) and all(isinstance(h, (bytes, int)) for h in hashes)
        for prev, e in zip(events, events[1:]):  # chained: each batch continues the previous one
            assert e.parent_block_hash == prev.block_hashes[-1]
        seqs = [s for s, _ in got]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))

        replay = sub.replay(0)
        assert [s for s, _ in replay] == list(range(publisher.next_seq))
        assert {s: b for s, b in replay if s in seqs} == dict(got)
        assert sub.replay(seqs[-1])[0][0] == seqs[-1]
        assert sub.replay(10**9) == []


def test_wire_format_is_vllms(server, publisher):
    """Raw ZMQ: ``(topic, 8-byte big-endian seq, msgpack [ts, [events], dp_rank])`` on PUB and
    the ROUTER replay answering ``(b"", topic, seq, payload)``... then ``seq == -1``."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.endpoint)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(publisher.replay_endpoint)
    try:
        time.sleep(0.3)
        complete(
            server,
            "A different prompt, long enough to fill one whole block of sixteen tokens or more.",
        )
        assert sub.poll(20_000)
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"" and len(seq) == 8
        ts, events, dp_rank = msgspec.msgpack.decode(payload)
        assert isinstance(ts, float) and abs(ts - time.time()) < 60 and dp_rank is None
        assert events and all(
            isinstance(e, dict) and e["type"] in ("BlockStored", "BlockRemoved") for e in events
        )
        s = next(e for e in events if e["type"] == "BlockStored")
        assert {"block_hashes", "parent_block_hash", "token_ids", "block_size", "medium"} <= set(s)

        dealer.send_multipart([b"", seq])
        frames = []
        while True:
            assert dealer.poll(10_000)
            f = dealer.recv_multipart()
            frames.append(f)
            if int.from_bytes(f[2], "big", signed=True) == -1:
                break
        assert frames[0] == [b"", b"", seq, payload]
        assert frames[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
        seqs = [int.from_bytes(f[2], "big") for f in frames[:-1]]
        assert seqs == list(
            range(int.from_bytes(seq, "big"), int.from_bytes(seq, "big") + len(seqs))
        )
    finally:
        sub.close(0)
        dealer.close(0)
        ctx.term()


@pytest.mark.slow
def test_evictions_and_reset_publish_removed_and_cleared(server, publisher, device_medium):
    with KVEventSubscriber(publisher.endpoint) as sub:
        time.sleep(0.3)
        for i in range(6):  # 6 distinct 3-block prompts overflow a 23-block pool
            complete(server, f"Prompt number {i}: " + "lorem ipsum dolor sit amet " * 6)
        got = drain(sub, lambda g: any(isinstance(e, BlockRemoved) for _, b in g for e in b.events))
        removed = [e for _, b in got for e in b.events if isinstance(e, BlockRemoved)]
        assert removed[0].medium == device_medium and removed[0].block_hashes
        r = httpx.post(server.url + "/reset_prefix_cache", timeout=30)
        assert r.status_code == 200 and r.json() == {"success": True}
        got = drain(
            sub, lambda g: any(isinstance(e, AllBlocksCleared) for _, b in g for e in b.events)
        )
        assert isinstance(got[-1][1].events[-1], AllBlocksCleared)


@pytest.mark.slow
def test_events_cli_prints_json_lines_with_seq(server, publisher):
    complete(server, PROMPT + " Once more.")
    n = publisher.next_seq
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv.entrypoints.cli",
            "events",
            "--endpoint",
            publisher.endpoint,
            "--replay-endpoint",
            publisher.replay_endpoint,
            "--from-seq",
            "0",
            "--idle-timeout",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    assert lines and {x["seq"] for x in lines} == set(range(n))
    assert lines[0]["seq"] == 0 and lines[0]["type"] == "BlockStored"
    assert all(set(x) >= {"seq", "ts", "type"} for x in lines)
    first = lines[0]
    assert first["block_size"] == BLOCK and isinstance(first["block_hashes"][0], str)  # hex


def test_publisher_buffer_is_bounded_and_replay_starts_at_the_oldest():
    pub = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_steps=3)
    try:
        with KVEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
            for i in range(5):
                pub.publish([BlockRemoved(block_hashes=[i], medium="GPU")])
            deadline = time.monotonic() + 10
            while pub.next_seq < 5 and time.monotonic() < deadline:
                time.sleep(0.01)
            replay = sub.replay(0)
            assert [s for s, _ in replay] == [2, 3, 4]
            assert [b.events[0].block_hashes for _, b in replay] == [[2], [3], [4]]
    finally:
        pub.shutdown()
    assert seq_bytes(-1) == b"\xff" * 8 and seq_bytes(1) == b"\x00" * 7 + b"\x01"


@pytest.mark.slow  # a CLI subprocess: torch import + model load
def test_serve_command_end_to_end(tmp_path):
    """``pagedkv serve`` in a subprocess with events on free ports, ``pagedkv events`` against it."""
    bad = subprocess.run(
        [sys.executable, "-m", "pagedkv.entrypoints.cli", "serve", "--block-size", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "block_size" in bad.stderr and "Traceback" not in bad.stderr

    cmd = [
        sys.executable,
        "-m",
        "pagedkv.entrypoints.cli",
        "serve",
        "--port",
        "0",
        "--num-kv-blocks",
        "64",
        "--max-model-len",
        "256",
        "--enable-kv-cache-events",
        "--kv-events-endpoint",
        "tcp://127.0.0.1:0",
        "--kv-events-replay-endpoint",
        "tcp://127.0.0.1:0",
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        url = endpoint = replay = None
        deadline = time.monotonic() + 180
        lines = []
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "kv events on" in line:
                parts = line.split()
                endpoint, replay = parts[parts.index("on") + 1], parts[-1].rstrip(")")
            if "listening on" in line:
                url = line.split()[-1]
        assert url and endpoint and replay, "".join(lines)
        r = httpx.post(
            url + "/v1/completions", timeout=60, json={"prompt": PROMPT, "max_tokens": 2}
        )
        assert r.status_code == 200
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "pagedkv.entrypoints.cli",
                "events",
                "--endpoint",
                endpoint,
                "--replay-endpoint",
                replay,
                "--count",
                "1",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0, res.stderr
        (line,) = res.stdout.splitlines()
        event = json.loads(line)
        assert (
            event["seq"] == 0
            and event["type"] == "BlockStored"
            and event["parent_block_hash"] is None
        )
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait(10)
    assert rc == 0
