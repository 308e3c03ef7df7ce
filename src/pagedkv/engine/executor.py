"""`Executor`: how the engine drives its ranks (vLLM's ``distributed_executor_backend``).

* ``"uni"`` (`UniProcExecutor`): one `Worker` in the engine's process; the step is a method
  call (today's path, and the default at ``tensor_parallel_size=1``).
* ``"mp"`` (`MultiprocExecutor`): rank 0 in the engine's process (the driver), ranks
  ``1..N-1`` in worker processes on this host (spawned), joined by torch.distributed (gloo on
  CPU, NCCL on CUDA) at ``distributed_init_method`` (a free 127.0.0.1 port when not given).
  Each step the driver sends every worker the step's `ModelInput` over its pipe (one message per
  worker per step, no reply), and all ranks run the forward pass; only the driver's logits are
  sampled. With offload tiers the step also carries each rank's copies (`offload.rank_worker`)
  and the workers reply with the copies that failed, before the driver completes them.
* ``"ray"`` (`RayExecutor`, ``engine/ray_executor.py``): ranks ``1..N-1`` as Ray actors in one
  placement group, the same protocol through actor calls.

A worker that dies (killed, or an exception it reports) makes the next step raise
`WorkerDiedError`, naming the rank, its pid and how it ended; the executor then stops every
process it started. Shutdown (also when the engine is garbage-collected) stops them by pid:
a polite message first, then SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import subprocess
import sys
import time
import traceback
import weakref
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

import torch

from pagedkv.core.specs import KVCacheConfig
from pagedkv.distributed.parallel_state import get_open_port
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.model_input import ModelInput
from pagedkv.engine.model_runner import PromptLogprobsOutput
from pagedkv.engine.scheduler_output import SchedulerOutput
from pagedkv.engine.worker import Worker
from pagedkv.kv_transfer.base import KVConnectorBase, KVConnectorOutput
from pagedkv.offload.sharded import HostAttachment, RankShardInfo

logger = logging.getLogger(__name__)

# How long start-up waits for a worker to load its shard before failing the engine.
WORKER_START_TIMEOUT_S = 600.0
# How long shutdown waits for a worker to exit after each signal.
WORKER_STOP_GRACE_S = 5.0

StepResult = tuple[torch.Tensor, KVConnectorOutput | None, PromptLogprobsOutput]


class WorkerDiedError(RuntimeError):
    """A rank of the engine stopped: the engine cannot step any more."""


class Executor:
    """Drives the engine's ranks. ``driver`` is rank 0's `Worker` (in this process)."""

    driver: Worker
    _dead = False  # set once a failure stopped the workers: every later step raises

    def initialize_kv_cache(
        self, kv_cache_config: KVCacheConfig, connector: KVConnectorBase | None
    ) -> None:
        self.driver.initialize_kv_cache(kv_cache_config, connector)

    def execute_model(self, so: SchedulerOutput) -> StepResult:
        return self.driver.runner.execute_model(so)

    def _model_input(self, so: SchedulerOutput) -> ModelInput:
        """The step's `ModelInput` for every rank, with the connector's copies for ranks 1..N-1
        (`kv_work`, None without any)."""
        mi = self.driver.runner.build_model_input(so)
        mi.kv_work = _rank_work(self.driver.runner.connector, so)
        return mi

    def _attach_connector(
        self, connector: KVConnectorBase, infos: list[RankShardInfo]
    ) -> list[HostAttachment]:
        """A TP engine's connector (rank 0's cache allocated, ``infos``: every rank's shard):
        register it on the driver over the shared host buffer; each other rank's attachment."""
        set_shards = getattr(connector, "set_rank_shards", None)
        if set_shards is None:
            raise ValueError(
                f"{type(connector).__name__} does not support tensor_parallel_size > 1"
            )
        set_shards(infos)
        runner = self.driver.runner
        runner.connector = connector
        runner.register_connector()
        attach = getattr(connector, "host_attachment", None)
        return [] if attach is None else [attach(r) for r in range(1, len(infos))]

    def check_health(self) -> None:
        """Raise `WorkerDiedError` if a rank stopped."""
        if self._dead:
            raise WorkerDiedError("the engine's workers were stopped after a failure")

    def _fail(self, message: str) -> None:
        """Stop every worker, stay failed, raise `WorkerDiedError` with ``message``."""
        self.shutdown()
        self._dead = True
        raise WorkerDiedError(message)

    def kv_cache_bytes(self) -> list[int]:
        """Bytes of KV cache each rank allocated, in rank order."""
        return [self.driver.runner.kv_buffer.nbytes]

    def shutdown(self) -> None:
        """Stop every process this executor started (idempotent)."""

    @property
    def worker_pids(self) -> list[int]:
        return []


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.driver = Worker(config)


def _shares_kv(connector: KVConnectorBase | None) -> bool:
    """Whether ``connector`` moves every rank's blocks from the driver (it maps their KV
    buffers: `offload.sharded.share_kv_buffer`)."""
    return bool(getattr(connector, "needs_rank_kv_buffers", False))


def _rank_work(connector: KVConnectorBase | None, so: SchedulerOutput) -> Any:
    """The connector's copies for ranks 1..N-1 this step (`offload.rank_worker.RankKVWork`),
    or None."""
    take = getattr(connector, "take_rank_work", None)
    return None if take is None else take(so.kv_connector_metadata)


def _worker_threads(config: EngineConfig) -> int:
    """Torch threads per rank: this host's cores shared out (one per rank on 2 cores at TP=2)."""
    return max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)


def run_worker(conn: Connection, rank: int) -> None:
    """A worker process's life: receive the engine config and rendezvous, load rank ``rank``'s
    shard, say so, join the groups, then run every `ModelInput` the driver sends until it sends
    None or its connection closes."""
    try:
        config, init_method = conn.recv()
        torch.set_num_threads(_worker_threads(config))
        worker = Worker(config, rank, init_method)
        conn.send(("loaded", os.getpid()))
        worker.connect()
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # the driver is gone
                return
            if msg is None:
                return
            kind, payload = msg
            if kind == "step":
                failed = worker.execute(payload)
                if failed is not None:
                    conn.send(("kv_done", failed))
            elif kind == "init_kv":
                worker.initialize_kv_cache(payload[0], share_kv=payload[1])
                conn.send(("ready", worker.shard_info()))
            elif kind == "attach_offload":
                worker.attach_offload(payload)
                conn.send(("attached", None))
            elif kind == "kv_bytes":
                conn.send(("kv_bytes", worker.runner.kv_buffer.nbytes))
    except BaseException as e:  # report, then exit so the peers' collectives fail fast
        try:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except Exception:
            pass
        os._exit(1)


def worker_main(argv: list[str] | None = None) -> None:
    """``python -m pagedkv.engine.executor --connect HOST:PORT --rank R``: a worker process
    (started by `MultiprocExecutor`; the authentication key, hex, is the first line on its
    standard input: never in its arguments or environment, which other users may read)."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--connect", required=True)
    ap.add_argument("--rank", type=int, required=True)
    args = ap.parse_args(argv)
    host, port = args.connect.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    conn = Connection(sock.detach())
    answer_challenge(conn, bytes.fromhex(sys.stdin.readline().strip()))
    conn.send(args.rank)
    run_worker(conn, args.rank)


class MultiprocExecutor(Executor):
    """Rank 0 here, ranks 1..N-1 in worker processes (module docstring). They are fresh
    interpreters (``python -m pagedkv.engine.executor``), not forks: a user's script needs no
    ``if __name__ == "__main__"`` guard, and nothing of the driver's state leaks into them."""

    def __init__(self, config: EngineConfig) -> None:
        tp = config.tensor_parallel_size
        self.init_method = config.distributed_init_method or f"tcp://127.0.0.1:{get_open_port()}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.conns: list[Connection] = []
        self._saved_threads = torch.get_num_threads()
        self.step_timeout_s = config.distributed_timeout_s
        self._finalizer = weakref.finalize(self, _stop_processes, self.procs, self.conns)
        try:
            self._start_workers(config)
            torch.set_num_threads(_worker_threads(config))
            self.driver = Worker(config, 0, self.init_method)
            for rank in range(1, tp):
                self._expect(rank, "loaded", WORKER_START_TIMEOUT_S)
            self.driver.connect()
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self, config: EngineConfig) -> None:
        """Start ranks 1..N-1 and accept their authenticated connections (in rank order)."""
        tp = config.tensor_parallel_size
        authkey = secrets.token_bytes(32)
        with socket.create_server(("127.0.0.1", 0)) as srv:
            srv.settimeout(0.1)
            address = f"127.0.0.1:{srv.getsockname()[1]}"
            for rank in range(1, tp):
                cmd = [sys.executable, "-m", "pagedkv.engine.executor"]
                cmd += ["--connect", address, "--rank", str(rank)]
                proc = subprocess.Popen(cmd, stdin=subprocess.PIPE)
                self.procs.append(proc)
                assert proc.stdin is not None
                proc.stdin.write(authkey.hex().encode() + b"\n")
                proc.stdin.close()
            conns: dict[int, Connection] = {}
            deadline = time.monotonic() + WORKER_START_TIMEOUT_S
            while len(conns) < tp - 1:
                for rank, proc in enumerate(self.procs, start=1):
                    if proc.poll() is not None and rank not in conns:
                        raise WorkerDiedError(
                            f"worker rank {rank} (pid {proc.pid}) exited with code "
                            f"{proc.returncode} before connecting"
                        )
                if time.monotonic() > deadline:
                    raise TimeoutError("worker processes did not connect")
                try:
                    sock, _ = srv.accept()
                except TimeoutError:
                    continue
                sock.settimeout(None)
                conn = Connection(sock.detach())
                deliver_challenge(conn, authkey)
                rank = conn.recv()
                conn.send((config, self.init_method))
                conns[rank] = conn
            self.conns.extend(conns[r] for r in range(1, tp))

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _alive(self, rank: int) -> bool:
        return self.procs[rank - 1].poll() is None

    def _expect(self, rank: int, kind: str, timeout: float) -> Any:
        """Wait for message ``kind`` from ``rank``; `WorkerDiedError` if it died or reported an
        error, TimeoutError after ``timeout`` seconds."""
        conn, proc = self.conns[rank - 1], self.procs[rank - 1]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if conn.poll(0.05):
                try:
                    got, payload = conn.recv()
                except (EOFError, OSError):
                    proc.wait(WORKER_STOP_GRACE_S)
                    raise WorkerDiedError(self._death(rank)) from None
                if got == kind:
                    return payload
                if got == "error":
                    raise WorkerDiedError(f"worker rank {rank} (pid {proc.pid}) failed: {payload}")
            elif not self._alive(rank):
                raise WorkerDiedError(self._death(rank))
        raise TimeoutError(
            f"worker rank {rank} (pid {proc.pid}) did not send {kind!r} in {timeout} s"
        )

    def _death(self, rank: int) -> str:
        proc, conn = self.procs[rank - 1], self.conns[rank - 1] if rank <= len(self.conns) else None
        detail = ""
        try:
            while conn is not None and conn.poll(0):
                got, payload = conn.recv()
                if got == "error":
                    detail = f": {payload}"
        except (EOFError, OSError):
            pass
        code = proc.poll()
        if code is None:
            how = "its connection closed"
        elif code < 0:
            how = f"killed by signal {-code}"
        else:
            how = f"exit code {code}"
        return f"worker rank {rank} (pid {proc.pid}) died ({how}){detail}"

    def initialize_kv_cache(
        self, kv_cache_config: KVCacheConfig, connector: KVConnectorBase | None
    ) -> None:
        share = _shares_kv(connector)
        for conn in self.conns:
            conn.send(("init_kv", (kv_cache_config, share)))
        self.driver.initialize_kv_cache(kv_cache_config, None)
        infos = [self.driver.shard_info()] + [
            self._expect(rank, "ready", WORKER_START_TIMEOUT_S)
            for rank in range(1, len(self.procs) + 1)
        ]
        if connector is None:
            return
        attachments = self._attach_connector(connector, infos)
        for conn, attachment in zip(self.conns, attachments):
            conn.send(("attach_offload", attachment))
        for rank in range(1, len(attachments) + 1):
            self._expect(rank, "attached", WORKER_START_TIMEOUT_S)

    def kv_cache_bytes(self) -> list[int]:
        self.check_health()
        for conn in self.conns:
            conn.send(("kv_bytes", None))
        return [self.driver.runner.kv_buffer.nbytes] + [
            self._expect(rank, "kv_bytes", 30.0) for rank in range(1, len(self.procs) + 1)
        ]

    def _stopped_rank(self) -> int | None:
        """A worker that exited or reported something (only errors come unasked), or None."""
        for rank in range(1, len(self.procs) + 1):
            if not self._alive(rank) or self.conns[rank - 1].poll(0):
                return rank
        return None

    def check_health(self) -> None:
        super().check_health()
        rank = self._stopped_rank()
        if rank is not None:
            self._fail(self._death(rank))

    def execute_model(self, so: SchedulerOutput) -> StepResult:
        self.check_health()
        runner, c = self.driver.runner, self.driver.runner.connector
        mi = self._model_input(so)
        if mi.is_empty and mi.kv_work is None:  # nothing for the other ranks
            return runner.execute_model(so, mi)

        def ranks_done() -> None:  # the other ranks' copies, before the step is reported
            if mi.kv_work is not None:
                failed: set[int] = set()
                for rank in range(1, len(self.procs) + 1):
                    failed |= self._expect(rank, "kv_done", self.step_timeout_s)
                c.finish_rank_step(mi.kv_work, failed)  # type: ignore[union-attr]

        try:
            for conn in self.conns:
                conn.send(("step", mi))
            return runner.execute_model(so, mi, ranks_done)
        except Exception as e:
            # A collective failed: a peer is gone (or going). Name it if we can.
            deadline = time.monotonic() + WORKER_STOP_GRACE_S
            while time.monotonic() < deadline:
                rank = self._stopped_rank()
                if rank is not None:
                    self._fail(self._death(rank))
                time.sleep(0.05)
            self._fail(f"tensor-parallel step failed: {type(e).__name__}: {e}")
            raise  # unreachable: _fail raises

    def shutdown(self) -> None:
        if self._finalizer.alive:
            self._finalizer()
            torch.set_num_threads(self._saved_threads)


def _stop_processes(procs: list[subprocess.Popen[bytes]], conns: list[Connection]) -> None:
    """Stop worker processes by pid: None on the connection, then SIGTERM, then SIGKILL."""
    for conn in conns:
        try:
            conn.send(None)
        except (OSError, ValueError):
            pass
    for sig in (None, "terminate", "kill"):
        for p in procs:
            if sig is not None and p.poll() is None:
                getattr(p, sig)()
        deadline = time.monotonic() + WORKER_STOP_GRACE_S
        for p in procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                pass
        if all(p.poll() is not None for p in procs):
            break
    for conn in conns:
        conn.close()


if __name__ == "__main__":
    worker_main()
