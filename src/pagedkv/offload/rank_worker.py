"""`RankOffloadWorker`: a TP/DCP rank's side of the offload tiers (ranks 1..N-1).

The driver's `OffloadingConnector` decides every transfer (which device blocks, which host
chunk slots) and copies rank 0's part itself; each step it hands the other ranks the same copies
as a `RankKVWork` inside the step's `ModelInput`. A rank runs ``before`` (stores of blocks
freed since the last step, then the step's loads) before its forward pass and ``after`` (the
stores of the blocks this step filled) after it, between its device blocks and its part of the
shared host buffer (`offload.sharded`), and reports the jobs that failed. A rank that only
reads its shard (a replicated KV head: another rank writes it) skips the stores.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedkv.offload.base import CPULoadStoreSpec, GPULoadStoreSpec
from pagedkv.offload.sharded import HostAttachment, attach_host_memory, rank_host_buffer
from pagedkv.offload.worker import OffloadingWorker, block_major_view

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RankCopy:
    """One copy job: device blocks ``block_ids`` ⇄ host chunk slots ``chunk_ids`` (one each)."""

    job_id: int
    store: bool  # device → host (else host → device)
    block_ids: tuple[int, ...]
    chunk_ids: tuple[int, ...]


@dataclass(slots=True)
class RankKVWork:
    """One step's copies for ranks 1..N-1, in the order they must run."""

    before: list[RankCopy] = field(default_factory=list)
    after: list[RankCopy] = field(default_factory=list)

    @property
    def job_ids(self) -> set[int]:
        return {c.job_id for c in self.before} | {c.job_id for c in self.after}


class RankOffloadWorker:
    """Copies between this rank's KV cache and its part of the shared host buffer."""

    def __init__(self, kv_buffer: torch.Tensor, layout: Any, attachment: HostAttachment) -> None:
        a = attachment
        memory = attach_host_memory(a.path, a.num_chunks * a.chunk_bytes)
        blocks = block_major_view(kv_buffer, layout)
        host = rank_host_buffer(
            memory, a.num_chunks, a.chunk_bytes, a.offset, blocks.shape[1:], blocks.dtype
        )
        self.worker = OffloadingWorker(kv_buffer, layout, host)
        self.is_writer = a.is_writer

    def run(self, copies: Sequence[RankCopy]) -> set[int]:
        """Run ``copies`` in order (stores only when this rank writes its shard); the ids of
        the jobs that failed."""
        failed: set[int] = set()
        ran: list[int] = []
        for c in copies:
            if c.store and not self.is_writer:
                continue
            dev, host = GPULoadStoreSpec(c.block_ids), CPULoadStoreSpec(c.chunk_ids)
            try:
                if c.store:
                    self.worker.submit_store(c.job_id, dev, host)
                else:
                    self.worker.submit_load(c.job_id, host, dev)
            except ValueError:  # ids out of range: a failed job, never a dead rank
                logger.exception("offload copy job %d refused", c.job_id)
                failed.add(c.job_id)
                continue
            ran.append(c.job_id)
        self.worker.wait(ran)
        failed.update(r.job_id for r in self.worker.get_finished() if not r.success)
        return failed
