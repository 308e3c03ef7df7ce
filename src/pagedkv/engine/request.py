"""`Request`: one sequence being generated (one sample of a user request).

A user request with ``n > 1`` becomes ``n`` `Request`s: the first (``sample_index == 0``) runs
the prefill; the others are forked from it when its prompt is done, sharing its full blocks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pagedkv.core.request import KVCacheRequest
from pagedkv.engine.outputs import RequestMetrics, SampleLogprobs
from pagedkv.engine.sampling_params import SamplingParams


@dataclass(slots=True, eq=False, kw_only=True)
class Request(KVCacheRequest):
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    prompt: str | None = None
    eos_token_id: int | None = None
    parent_id: str | None = None  # the user-visible request id (== request_id when n == 1)
    sample_index: int = 0
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    generator: torch.Generator | None = None
    num_cached_tokens: int = -1  # prefix-hit tokens at first admission (-1: not admitted yet)
    max_tokens: int = 0  # effective limit (capped by max_model_len)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    output_text: str = ""
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float = 0.0
    detok_state: object | None = None
    fork_pending: int = 0  # children still to fork after this request's prefill

    @property
    def needs_sampling_this_step(self) -> bool:
        return self.num_computed_tokens >= self.num_tokens
