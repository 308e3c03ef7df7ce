"""Process groups over torch.distributed: the collectives tensor and context parallelism need.

`GroupCoordinator` (vLLM's name) wraps one torch.distributed process group (gloo on CPU, NCCL
on CUDA) built from a ``tcp://HOST:PORT`` rendezvous, without touching torch's process-global
default group: one process may host several engines (a TP=2 engine beside a TP=1 reference in
a test), each with its own groups. A group of one rank does nothing and costs nothing.

Measured on the 2-core host (``benchmarks/bench_parallel.py``, ``results/parallel.json``):
gloo's own all-reduce of one decode row of SmolLM2 (576 float32) between two processes takes
~1.6 ms, an all-gather and a sum ~0.6 ms; so on CPU `all_reduce` is an all-gather and a sum in
rank order (every rank adds the same numbers in the same order: identical results on every
rank, as a ring all-reduce gives).
"""

from __future__ import annotations

import datetime
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from pagedkv.core.parallel import RankLayout

DEFAULT_TIMEOUT_S = 120.0  # a collective (or the rendezvous) waiting longer than this fails


def parse_init_method(init_method: str) -> tuple[str, int]:
    """``(host, port)`` of a ``tcp://HOST:PORT`` rendezvous; ValueError for anything else."""
    u = urlparse(init_method)
    if u.scheme != "tcp" or not u.hostname or not u.port:
        raise ValueError(f"distributed_init_method must be tcp://HOST:PORT, got {init_method!r}")
    return u.hostname, u.port


def get_open_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (vLLM's ``get_open_port``)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def make_store(init_method: str, rank: int, world_size: int, timeout_s: float) -> object:
    """The rendezvous ``TCPStore`` (rank 0 hosts it; it does not wait for the others here)."""
    host, port = parse_init_method(init_method)
    return dist.TCPStore(
        host,
        port,
        world_size,
        rank == 0,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


@dataclass(slots=True)
class GroupCoordinator:
    """``world_size`` ranks of one group; ``rank`` is this process's place in it.

    Built in two steps so that a rank can load its weights before it blocks on its peers:
    :meth:`create` only records the rendezvous, :meth:`connect` builds the process group
    (blocking until every rank connected, or ``timeout_s``).

    Contract: every rank calls the same collectives in the same order with tensors of the same
    shape (the model's forward pass guarantees it: every rank runs the same step). A peer that
    died makes the next collective raise (its socket closes) or time out after ``timeout_s``.
    """

    rank: int
    world_size: int
    device: torch.device
    name: str = "tp"
    store: object | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    pg: object | None = None  # the torch ProcessGroup (None for one rank or before connect)
    # Time spent in this group's collectives and their count (benchmarks read the share of a
    # step they take: two clock reads per call, against ~0.4 ms per gloo collective).
    comm_seconds: float = 0.0
    comm_calls: int = 0

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> GroupCoordinator:
        return cls(0, 1, torch.device(device))

    @classmethod
    def create(
        cls,
        store: object,
        rank: int,
        world_size: int,
        device: torch.device | str = "cpu",
        name: str = "tp",
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> GroupCoordinator:
        """Group ``name`` of ``world_size`` ranks over the rendezvous ``store``; not connected."""
        if world_size == 1:
            return cls.single(device)
        return cls(rank, world_size, torch.device(device), name, store, timeout_s)

    def connect(self) -> None:
        """Build the process group (gloo on CPU, NCCL on CUDA); idempotent."""
        if self.pg is not None or self.world_size == 1:
            return
        prefixed = dist.PrefixStore(f"pagedkv/{self.name}/", self.store)
        if self.device.type == "cuda":
            self.pg = dist.ProcessGroupNCCL(prefixed, self.rank, self.world_size)  # type: ignore[attr-defined]
        else:
            timeout = datetime.timedelta(seconds=self.timeout_s)
            self.pg = dist.ProcessGroupGloo(prefixed, self.rank, self.world_size, timeout)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of ``t`` over the ranks (a new tensor; ``t`` itself for one rank)."""
        if self.world_size == 1:
            return t
        if self.device.type == "cuda":
            self.pg.allreduce([t]).wait()  # NCCL's all-reduce is the fast one there
            return t
        parts = self.all_gather_list(t)
        out = parts[0].clone()
        for p in parts[1:]:
            out.add_(p)
        return out

    def all_gather_list(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape on all ranks), in rank order."""
        if self.world_size == 1:
            return [t]
        start = time.perf_counter()
        t = t.contiguous()
        outs = [torch.empty_like(t) for _ in range(self.world_size)]
        self.pg.allgather([outs], [t]).wait()
        self.comm_seconds += time.perf_counter() - start
        self.comm_calls += 1
        return outs

    def all_gather_uneven(self, t: torch.Tensor, sizes: list[int], dim: int = -1) -> torch.Tensor:
        """Every rank's ``t`` concatenated along ``dim`` in rank order, where rank ``r`` holds
        ``sizes[r]`` entries along ``dim`` (an uneven vocabulary or head split): each part is
        padded to the largest for the all-gather, then trimmed."""
        if self.world_size == 1:
            return t
        dim = dim % t.dim()
        most = max(sizes)
        if t.shape[dim] < most:
            pad = list(t.shape)
            pad[dim] = most - t.shape[dim]
            t = torch.cat([t, t.new_zeros(pad)], dim=dim)
        parts = self.all_gather_list(t)
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)


@dataclass(slots=True)
class ParallelContext:
    """What a model built for one rank needs: its share (`RankLayout`) and its groups — the
    tensor-parallel group (all ranks) and its decode-context-parallel group (the ranks that hold
    the same KV heads and split their tokens)."""

    layout: RankLayout
    tp_group: GroupCoordinator
    dcp_group: GroupCoordinator

    @property
    def tp_size(self) -> int:
        return self.tp_group.world_size

    def connect(self) -> None:
        self.tp_group.connect()
        self.dcp_group.connect()

    @property
    def dcp_size(self) -> int:
        return self.dcp_group.world_size
