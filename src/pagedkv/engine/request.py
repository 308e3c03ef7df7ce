"""`Request`: one sequence being generated (one sample of a user request).

A user request with ``n > 1`` becomes ``n`` `Request`s: the first (``sample_index == 0``) runs
the prefill; the others are forked from it when its prompt is done (`make_child`), sharing its
full blocks. Torch-free: a seeded request stores its ``seed`` and the sampler keeps the
generator. Text, logprobs and finish reasons shown to users live in the output processor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagedkv.core.request import KVCacheRequest, RequestStatus
from pagedkv.engine.outputs import RequestMetrics
from pagedkv.engine.sampling_params import SamplingParams

# The finish reason users see for each finished status (vLLM's map; an ignored request was
# too long, like a length cap).
FINISHED_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True, eq=False, kw_only=True)
class Request(KVCacheRequest):
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    prompt: str | None = None
    eos_token_id: int | None = None
    parent_id: str | None = None  # the user-visible request id (== request_id when n == 1)
    sample_index: int = 0
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    seed: int | None = None  # this sample's seed (params.seed + sample_index), None: unseeded
    num_cached_tokens: int = -1  # prefix-hit tokens at first admission (-1: not admitted yet)
    max_tokens: int = 0  # effective limit (capped by max_model_len)
    stop_reason: int | str | None = None  # the stop token id that finished it
    fork_pending: int = 0  # children still to fork after this request's prefill
    # Structured outputs: this sample's grammar matcher (`StructuredOutputGrammar`), advanced
    # by each token the scheduler appends; None for an unconstrained request.
    grammar: Any = None
    # Token eviction with cache positions: the evicted tokens its cached keys' RoPE accounts for.
    kv_rotated_offset: int = 0
    # PyramidKV after compression: per attention layer, how many cache indices earlier than
    # the table's (the first layer's) that layer writes its later tokens; None: no shift.
    kv_layer_shift: list[int] | None = None
    # Image inputs: each `mm_features` item's pixel values (a tensor), in the same order.
    mm_inputs: list[Any] = field(default_factory=list)

    @property
    def needs_sampling_this_step(self) -> bool:
        return self.num_computed_tokens >= self.num_tokens

    def make_child(self, index: int) -> Request:
        """Sample ``index`` of this (n > 1) request, as it stands before its first token: the
        same prompt, parameters and arrival time, its own id and seed."""
        p = self.sampling_params
        child = Request(
            request_id=f"{self.parent_id}#{index}",
            prompt_token_ids=self.prompt_token_ids,
            block_hasher=self.block_hasher,
            cache_salt=self.cache_salt,
            sampling_params=p,
            prompt=self.prompt,
            kv_transfer_params=self.kv_transfer_params,
            skip_reading_prefix_cache=self.skip_reading_prefix_cache,
            eos_token_id=self.eos_token_id,
            parent_id=self.parent_id,
            sample_index=index,
            max_tokens=self.max_tokens,
            seed=None if p.seed is None else p.seed + index,
            mm_features=self.mm_features,
            mm_inputs=self.mm_inputs,
        )
        child.metrics.arrival_time = self.metrics.arrival_time
        if self.grammar is not None:  # the parent's matcher, before its first token
            child.grammar = self.grammar.fork()
        return child
