"""OffloadingWorker: moves chunks between the device KV cache and the host chunk buffer.

Worker side of the CPU tier (vLLM ``CPUOffloadingWorker``). The manager decides *which*
slots; the worker copies bytes:

* ``submit_store(job_id, GPULoadStoreSpec(block ids), CPULoadStoreSpec(chunk ids))``
* ``submit_load(job_id, CPULoadStoreSpec(chunk ids), GPULoadStoreSpec(block ids))``
* ``get_finished() -> [TransferResult]``, each job reported exactly once; ``wait(job_ids)``.

Bytes of a block: the device cache is one flat buffer in some layout (`ops.kv_cache`); viewed
block-major (B first, the other dims in layout order) one block is every layer of it. A host
slot holds ``blocks_per_chunk`` such blocks, densely, in the same order; so the stored bytes
depend on the layout, which is part of the config fingerprint.

CPU path: the copy runs inside ``submit_*`` (a memcpy per run of consecutive block ids,
through numpy byte views: torch's per-call overhead and its element-wise advanced indexing
both cost several times more on small blocks); the job is finished when the call returns.
CUDA path: pinned host memory, one stream per direction, every job waits on the compute
stream and on the previous job (jobs complete in submission order), and an end event that
``get_finished`` polls. Written for CUDA, exercised only when a GPU is present.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedkv.offload.base import CPULoadStoreSpec, GPULoadStoreSpec
from pagedkv.ops.kv_cache import layout_name

logger = logging.getLogger(__name__)


def block_major_view(kv_buffer: torch.Tensor, layout: str | Any) -> torch.Tensor:
    """``kv_buffer`` (dims in ``layout`` order) permuted so dim 0 is the block id; no copy."""
    name = layout_name(layout)
    if kv_buffer.dim() != len(name):
        raise ValueError(f"buffer has {kv_buffer.dim()} dims, layout {name} has {len(name)}")
    b = name.index("B")
    return kv_buffer.permute([b] + [i for i in range(len(name)) if i != b])


def _byte_array(t: torch.Tensor) -> np.ndarray:
    """A numpy uint8 view of a CPU tensor (any dtype, bf16 included; strides kept)."""
    return t.view(torch.uint8).numpy()


class HostChunkBuffer:
    """``num_chunks`` slots of ``chunk_bytes`` bytes in host memory (pinned when asked).

    ``tensor`` is ``[num_chunks * blocks_per_chunk, *block_shape]``; slot ``c`` is blocks
    ``c*bpc .. c*bpc+bpc-1``. `chunk_view` hands lower tiers a writable zero-copy memoryview.
    """

    def __init__(
        self,
        num_chunks: int,
        blocks_per_chunk: int,
        block_shape: Sequence[int],
        dtype: torch.dtype,
        pin_memory: bool = False,
        tensor: torch.Tensor | None = None,
    ) -> None:
        """``tensor``: memory that exists already (a rank's strided part of a shared buffer,
        `offload.sharded.rank_host_buffer`) instead of a fresh allocation; `chunk_view` needs
        it contiguous."""
        if num_chunks <= 0 or blocks_per_chunk <= 0:
            raise ValueError("num_chunks and blocks_per_chunk must be positive")
        self.num_chunks = num_chunks
        self.blocks_per_chunk = blocks_per_chunk
        self.block_shape = tuple(block_shape)
        shape = (num_chunks * blocks_per_chunk, *self.block_shape)
        if tensor is None:
            # zeros, not empty: fault every page in now rather than during the first transfers.
            tensor = torch.zeros(shape, dtype=dtype, pin_memory=pin_memory)
        elif tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(
                f"host tensor {tuple(tensor.shape)}/{tensor.dtype} is not {shape}/{dtype}"
            )
        self.tensor = tensor
        self.block_bytes = self.tensor[0].numel() * self.tensor.element_size()
        self.chunk_bytes = self.block_bytes * blocks_per_chunk
        self._chunks = (
            self.tensor.view(torch.uint8).numpy().reshape(num_chunks, self.chunk_bytes)
            if self.tensor.is_contiguous()
            else None
        )

    @classmethod
    def for_kv_cache(
        cls,
        kv_buffer: torch.Tensor,
        layout: str | Any,
        capacity_bytes: int,
        blocks_per_chunk: int = 1,
    ) -> HostChunkBuffer:
        """As many slots as fit in ``capacity_bytes`` for chunks of ``kv_buffer``'s blocks;
        pinned when the device cache is on CUDA."""
        blocks = block_major_view(kv_buffer, layout)
        block_bytes = blocks[0].numel() * blocks.element_size()
        num_chunks = capacity_bytes // (block_bytes * blocks_per_chunk)
        if num_chunks <= 0:
            raise ValueError(
                f"{capacity_bytes} B holds no chunk of {block_bytes * blocks_per_chunk} B"
            )
        return cls(
            num_chunks,
            blocks_per_chunk,
            blocks.shape[1:],
            blocks.dtype,
            pin_memory=kv_buffer.is_cuda,
        )

    def chunk_view(self, chunk_id: int) -> memoryview:
        if self._chunks is None:
            raise ValueError("a strided host buffer has no chunk views (its owner's buffer does)")
        return memoryview(self._chunks[chunk_id])

    @property
    def capacity_bytes(self) -> int:
        return self.num_chunks * self.chunk_bytes


@dataclass(slots=True)
class TransferResult:
    job_id: int
    success: bool
    size: int  # bytes moved
    time: float  # seconds from submit to completion


@dataclass(slots=True)
class _CudaJob:
    job_id: int
    size: int
    start: float
    event: Any  # torch.cuda.Event


def _runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Coalesce ``src[i] → dst[i]`` into ``(src0, dst0, n)`` runs where both ids step by 1."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            s0, d0, n = runs[-1]
            runs[-1] = (s0, d0, n + 1)
        else:
            runs.append((s, d, 1))
    return runs


class OffloadingWorker:
    """Device ↔ host chunk transfers for one KV cache buffer."""

    def __init__(self, kv_buffer: torch.Tensor, layout: str | Any, host: HostChunkBuffer) -> None:
        self.device_blocks = block_major_view(kv_buffer, layout)
        if (
            tuple(self.device_blocks.shape[1:]) != host.block_shape
            or self.device_blocks.dtype != host.tensor.dtype
        ):
            raise ValueError(
                f"host blocks {host.block_shape}/{host.tensor.dtype} do not match device "
                f"blocks {tuple(self.device_blocks.shape[1:])}/{self.device_blocks.dtype}"
            )
        self.host = host
        self.blocks_per_chunk = host.blocks_per_chunk
        self.num_device_blocks = self.device_blocks.shape[0]
        self.is_cuda = kv_buffer.is_cuda
        self._finished: list[TransferResult] = []
        self._cuda_jobs: deque[_CudaJob] = deque()
        self._last_event: Any = None
        if self.is_cuda:
            self._streams = {
                "store": torch.cuda.Stream(kv_buffer.device),
                "load": torch.cuda.Stream(kv_buffer.device),
            }
        else:
            self._dev_np = _byte_array(self.device_blocks)
            self._host_np = _byte_array(host.tensor)
        self.bytes_stored = 0
        self.bytes_loaded = 0
        # CUDA: the compute stream waits for each store. Needed when blocks are freed while
        # their request runs (sliding-window and chunked groups): the next forward pass may
        # write a freed block before an asynchronous copy has read it.
        self.fence_stores = False

    # ---------------------------------------------------------------------------- submit
    def submit_store(self, job_id: int, src: GPULoadStoreSpec, dst: CPULoadStoreSpec) -> None:
        """Copy device blocks ``src.ids`` into host slots ``dst.ids`` (bpc blocks per slot)."""
        dev, host = self._pairs(src, dst)
        self._transfer(job_id, "store", dev, host)

    def submit_load(self, job_id: int, src: CPULoadStoreSpec, dst: GPULoadStoreSpec) -> None:
        """Copy host slots ``src.ids`` into device blocks ``dst.ids``."""
        dev, host = self._pairs(dst, src)
        self._transfer(job_id, "load", host, dev)

    def _pairs(self, dev: GPULoadStoreSpec, host: CPULoadStoreSpec) -> tuple[list[int], list[int]]:
        bpc = self.blocks_per_chunk
        if len(dev.ids) != len(host.ids) * bpc:
            raise ValueError(
                f"{len(dev.ids)} device blocks for {len(host.ids)} chunks of {bpc} blocks"
            )
        if any(not 0 <= b < self.num_device_blocks for b in dev.ids):
            raise ValueError("device block id out of range")
        if any(not 0 <= c < self.host.num_chunks for c in host.ids):
            raise ValueError("host chunk id out of range")
        return list(dev.ids), [c * bpc + j for c in host.ids for j in range(bpc)]

    def _transfer(self, job_id: int, direction: str, src: list[int], dst: list[int]) -> None:
        size = len(src) * self.host.block_bytes
        start = time.perf_counter()
        runs = _runs(src, dst)
        if self.is_cuda:
            self._transfer_cuda(job_id, direction, runs, size, start)
            return
        src_np, dst_np = (
            (self._dev_np, self._host_np) if direction == "store" else (self._host_np, self._dev_np)
        )
        try:
            for s0, d0, n in runs:
                dst_np[d0 : d0 + n] = src_np[s0 : s0 + n]
            ok = True
        except Exception:  # noqa: BLE001 - a failed copy is a failed job, not an engine crash
            logger.exception("offload %s job %d failed", direction, job_id)
            ok = False
        self._count(direction, size if ok else 0)
        self._finished.append(
            TransferResult(job_id, ok, size if ok else 0, time.perf_counter() - start)
        )

    def _transfer_cuda(
        self, job_id: int, direction: str, runs: list[tuple[int, int, int]], size: int, start: float
    ) -> None:
        stream = self._streams[direction]
        # KV written by the model (store) or blocks still read by it (load) must be done first,
        # and jobs run in submission order so a block is never loaded under a pending store.
        stream.wait_stream(torch.cuda.current_stream(self.device_blocks.device))
        if self._last_event is not None:
            stream.wait_event(self._last_event)
        src_t, dst_t = (
            (self.device_blocks, self.host.tensor)
            if direction == "store"
            else (self.host.tensor, self.device_blocks)
        )
        with torch.cuda.stream(stream):
            for s0, d0, n in runs:
                dst_t[d0 : d0 + n].copy_(src_t[s0 : s0 + n], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self._last_event = event
        if direction == "store" and self.fence_stores:
            torch.cuda.current_stream(self.device_blocks.device).wait_event(event)
        self._count(direction, size)
        self._cuda_jobs.append(_CudaJob(job_id, size, start, event))

    def _count(self, direction: str, size: int) -> None:
        if direction == "store":
            self.bytes_stored += size
        else:
            self.bytes_loaded += size

    # --------------------------------------------------------------------------- results
    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call (in completion order)."""
        while self._cuda_jobs and self._cuda_jobs[0].event.query():
            job = self._cuda_jobs.popleft()
            self._finished.append(
                TransferResult(job.job_id, True, job.size, time.perf_counter() - job.start)
            )
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: Collection[int]) -> None:
        """Block until the given jobs have finished (they still show up in `get_finished`)."""
        for job in self._cuda_jobs:
            if job.job_id in job_ids:
                job.event.synchronize()
