"""`RayExecutor`: ranks 1..N-1 as Ray actors (``distributed_executor_backend="ray"``).

The engine's process stays rank 0 (the driver), as with ``"mp"``; the other ranks are actors
of one placement group (one CPU bundle per rank, ``PACK``: on one node when it fits, spread over
the cluster's nodes otherwise), joined by torch.distributed at ``distributed_init_method``
(default: this node's Ray address and a free port). The step protocol is the multiprocess one,
through actor calls: one ``execute`` call per worker per step, whose result is only checked for
a failure. Ray is an optional dependency (``pip install pagedkv[ray]``); the executor connects to
``RAY_ADDRESS`` (a running cluster, e.g. ``ray start --head``) or starts a local one.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from pagedkv.core.specs import KVCacheConfig
from pagedkv.distributed.parallel_state import get_open_port
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.executor import (
    WORKER_START_TIMEOUT_S,
    Executor,
    StepResult,
    WorkerDiedError,
    _shares_kv,
    _worker_threads,
)
from pagedkv.engine.model_input import ModelInput
from pagedkv.engine.scheduler_output import SchedulerOutput
from pagedkv.engine.worker import Worker
from pagedkv.kv_transfer.base import KVConnectorBase
from pagedkv.offload.sharded import HostAttachment, RankShardInfo


class RayWorker:
    """The actor body: one rank's `Worker` (created on the first call, so that the actor
    exists, and can be killed, while it loads)."""

    def __init__(self, config: EngineConfig, rank: int, init_method: str) -> None:
        self.config, self.rank, self.init_method = config, rank, init_method
        self.worker: Worker | None = None

    def load(self) -> int:
        torch.set_num_threads(_worker_threads(self.config))
        self.worker = Worker(self.config, self.rank, self.init_method)
        return os.getpid()

    def connect(self) -> None:
        assert self.worker is not None
        self.worker.connect()

    def init_kv(self, kv_cache_config: KVCacheConfig, share_kv: bool) -> RankShardInfo:
        assert self.worker is not None
        self.worker.initialize_kv_cache(kv_cache_config, share_kv=share_kv)
        return self.worker.shard_info()

    def attach_offload(self, attachment: HostAttachment) -> None:
        assert self.worker is not None
        self.worker.attach_offload(attachment)

    def execute(self, mi: ModelInput) -> set[int] | None:
        assert self.worker is not None
        return self.worker.execute(mi)

    def kv_bytes(self) -> int:
        assert self.worker is not None
        return int(self.worker.runner.kv_buffer.nbytes)


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "distributed_executor_backend='ray' needs Ray: pip install 'pagedkv[ray]'"
        ) from e
    return ray


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        ray = self.ray = _ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._remove_pg = remove_placement_group
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
        tp = config.tensor_parallel_size
        host = ray.util.get_node_ip_address()
        self.init_method = config.distributed_init_method or f"tcp://{host}:{get_open_port(host)}"
        self.actors: list[Any] = []
        self.pids: list[int] = []
        self._pending: list[Any] = []
        self._saved_threads = torch.get_num_threads()
        self.step_timeout_s = config.distributed_timeout_s
        self.pg = placement_group([{"CPU": 1}] * (tp - 1), strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=WORKER_START_TIMEOUT_S)
            actor_cls = ray.remote(num_cpus=1)(RayWorker)
            for rank in range(1, tp):
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=rank - 1
                )
                self.actors.append(
                    actor_cls.options(scheduling_strategy=strategy).remote(
                        config, rank, self.init_method
                    )
                )
            loads = [a.load.remote() for a in self.actors]
            torch.set_num_threads(_worker_threads(config))
            self.driver = Worker(config, 0, self.init_method)
            self.pids = self._get(loads)
            connects = [a.connect.remote() for a in self.actors]
            self.driver.connect()
            self._get(connects)
        except BaseException:
            self.shutdown()
            raise

    @property
    def worker_pids(self) -> list[int]:
        return list(self.pids)

    def _get(self, refs: list[Any], timeout: float = WORKER_START_TIMEOUT_S) -> list[Any]:
        """``ray.get`` that turns a dead or failed actor into `WorkerDiedError` naming it."""
        ray = self.ray
        try:
            return list(ray.get(refs, timeout=timeout))
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
            raise WorkerDiedError(f"a Ray worker failed: {type(e).__name__}: {e}") from e

    def initialize_kv_cache(
        self, kv_cache_config: KVCacheConfig, connector: KVConnectorBase | None
    ) -> None:
        share = _shares_kv(connector)
        refs = [a.init_kv.remote(kv_cache_config, share) for a in self.actors]
        self.driver.initialize_kv_cache(kv_cache_config, None)
        infos = [self.driver.shard_info()] + self._get(refs)
        if connector is not None:
            attachments = self._attach_connector(connector, infos)
            self._get([a.attach_offload.remote(x) for a, x in zip(self.actors, attachments)])

    def kv_cache_bytes(self) -> list[int]:
        return [self.driver.runner.kv_buffer.nbytes] + self._get(
            [a.kv_bytes.remote() for a in self.actors], 30.0
        )

    def check_health(self) -> None:
        super().check_health()
        done, _ = self.ray.wait(self._pending, num_returns=len(self._pending), timeout=0)
        try:
            self._get(done)
        except WorkerDiedError as e:
            self._fail(str(e))
        self._pending = [r for r in self._pending if r not in done]

    def execute_model(self, so: SchedulerOutput) -> StepResult:
        self.check_health()
        runner, c = self.driver.runner, self.driver.runner.connector
        mi = self._model_input(so)
        if mi.is_empty and mi.kv_work is None:  # nothing for the other ranks
            return runner.execute_model(so, mi)
        refs = [a.execute.remote(mi) for a in self.actors]
        self._pending.extend(refs)

        def ranks_done() -> None:  # the other ranks' copies, before the step is reported
            if mi.kv_work is not None:
                failed = set().union(*(f or set() for f in self._get(refs, self.step_timeout_s)))
                c.finish_rank_step(mi.kv_work, failed)  # type: ignore[union-attr]

        try:
            return runner.execute_model(so, mi, ranks_done)
        except Exception as e:
            try:
                self._get(refs, timeout=5.0)
            except WorkerDiedError as died:
                self._fail(str(died))
            except Exception:
                pass
            self._fail(f"tensor-parallel step failed: {type(e).__name__}: {e}")
            raise  # unreachable: _fail raises

    def shutdown(self) -> None:
        ray = self.ray
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        self.actors = []
        if getattr(self, "pg", None) is not None:
            try:
                self._remove_pg(self.pg)
            except Exception:
                pass
            self.pg = None
            torch.set_num_threads(self._saved_threads)
        # Actor processes exit once killed; wait (briefly) so callers may check their pids.
        deadline = time.monotonic() + 10.0
        while self.pids and time.monotonic() < deadline:
            if not any(_alive(p) for p in self.pids):
                break
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" not in f.read()
    except FileNotFoundError:
        return False
