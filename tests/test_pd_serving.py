"""Prefill/decode disaggregation end to end: real ``pagedkv serve`` processes as producer
(``kv_producer``) and consumer (``kv_consumer``) with the `NixlConnector`, ``pagedkv proxy`` in
front.

Every answer that went ``proxy → producer → consumer`` must equal, token for token (logprobs
list the tokens), a plain colocated request sent directly to the producer; the consumer's
``/metrics`` must show the KV really moved (transfers, no failures). After every test both
instances' ``GET /debug/kv_cache`` must settle to an all-free pool with its invariants holding
(the producer frees when the consumer's notification arrives, or when a lease expires).

Faults, driven without the proxy: a producer killed (SIGKILL) between its prefill answer and the
consumer's read; a producer whose lease expires with no consumer; a consumer whose block size
differs from the producer's (the handshake refuses, the request is recomputed, its log names
``block_size``). Each answer is still exact.

Processes are started by `Cluster`, which keeps one configuration running at a time (at most
three processes), reuses it across tests that ask for the same one, and stops every process by
PID. Each process's stdout and stderr go to a log file under the module's tmp dir.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis_server import free_port

from pagedkv.transfer import nixl_import_error

pytestmark = pytest.mark.slow

CMD = [sys.executable, "-m", "pagedkv.entrypoints.cli"]
MODEL = "SmolLM2-135M-Instruct"
START_TIMEOUT_S = 240.0  # model load on a busy 2-core machine
SETTLE_TIMEOUT_S = 10.0
HTTP_TIMEOUT_S = 120.0
MAX_TOKENS = 8

# > 3 blocks of 16 tokens on its own, shared by the three chat prompts (a prefix-cache hit on
# each instance after the first).
SYSTEM = (
    "You are a careful assistant for a company that builds paged key-value caches for "
    "language model inference. Answer briefly, in one sentence, using plain words. Never "
    "invent facts; when you are unsure, say so. Prefer concrete numbers to vague claims, and "
    "do not repeat the question back to the user before answering it."
)
CHAT_QUESTIONS = ["Name a colour.", "What is a block table?", "Why share a prompt prefix?"]
PLAIN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    # return the n-th Fibonacci number\n    if n < 2:\n",
]


def chat_body(question: str) -> dict[str, Any]:
    return dict(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
    )


def completion_body(prompt: str) -> dict[str, Any]:
    return dict(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1)


# (path, body): the prompt mix every mode is checked on.
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", chat_body(q)) for q in CHAT_QUESTIONS
] + [("/v1/completions", completion_body(p)) for p in PLAIN_PROMPTS]


# ---- processes -----------------------------------------------------------------------------------


def nixl_available() -> bool:
    return nixl_import_error() is None


def serve_args(role: str, backend: str, *, block_size: int = 16, **extra: Any) -> list[str]:
    """``pagedkv serve`` arguments for a `NixlConnector` instance; ``extra`` goes into
    ``kv_connector_extra_config`` (a short handshake timeout bounds the fault tests)."""
    cfg = {
        "kv_connector": "NixlConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"backend": backend, "handshake_timeout_s": 3.0, **extra},
    }
    return [
        "serve",
        "--port",
        "0",
        "--num-kv-blocks",
        "128",
        "--max-model-len",
        "512",
        "--block-size",
        str(block_size),
        "--max-num-seqs",
        "4",
        "--log-stats-interval",
        "0",
        "--log-level",
        "info",
        "--kv-transfer-config",
        json.dumps(cfg),
        "--kv-side-channel-port",
        str(free_port()),
    ]


@dataclass(slots=True)
class Proc:
    """A started ``pagedkv`` process; its stdout and stderr go to ``log``."""

    proc: subprocess.Popen
    log: Path
    url: str = ""

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_url(self, deadline: float) -> str:
        """The URL of its ``listening on`` line; AssertionError with its log if it never comes."""
        while time.monotonic() < deadline:
            m = re.search(r"listening on (http://\S+)", self.output())
            if m:
                self.url = m.group(1)
                return self.url
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(
            f"no 'listening on' line (rc={self.proc.poll()}): {self.output()[-3000:]}"
        )

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 30 s; by PID, and only this process."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@dataclass(slots=True)
class Cluster:
    """One configuration of processes at a time: `get` reuses the running one when ``key``
    matches, else stops it and starts the new one (servers together, then the proxy)."""

    tmp: Path
    key: str | None = None
    procs: dict[str, Proc] = field(default_factory=dict)

    def get(self, key: str, servers: dict[str, list[str]], proxy: bool = False) -> dict[str, Proc]:
        if key == self.key:
            return self.procs
        self.close()
        self.key = key
        try:
            for name, args in servers.items():
                self.procs[name] = self._start(f"{key}-{name}", args)
            deadline = time.monotonic() + START_TIMEOUT_S
            for p in list(self.procs.values()):
                p.wait_url(deadline)
            if proxy:  # every "producer*" and "consumer*" process behind one proxy
                urls = {
                    role: [p.url for n, p in self.procs.items() if n.startswith(role)]
                    for role in ("producer", "consumer")
                }
                self.procs["proxy"] = self._start(
                    f"{key}-proxy",
                    [
                        "proxy",
                        "--prefill",
                        *urls["producer"],
                        "--decode",
                        *urls["consumer"],
                        "--port",
                        "0",
                        "--log-level",
                        "debug",
                    ],
                )
                self.procs["proxy"].wait_url(time.monotonic() + 60)
        except BaseException:
            self.close()
            raise
        return self.procs

    def _start(self, name: str, args: list[str]) -> Proc:
        log = self.tmp / f"{name}.log"
        with log.open("w") as f:
            proc = subprocess.Popen(
                [*CMD, *args],
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        return Proc(proc, log)

    def close(self) -> None:
        for p in self.procs.values():
            p.stop()
        self.procs.clear()
        self.key = None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("pd_serving"))
    try:
        yield c
    finally:
        c.close()


MODES = {  # mode → (backend, producer's extra config)
    "pull-tcp": ("tcp", {}),
    "pull-nixl": ("nixl", {}),
    "push-tcp": ("tcp", {"transfer_mode": "push"}),
}


@pytest.fixture(params=list(MODES))
def pd(request: pytest.FixtureRequest, cluster: Cluster) -> dict[str, Proc]:
    """Producer, consumer and proxy for one mode (kept running while tests ask for the same)."""
    backend, extra = MODES[request.param]
    if backend == "nixl" and not nixl_available():
        pytest.skip("nixl_cu12 does not import")
    return cluster.get(
        request.param,
        {
            "producer": serve_args("kv_producer", backend, **extra),
            "consumer": serve_args("kv_consumer", backend),
        },
        proxy=True,
    )


# ---- HTTP helpers --------------------------------------------------------------------------------


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + path, json=body, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


def answer(resp: dict[str, Any]) -> tuple[str, list[str], int, int]:
    """What must match: (text, tokens from logprobs, prompt_tokens, completion_tokens)."""
    choice = resp["choices"][0]
    if "message" in choice:
        text = choice["message"]["content"]
        tokens = [t["token"] for t in choice["logprobs"]["content"]]
    else:
        text, tokens = choice["text"], choice["logprobs"]["tokens"]
    return text, tokens, resp["usage"]["prompt_tokens"], resp["usage"]["completion_tokens"]


def transfer_counters(url: str) -> tuple[float, float]:
    """(transfers completed, transfers failed) from the instance's ``/metrics``."""
    text = httpx.get(url + "/metrics", timeout=30).text

    def value(name: str) -> float:
        m = re.search(rf"^\S*{name}_total(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
        assert m, f"{name}_total not in /metrics"
        return float(m.group(1))

    return value("kv_transfer_transfers"), value("kv_transfer_failures")


def kv_cache(url: str) -> dict[str, Any]:
    r = httpx.get(url + "/debug/kv_cache", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def assert_settled(*urls: str) -> None:
    """Every instance's pool is all free (the null block aside), nothing queued, invariants
    holding, within `SETTLE_TIMEOUT_S`."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    for url in urls:
        while True:
            s = kv_cache(url)
            assert s["invariants_ok"], s
            if (
                s["num_free_blocks"] == s["num_blocks"] - 1
                and s["num_running"] == s["num_waiting"] == 0
            ):
                break
            assert time.monotonic() < deadline, f"{url}: blocks leaked: {s}"
            time.sleep(0.2)


def prefill(producer: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The producer's ``kv_transfer_params`` for ``body`` (prefill only: max_tokens 1)."""
    resp = post(
        producer,
        path,
        {
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True},
        },
    )
    params = resp["kv_transfer_params"]
    assert params and params["do_remote_prefill"] and params["remote_block_ids"], resp
    return params


# ---- exactness -----------------------------------------------------------------------------------


def test_proxy_pd_streaming_equals_colocated(cluster: Cluster):
    """One streamed chat and completion through the proxy (pull over TCP): the chunks' text
    joins to the colocated answer, and the KV moved."""
    procs = cluster.get(
        "pull-tcp",
        {
            "producer": serve_args("kv_producer", "tcp"),
            "consumer": serve_args("kv_consumer", "tcp"),
        },
        proxy=True,
    )
    producer, consumer, proxy = procs["producer"].url, procs["consumer"].url, procs["proxy"].url
    done0, _ = transfer_counters(consumer)
    for path, body in (REQUESTS[0], REQUESTS[-1]):
        expected_text = answer(post(producer, path, body))[0]
        with httpx.stream(
            "POST", proxy + path, json={**body, "stream": True}, timeout=HTTP_TIMEOUT_S
        ) as r:
            assert r.status_code == 200, r.read()
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        part = (
            (lambda c: c["choices"][0]["delta"].get("content") or "")
            if "messages" in body
            else (lambda c: c["choices"][0]["text"])
        )
        assert len([c for c in chunks if c["choices"]]) > 1  # really streamed
        assert "".join(part(c) for c in chunks if c["choices"]) == expected_text
    assert transfer_counters(consumer)[0] - done0 == 2
    assert_settled(producer, consumer)


def test_proxy_pd_answers_equal_colocated(pd: dict[str, Proc]):
    """The prompt mix through ``proxy → producer → consumer`` answers exactly as a colocated
    request to the producer, and every prompt's KV moved (no failure, no recompute)."""
    producer, consumer, proxy = pd["producer"].url, pd["consumer"].url, pd["proxy"].url
    done0, failed0 = transfer_counters(consumer)
    # Disaggregated first, so the producer computes the prompts' KV for the transfer (not
    # from a colocated run's prefix cache).
    got = [answer(post(proxy, path, body)) for path, body in REQUESTS]
    done, failed = transfer_counters(consumer)
    assert (done - done0, failed - failed0) == (len(REQUESTS), 0)
    expected = [answer(post(producer, path, body)) for path, body in REQUESTS]
    assert got == expected
    assert all(tokens for _, tokens, _, _ in got)
    assert_settled(producer, consumer)


def test_two_producers_and_two_consumers_behind_one_proxy(cluster: Cluster):
    """2 + 2 instances (pull, NIXL where it imports): the proxy round-robins over both of each
    role, every answer is exact and moved its KV, and all four pools settle."""
    backend = "nixl" if nixl_available() else "tcp"
    procs = cluster.get(
        "two-by-two",
        {
            "producer0": serve_args("kv_producer", backend),
            "producer1": serve_args("kv_producer", backend),
            "consumer0": serve_args("kv_consumer", backend),
            "consumer1": serve_args("kv_consumer", backend),
        },
        proxy=True,
    )
    consumers = [procs["consumer0"].url, procs["consumer1"].url]
    before = [transfer_counters(u) for u in consumers]
    got = [answer(post(procs["proxy"].url, path, body)) for path, body in REQUESTS]
    after = [transfer_counters(u) for u in consumers]
    moved = [a[0] - b[0] for a, b in zip(after, before)]
    assert sum(moved) == len(REQUESTS) and all(m > 0 for m in moved)  # both consumers served
    assert all(a[1] == b[1] for a, b in zip(after, before))  # no failed transfer
    expected = [answer(post(procs["producer0"].url, path, body)) for path, body in REQUESTS]
    assert got == expected
    log = procs["proxy"].output()
    assert procs["producer0"].url in log and procs["producer1"].url in log  # both prefilled
    assert_settled(*(p.url for n, p in procs.items() if n != "proxy"))


# ---- faults --------------------------------------------------------------------------------------


def test_producer_killed_before_the_read_is_recomputed_exactly(cluster: Cluster):
    """SIGKILL the producer after its prefill answer, before the consumer reads: the consumer's
    handshake fails, it recomputes the prompt, and answers exactly; its pool ends all free."""
    procs = cluster.get(
        "kill",
        {
            "producer": serve_args("kv_producer", "tcp"),
            "consumer": serve_args("kv_consumer", "tcp"),
        },
    )
    producer, consumer = procs["producer"], procs["consumer"]
    path, body = REQUESTS[1]
    expected = answer(post(producer.url, path, body))  # colocated, before the kill
    params = prefill(producer.url, path, body)
    os.kill(producer.proc.pid, signal.SIGKILL)
    producer.proc.wait(30)
    _, failed0 = transfer_counters(consumer.url)
    assert answer(post(consumer.url, path, {**body, "kv_transfer_params": params})) == expected
    assert transfer_counters(consumer.url)[1] > failed0  # it did try the dead producer
    assert_settled(consumer.url)


def test_consumer_killed_mid_read_the_producer_frees_by_lease(cluster: Cluster):
    """SIGKILL the consumer right after the request was sent to it (its read queued or in
    flight): the producer never hears from it and frees the blocks when the lease expires
    (2 s); its pool settles all free."""
    procs = cluster.get(
        "kill-consumer",
        {
            "producer": serve_args("kv_producer", "tcp", kv_lease_duration=2),
            "consumer": serve_args("kv_consumer", "tcp"),
        },
    )
    producer, consumer = procs["producer"], procs["consumer"]
    path, body = REQUESTS[1]
    params = prefill(producer.url, path, body)
    assert kv_cache(producer.url)["num_free_blocks"] < kv_cache(producer.url)["num_blocks"] - 1
    req = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import httpx, json, sys; httpx.post(sys.argv[1], json=json.loads(sys.argv[2]), timeout=60)"
            ),
            consumer.url + path,
            json.dumps({**body, "kv_transfer_params": params}),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.05)  # the request is in flight
        os.kill(consumer.proc.pid, signal.SIGKILL)
        consumer.proc.wait(30)
    finally:
        req.kill()
        req.wait(10)
    assert_settled(producer.url)
    cluster.close()  # the consumer is dead: this configuration is not reusable


@pytest.fixture
def lease_pair(cluster: Cluster) -> dict[str, Proc]:
    """A producer with a 2 s lease, and a consumer whose block size (32) differs from its 16."""
    return cluster.get(
        "lease",
        {
            "producer": serve_args("kv_producer", "tcp", kv_lease_duration=2),
            "consumer": serve_args("kv_consumer", "tcp", block_size=32),
        },
    )


def test_producer_lease_expires_without_a_consumer(lease_pair: dict[str, Proc]):
    """A prefill whose consumer never comes: its blocks are held, then freed by the lease."""
    producer = lease_pair["producer"].url
    prefill(producer, *REQUESTS[0])
    held = kv_cache(producer)
    assert held["num_free_blocks"] < held["num_blocks"] - 1  # held for the consumer
    assert_settled(producer)
    assert "Releasing expired KV blocks" in lease_pair["producer"].output()


def test_block_size_mismatch_is_recomputed_exactly_and_logged(lease_pair: dict[str, Proc]):
    """A consumer with block size 32 given a block-size-16 producer's params: the handshake
    refuses (its log names ``block_size``), the prompt is recomputed, the answer is exact."""
    producer, consumer = lease_pair["producer"], lease_pair["consumer"]
    path, body = REQUESTS[2]
    expected = answer(post(producer.url, path, body))
    params = prefill(producer.url, path, body)
    assert answer(post(consumer.url, path, {**body, "kv_transfer_params": params})) == expected
    log = consumer.output()
    assert "block_size" in log, log[-3000:]
    assert_settled(consumer.url, producer.url)  # the producer's lease frees its blocks
