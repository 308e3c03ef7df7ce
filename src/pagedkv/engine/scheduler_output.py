"""What crosses the scheduler's boundary in one step (vLLM's shapes, kept small).

* `SchedulerOutput` (``Scheduler.schedule()``): the flat batch of the next forward pass (which
  tokens of which requests), the block copies to do first, the samples to fork when a prompt
  ends (``n > 1``), and the requests that finished since the previous step (workers drop their
  per-request state: the sampler's seeded generators).
* `ModelRunnerOutput` (the runner + sampler): one sampled token per sampling row, with its
  logprobs. Rows are named by request id, so a test can build one without a model.
* `EngineCoreOutputs` (``Scheduler.update_from_output``): per request that progressed or
  finished, its new tokens and finish reason; plus the samples forked this step. The output
  processor turns them into text and `RequestOutput`s.

Torch-free: the scheduler and these types know nothing of tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedkv.engine.request import Request
from pagedkv.kv_transfer.base import KVConnectorMetadata, KVConnectorOutput


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    start: int  # first position computed this step (== num_computed_tokens before the step)
    num_tokens: int
    block_ids: tuple[list[int], ...]  # the request's block table in each KV cache group
    # Token eviction (`core.token_eviction`): the request's evicted tokens (its cache index
    # of position p is p - kv_offset); whether its RoPE positions are cache indices; how far
    # its cached keys are re-rotated back before the step (blocks released this step); and,
    # in the step that reaches a snapkv compression point, the new table its kept tokens are
    # copied into after the forward pass.
    kv_offset: int = 0
    cache_positions: bool = False
    rerotate: int = 0
    rerotate_from: int = 0  # the first cache index re-rotated (after the sink blocks)
    # PyramidKV: per attention layer, the shift of its cache indices (None: none).
    layer_shift: list[int] | None = None
    compaction: list[int] | None = None
    layer_kept: list[int] | None = None  # with compaction: tokens each attention layer keeps

    @property
    def samples(self) -> bool:
        """Whether this step's tokens reach the end of the request's known tokens, so the
        step's last logits row of this request is sampled."""
        return self.start + self.num_tokens >= self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(
        default_factory=list
    )  # (src, dst) before the pass
    # Running requests stopped because their sequence no longer fits even the empty cache;
    # `Scheduler.update_from_output` reports them (finish reason "length").
    finished: list[Request] = field(default_factory=list)
    # (parent, child): samples of an n > 1 request to fork from the parent whose prompt ends
    # this step. The children are sampled from the parent's logits row in this step (right
    # after it, in index order) and become running requests in `update_from_output`.
    forks: list[tuple[Request, Request]] = field(default_factory=list)
    # Requests finished (or aborted) since the previous step: workers drop their state.
    finished_req_ids: set[str] = field(default_factory=set)
    num_batched_tokens: int = 0
    # The KV connector's work for this step (`KVConnectorBase.build_connector_meta`).
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class ModelRunnerOutput:
    """One sampled token per row; row ``i`` belongs to request ``req_ids[i]``.

    ``logprobs[i]`` (when requested) maps token id → `Logprob` for the sampled token and the
    top-k; ``sampled_logprobs[i]`` is the sampled token's logprob. Both are None (the lists
    themselves may be None) when no row asked for logprobs.
    """

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Any] | None] | None = None
    sampled_logprobs: list[float | None] | None = None
    # The KV connector's worker-side report of the step (None without a connector).
    kv_connector_output: KVConnectorOutput | None = None


# A step that sampled nothing (an empty batch, or only prefill chunks short of their prompt's
# end). Never mutated.
EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput()


@dataclass(slots=True)
class EngineCoreOutput:
    """What one request did in a step: its new tokens and, once finished, why.

    ``finish_reason`` is ``"stop"`` (EOS or a stop token id; then ``stop_reason`` is that id, or
    None for EOS), ``"length"`` (max_tokens, max_model_len, or a sequence the whole KV cache
    cannot hold), ``"abort"``, ``"error"`` (its KV could not be loaded, with
    ``kv_load_failure_policy="fail"``), or None while the request runs.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: dict[int, Any] | None = None
    new_sampled_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # From `KVConnectorBase.request_finished`: what a consumer needs to fetch this request's KV.
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    # Samples forked this step (n > 1), in order: the output processor starts tracking them
    # before it reads ``outputs`` (which carry their first tokens).
    forked: list[Request] = field(default_factory=list)
