"""A real ``redis-server`` for tests: its own process on 127.0.0.1, a free port, no persistence.

``RedisServer`` starts it, and can ``stop()`` / ``start()`` it again on the same port (to test
outage and recovery) or ``pause()`` / ``resume()`` it (SIGSTOP: a server that accepts
connections but never answers). The ``redis_server`` fixture yields a running one per test and
always stops it; tests skip (with the reason) only when the binary is not installed.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest

REDIS_SERVER = shutil.which("redis-server")
SKIP_REASON = "redis-server binary not found (apt-get install -y redis-server)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(
        self, port: int | None = None, maxmemory: str = "256mb", policy: str = "allkeys-lru"
    ) -> None:
        if REDIS_SERVER is None:  # a test that builds its own server skips, never errors
            pytest.skip(SKIP_REASON)
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.policy = policy
        self.dir = tempfile.mkdtemp(prefix="pagedkv-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        cmd = [
            REDIS_SERVER,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.dir,
            "--maxmemory",
            self.maxmemory,
            "--maxmemory-policy",
            self.policy,
            "--protected-mode",
            "no",
            "--loglevel",
            "warning",
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited: {err}")
            if self.ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError("redis-server did not answer PING")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    if REDIS_SERVER is None:
        pytest.skip(SKIP_REASON)
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()
