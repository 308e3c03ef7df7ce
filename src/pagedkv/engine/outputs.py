"""Request outputs in vLLM's shape: `RequestOutput` holding one `CompletionOutput` per sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Logprob:
    """Log-probability of a token under the model's raw distribution, with its rank (1 = top)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: None for the first (nothing precedes it), else token id ->
# Logprob for the prompt token itself (always) plus the top-k at that position.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (``time.monotonic()``) and derived latencies of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token that matched
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # With ``SamplingParams.prompt_logprobs``: one entry per prompt token (see PromptLogprobs).
    prompt_logprobs: PromptLogprobs | None = field(default=None, repr=False)
    # Set when the step running this request failed: the request finished with reason "error"
    # (its KV blocks freed); other requests and the engine go on.
    error: str | None = None
    # From the KV connector when the request finished (vLLM's field): e.g. where a decode
    # instance fetches the KV a prefill instance computed.
    kv_transfer_params: dict[str, Any] | None = None
