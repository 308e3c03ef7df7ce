"""Server processes for the serving benchmarks (`disagg`, `router`): ``pagedkv`` CLI commands
started as subprocesses on free ports, optionally pinned to CPUs, stopped by PID.

A benchmark of the server, the proxy or the router runs them as processes (never imports them:
those sit above `pagedkv.bench` in the layers), as a user would.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CLI = [sys.executable, "-m", "pagedkv.entrypoints.cli"]
START_TIMEOUT_S = 300.0  # model load on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class Instance:
    """A ``pagedkv`` server process on a fixed port (so a restart keeps its URL), optionally
    pinned to ``cores``; its output is appended to ``log_path``."""

    name: str
    argv: list[str]
    port: int
    log_path: Path
    cores: list[int] | None = None
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = list(self.argv)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.cores:
            cmd = ["taskset", "-c", ",".join(map(str, self.cores)), *cmd]  # execs: same PID
            env["OMP_NUM_THREADS"] = str(len(self.cores))  # one compute thread per pinned core
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until ``/health`` answers 200; RuntimeError (with the log's tail) if the process
        exits or the deadline passes."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                break
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        tail = self.log_path.read_text(errors="replace")[-2000:]
        rc = self.proc and self.proc.poll()
        raise RuntimeError(f"{self.name} did not become ready (rc={rc}):\n{tail}")

    def kill(self) -> None:
        """SIGKILL, by PID."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 30 s; by PID, only this process."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


class Cluster:
    """Instances started together and all stopped on exit (context manager)."""

    def __init__(self, instances: list[Instance]) -> None:
        self.instances = instances

    def __enter__(self) -> Cluster:
        try:
            for inst in self.instances:
                inst.start()
            for inst in self.instances:
                inst.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for inst in self.instances:
            inst.stop()


def pin_cores(n: int, what: str = "instances") -> tuple[list[list[int] | None], str | None]:
    """Process i on CPU i mod (usable CPUs), one compute thread each (`Instance.start`), and a
    note when that is impossible or some share a core. For the kill test's ``[prefill0,
    prefill1, decode0, decode1]`` on 2 CPUs: one producer and one consumer per core. Unpinned,
    every instance would run one OpenMP thread per core, and several instances' spinning thread
    teams on two cores slow each other (and every restart's model load) several times over."""
    if shutil.which("taskset") is None:
        return [None] * n, f"taskset not found: {what} unpinned"
    cpus = sorted(os.sched_getaffinity(0))
    note = None if len(cpus) >= n else f"{len(cpus)} CPUs for {n} {what}: some share a core"
    return [[cpus[i % len(cpus)]] for i in range(n)], note


def _sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # unwinds through every `finally`: all instances stopped by PID


def stop_on_sigterm() -> None:
    """Make SIGTERM unwind like Ctrl-C, so every process a benchmark started is stopped by PID
    (`Cluster`'s exit). Only the main thread may set a handler: elsewhere this does nothing."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _sigterm)
