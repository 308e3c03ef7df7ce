"""`ModelInput`: one step's work for every rank — what the driver sends its workers.

The driver's `ModelRunner.build_model_input` turns a `SchedulerOutput` (which holds live
`Request` objects) into this plain, picklable description: per request the step's tokens, its
block table, whether it samples and the prompt-logprob rows it scores. Every rank runs the same
`ModelInput` (`ModelRunner.execute_model_input`), so every rank makes the same collective calls
in the same order. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class PromptLogprobsTask:
    """Score prompt positions ``[first, last)``: row ``p`` against ``targets[p - first]`` (the
    prompt token ``p + 1``), keeping the top ``k``."""

    first: int
    last: int
    targets: list[int]
    k: int


@dataclass(slots=True)
class KVCompaction:
    """SnapKV at the end of this step (`core.token_eviction`): per layer and KV head, keep
    ``budgets[l]`` of the request's ``num_tokens`` cached tokens in attention layer ``l`` (the
    first ``sink_tokens``, the last ``recent_tokens`` and the best-scored others; all of them
    where the budget is not smaller) and copy them, in order, into ``block_ids`` (the
    request's table from the next step on)."""

    block_ids: list[int]
    num_tokens: int
    budgets: list[int]
    sink_tokens: int
    recent_tokens: int
    pool_kernel: int


@dataclass(slots=True)
class ScheduledTokens:
    """One request's share of the step: tokens ``token_ids`` at positions ``start ..``."""

    request_id: str
    token_ids: list[int]
    start: int
    block_ids: tuple[list[int], ...]  # its block table in each KV cache group
    samples: bool  # the step's last row of this request is sampled
    prompt_logprobs: PromptLogprobsTask | None = None
    # Token eviction (`ScheduledRequest`'s fields of the same names).
    kv_offset: int = 0
    cache_positions: bool = False
    rerotate: int = 0
    rerotate_from: int = 0  # the first cache index re-rotated (after the sink blocks)
    # PyramidKV: per attention layer, the shift of its cache indices (None: none).
    layer_shift: list[int] | None = None
    compaction: KVCompaction | None = None
    # Images whose placeholder runs this step's tokens overlap: (content hash, offset, length,
    # pixel values) each (`engine.multimodal`); the runner places their encoder output.
    mm: list[tuple[str, int, int, Any]] = field(default_factory=list)
    # KIVI caches: the hash of the request's first block (None: not full yet), which keys its
    # int8 sinks in the runner's `ops.kivi.KiviSinkStore`.
    sink_key: bytes | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class ModelInput:
    scheduled: list[ScheduledTokens] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # The offload tiers' copies for ranks 1..N-1 (`offload.rank_worker.RankKVWork`), or None.
    kv_work: Any = None

    @property
    def is_empty(self) -> bool:
        """No forward pass (there may still be ``kv_work``)."""
        return not self.scheduled
