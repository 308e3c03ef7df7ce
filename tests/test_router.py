"""``pagedkv router`` over three real ``pagedkv serve`` replicas on 127.0.0.1.

The replicas are processes (the default model, a small KV pool, KV events with replay on free
ports) shared by the module; the routers run in this process (`BackgroundServer`) except for
the command-line refusal test. Every prediction the router makes is checked against what the
replica reports (``usage.prompt_tokens_details.cached_tokens``). The kill/restart test stops
replica 2 and starts it again on the same port, first with another block size (refused), then
as it was (re-indexed from its replay socket).
"""

from __future__ import annotations

import json
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from pagedkv.entrypoints.cli.serve import BackgroundServer
from pagedkv.router.server import RouterOptions, create_router_app

pytestmark = pytest.mark.slow

CMD = [sys.executable, "-m", "pagedkv.entrypoints.cli"]
START_TIMEOUT = 300  # three model loads at once on a busy 2-core machine
BLOCK = 16
# Three conversations, each with its own system prompt of a few blocks.
SYSTEMS = [
    "You are a terse travel agent. You answer every question about trains, ferries and flights "
    "in Northern Europe with one sentence and never ask a follow-up question of your own.",
    "You are a patient chemistry tutor for high-school students. You explain one idea at a time, "
    "use everyday examples such as cooking or rust, and keep every answer short.",
    "You are a code reviewer who only comments on naming. For each snippet you suggest at most "
    "two better names and say in a few words why they read better than the old ones.",
]


# ---- processes ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A ``pagedkv`` subprocess whose output lines are collected on a thread."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [*CMD, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                break
            self.seen.append(line)
            m = re.search(pattern, line)
            if m:
                return m
        raise AssertionError(
            f"no {pattern!r} (rc={self.proc.poll()}); output: {''.join(self.seen[-30:])}"
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_replica(port: int, block_size: int = BLOCK) -> Proc:
    return Proc(
        [
            "serve",
            "--port",
            str(port),
            "--num-kv-blocks",
            "96",
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "4",
            "--block-size",
            str(block_size),
            "--log-stats-interval",
            "0",
            "--enable-kv-cache-events",
            "--kv-events-endpoint",
            "tcp://127.0.0.1:0",
            "--kv-events-replay-endpoint",
            "tcp://127.0.0.1:0",
        ]
    )


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[dict[str, Any]]]:
    """Three replicas started together: ``[{"url", "port", "proc"}]`` (``proc`` replaced when a
    test restarts one); every process stopped by PID at the end."""
    reps: list[dict[str, Any]] = []
    try:
        for _ in range(3):
            port = _free_port()
            reps.append(
                {"port": port, "url": f"http://127.0.0.1:{port}", "proc": start_replica(port)}
            )
        for r in reps:
            r["proc"].wait_for(r"listening on http://", START_TIMEOUT)
        yield reps
    finally:
        for r in reps:
            r["proc"].stop()


@pytest.fixture
def router(replicas) -> Iterator[Callable[..., BackgroundServer]]:
    """A factory of in-process routers over the replicas, stopped at the end of the test."""
    started: list[BackgroundServer] = []

    def make(policy: str = "kv", **kw: Any) -> BackgroundServer:
        opts = RouterOptions(
            policy=policy, health_interval=0.5, startup_timeout=30.0, timeout=120.0
        )
        app = create_router_app([r["url"] for r in replicas], opts, **kw)
        srv = BackgroundServer(app).start()
        started.append(srv)
        return srv

    try:
        yield make
    finally:
        for s in started:
            s.stop()


# ---- helpers ------------------------------------------------------------------------------------


def chat(
    url: str, messages: list[dict[str, str]], stream: bool = False
) -> tuple[str, int, str, int]:
    """One greedy chat turn through ``url``: (reply text, reported cached tokens, replica the
    router chose, predicted cached tokens)."""
    body: dict[str, Any] = {"messages": messages, "max_tokens": 6, "temperature": 0}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    if stream:
        events = [
            json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")
        ]
        text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
        usage = next(e["usage"] for e in events if e.get("usage"))
    else:
        text = r.json()["choices"][0]["message"]["content"]
        usage = r.json()["usage"]
    return (
        text,
        usage["prompt_tokens_details"]["cached_tokens"],
        r.headers["x-pagedkv-replica"],
        int(r.headers["x-pagedkv-predicted-cached-tokens"]),
    )


def state(url: str) -> dict[str, Any]:
    return httpx.get(url + "/router/state", timeout=10).json()


def replica_state(url: str, replica: str) -> dict[str, Any]:
    return next(r for r in state(url)["replicas"] if r["url"] == replica)


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def settle() -> None:
    """KV events reach the router asynchronously (milliseconds): before a turn that must hit the
    blocks the previous turn's last decode steps stored, let them arrive."""
    time.sleep(0.3)


def reset_all(replicas: list[dict[str, Any]]) -> None:
    for r in replicas:
        assert httpx.post(r["url"] + "/reset_prefix_cache", timeout=30).status_code == 200


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        float(m.group(1))
        for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    )


# ---- tests --------------------------------------------------------------------------------------


def test_shared_prefix_conversations_stay_with_their_replica(replicas, router) -> None:
    reset_all(replicas)
    srv = router("kv")
    convs = [[{"role": "system", "content": s}] for s in SYSTEMS]
    home: list[str] = []
    for conv in convs:  # turn 1: nothing cached anywhere, spread by load
        conv.append({"role": "user", "content": "Hello."})
        text, cached, rep, predicted = chat(srv.url, conv)
        assert cached == predicted == 0
        conv.append({"role": "assistant", "content": text})
        home.append(rep)
    assert len(set(home)) == 3  # a cold start spreads: each conversation on its own replica
    wait_until(
        lambda: all(r["indexed_blocks"] > 0 for r in state(srv.url)["replicas"]), 10, "the events"
    )
    for turn in range(2):  # later turns: back to the replica holding the conversation
        for i, conv in enumerate(convs):
            conv.append({"role": "user", "content": f"And question {turn + 2}?"})
            text, cached, rep, predicted = chat(srv.url, conv, stream=(turn == 1))
            assert rep == home[i]
            assert predicted == cached and cached >= 3 * BLOCK  # the system prompt at least
            conv.append({"role": "assistant", "content": text})
            settle()
    decisions = state(srv.url)["decisions"]
    assert [d["reason"] for d in decisions[3:]] == ["kv_hit"] * 6
    assert all(d["predicted_cached_tokens"] == d["reported_cached_tokens"] for d in decisions)
    assert metric(srv.url, "pagedkv_router_predictions_total") == 9
    assert metric(srv.url, 'pagedkv_router_predictions_total{outcome="exact"}') == 9
    assert metric(srv.url, "pagedkv_router_index_blocks") == state(srv.url)["index_blocks"] > 0


def test_round_robin_ignores_the_cache(replicas, router) -> None:
    reset_all(replicas)
    srv = router("round-robin")
    conv = [{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": "Hi."}]
    reps = [chat(srv.url, conv)[2] for _ in range(3)]
    assert sorted(reps) == sorted(r["url"] for r in replicas)
    assert {d["reason"] for d in state(srv.url)["decisions"]} == {"round_robin"}


def test_reset_prefix_cache_empties_the_replicas_index(replicas, router) -> None:
    reset_all(replicas)
    srv = router("kv")
    conv = [
        {"role": "system", "content": SYSTEMS[1]},
        {"role": "user", "content": "Why does iron rust?"},
    ]
    _, _, rep, _ = chat(srv.url, conv)
    wait_until(lambda: replica_state(srv.url, rep)["indexed_blocks"] >= 3, 10, "BlockStored")
    assert httpx.post(rep + "/reset_prefix_cache", timeout=30).status_code == 200
    wait_until(lambda: replica_state(srv.url, rep)["indexed_blocks"] == 0, 10, "AllBlocksCleared")
    _, cached, _, predicted = chat(srv.url, conv)
    assert cached == predicted == 0


def test_prefill_decode_pools_score_the_prefill_instance(replicas, router) -> None:
    """Replicas 0 and 1 are the prefill pool, replica 2 the decode pool (no KV connector: the
    decoder computes the prompt itself, so answers equal a direct request's)."""
    reset_all(replicas)
    opts = RouterOptions(policy="kv", health_interval=0.5, timeout=120.0)
    srv = BackgroundServer(
        create_router_app([r["url"] for r in replicas[:2]], opts, decode=[replicas[2]["url"]])
    ).start()
    try:
        conv = [{"role": "system", "content": SYSTEMS[2]}, {"role": "user", "content": "x = 1"}]
        direct = httpx.post(
            replicas[2]["url"] + "/v1/chat/completions",
            timeout=120,
            json={"messages": conv, "max_tokens": 6, "temperature": 0},
        ).json()
        text, _, first, predicted = chat(srv.url, conv)
        assert text == direct["choices"][0]["message"]["content"] and predicted == 0
        wait_until(
            lambda: replica_state(srv.url, first)["indexed_blocks"] >= 3, 10, "the prefill's events"
        )
        _, _, again, predicted = chat(srv.url, conv)
        assert again == first and predicted >= 3 * BLOCK
        assert replicas[2]["url"] not in {r["url"] for r in state(srv.url)["replicas"]}
    finally:
        srv.stop()


def test_killed_replica_is_dropped_refused_when_changed_and_reindexed(replicas, router) -> None:
    reset_all(replicas)
    srv = router("kv")
    victim = replicas[2]
    conv = [
        {"role": "system", "content": SYSTEMS[0]},
        {"role": "user", "content": "Oslo to Bergen?"},
    ]
    # Warm the victim directly: it alone holds the conversation, so the router must pick it.
    httpx.post(
        victim["url"] + "/v1/chat/completions",
        timeout=120,
        json={"messages": conv, "max_tokens": 1, "temperature": 0},
    )
    wait_until(
        lambda: replica_state(srv.url, victim["url"])["indexed_blocks"] >= 3,
        10,
        "the victim's events",
    )
    assert chat(srv.url, conv)[2] == victim["url"]

    victim["proc"].stop()  # killed: its next request goes elsewhere and its blocks are forgotten
    _, cached, rep, predicted = chat(srv.url, conv)
    assert rep != victim["url"] and cached == predicted == 0
    wait_until(lambda: not replica_state(srv.url, victim["url"])["up"], 10, "the victim down")
    # take_down marks it down first (no more routing), then stops its feed, then forgets its blocks.
    wait_until(
        lambda: replica_state(srv.url, victim["url"])["indexed_blocks"] == 0,
        10,
        "the victim forgotten",
    )

    # Back with another block size: answering, but refused (its hashes would not match ours).
    victim["proc"] = start_replica(victim["port"], block_size=32)
    victim["proc"].wait_for(r"listening on http://", START_TIMEOUT)
    wait_until(
        lambda: replica_state(srv.url, victim["url"])["refused"] is not None, 15, "the refusal"
    )
    vs = replica_state(srv.url, victim["url"])
    assert not vs["up"] and "block_size: 32 != 16" in vs["refused"]
    assert metric(srv.url, f'pagedkv_router_replica_refused{{replica="{victim["url"]}"}}') == 1
    # The command refuses it at start, with the field that differs.
    out = subprocess.run(
        [
            *CMD,
            "router",
            "--replica",
            replicas[0]["url"],
            victim["url"],
            "--port",
            "0",
            "--startup-timeout",
            "10",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        out.returncode == 2 and "block_size: 32 != 16" in out.stderr and victim["url"] in out.stderr
    )

    # Back as it was: re-indexed from its replay socket, in rotation again.
    victim["proc"].stop()
    victim["proc"] = start_replica(victim["port"])
    victim["proc"].wait_for(r"listening on http://", START_TIMEOUT)
    other = [
        {"role": "system", "content": SYSTEMS[1]},
        {"role": "user", "content": "What is an acid?"},
    ]
    httpx.post(
        victim["url"] + "/v1/chat/completions",
        timeout=120,
        json={"messages": other, "max_tokens": 1, "temperature": 0},
    )
    wait_until(lambda: replica_state(srv.url, victim["url"])["up"], 15, "the victim up")
    wait_until(
        lambda: replica_state(srv.url, victim["url"])["indexed_blocks"] >= 3, 10, "the re-index"
    )
    assert replica_state(srv.url, victim["url"])["refused"] is None
    _, cached, rep, predicted = chat(srv.url, other)
    assert rep == victim["url"] and cached == predicted >= 3 * BLOCK
    assert (
        metric(
            srv.url, f'pagedkv_router_kv_resyncs_total{{replica="{victim["url"]}",why="connect"}}'
        )
        == 2
    )
