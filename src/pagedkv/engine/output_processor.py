"""`OutputProcessor`: the scheduler's `EngineCoreOutputs` → text and `RequestOutput`s.

It owns what users see and the scheduler cannot know: incremental detokenization, stop
strings (text-level stops, checked after the scheduler's token-level ones) and the cumulative
`RequestOutput` of each user request (one `CompletionOutput` per sample of an ``n > 1``
request). A stop string found in a request the scheduler still runs is returned in
``reqs_to_abort``: the engine finishes it in the scheduler (vLLM's output processor aborts it
in the engine core the same way).

Prompt logprobs arrive per step from the runner (`add_prompt_logprobs`, also for prefill
chunks that produce no output yet) and accumulate on the request's first sample; each
`RequestOutput` carries the list so far (complete once the prompt is done).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedkv.engine.outputs import CompletionOutput, PromptLogprobs, RequestOutput, SampleLogprobs
from pagedkv.engine.request import Request
from pagedkv.engine.sampler import LogprobsTensors
from pagedkv.engine.scheduler_output import EngineCoreOutput, EngineCoreOutputs
from pagedkv.models.tokenizer import DetokenizeState

# Decoded token texts kept for logprobs (one decode per distinct token id, up to this many).
MAX_DECODED_TOKEN_CACHE = 200_000

# `RequestOutput.error` of a request the scheduler failed (finish reason "error" from
# ``kv_load_failure_policy="fail"``).
KV_LOAD_ERROR = "KVLoadError: the request's KV cache failed to load from the KV connector"


@dataclass(slots=True)
class RequestState:
    """What users see of one sample: its text, logprobs and finish reason."""

    request: Request
    detok_state: DetokenizeState | None = None
    output_text: str = ""
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # from the KV connector, at finish
    # First sample of a ``prompt_logprobs`` request: [None] + one dict per scored prompt token.
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(slots=True)
class OutputProcessorOutput:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    # Requests stopped by a stop string while the scheduler still runs them.
    reqs_to_abort: list[str] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        # user request id -> the states of its samples, in sample order of forking
        self.parent_requests: dict[str, list[RequestState]] = {}
        self.request_states: dict[str, RequestState] = {}  # request (sample) id -> its state
        self._decoded: dict[int, str] = {}  # token id -> text, for Logprob.decoded_token

    # ---- tracking ---------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Track a new sample: the first of a user request, or a child forked from it."""
        detok = None
        if self.tokenizer is not None:
            detok = DetokenizeState(skip_special_tokens=request.sampling_params.skip_special_tokens)
        state = RequestState(request, detok)
        if request.sampling_params.prompt_logprobs is not None and request.sample_index == 0:
            state.prompt_logprobs = [None]  # the first prompt token has no logprob
        self.request_states[request.request_id] = state
        self.parent_requests.setdefault(request.parent_id, []).append(state)

    def has_request(self, parent_id: str) -> bool:
        return parent_id in self.parent_requests

    def has_unfinished_requests(self) -> bool:
        return bool(self.parent_requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parent_requests)

    def abort_requests(self, parent_ids: list[str]) -> list[str]:
        """Forget user requests; returns the ids of their samples for the scheduler to finish."""
        ids: list[str] = []
        for pid in parent_ids:
            for state in self.parent_requests.pop(pid, ()):
                rid = state.request.request_id
                self.request_states.pop(rid, None)
                ids.append(rid)
        return ids

    # ---- one step ---------------------------------------------------------------------------

    def add_prompt_logprobs(self, scored: dict[str, tuple[int, LogprobsTensors]]) -> None:
        """Append this step's prompt logprobs: ``scored[rid] = (first, t)`` where row ``i`` of
        ``t`` scores prompt token ``first + i + 1``. Rows already held (a recompute) are
        dropped, so no position is ever reported twice. Positions never computed here (their KV
        loaded by a KV connector: a PD decode instance's remote prefill) are None."""
        for rid, (first, t) in scored.items():
            state = self.request_states.get(rid)
            if state is None or state.prompt_logprobs is None:
                continue  # aborted meanwhile
            held = len(state.prompt_logprobs) - 1  # prompt positions scored so far
            state.prompt_logprobs.extend([None] * (first - held))
            rows = t.to_dicts(self._decode if self.tokenizer is not None else None)
            state.prompt_logprobs.extend(rows[max(held - first, 0) :])

    def _decode(self, token_id: int) -> str:
        """The text of one token (special tokens included), as vLLM's ``decoded_token``."""
        text = self._decoded.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._decoded) < MAX_DECODED_TOKEN_CACHE:
                self._decoded[token_id] = text
        return text

    def process_outputs(
        self, engine_core_outputs: EngineCoreOutputs, now: float
    ) -> OutputProcessorOutput:
        """Detokenize, apply stop strings, and return the cumulative output of every user
        request that progressed (in the order of ``outputs``). Finished user requests are
        forgotten once returned."""
        eco = engine_core_outputs
        for child in eco.forked:
            self.add_request(child)
        result = OutputProcessorOutput()
        touched: dict[str, None] = {}
        states = self.request_states
        for out in eco.outputs:
            state = states.get(out.request_id)
            if state is None:
                continue  # its user request was aborted
            self._update(state, out, now, result.reqs_to_abort)
            touched[state.request.parent_id] = None
        result.request_outputs = [self._make_output(pid) for pid in touched]
        return result

    def _update(
        self, state: RequestState, out: EngineCoreOutput, now: float, reqs_to_abort: list[str]
    ) -> None:
        req = state.request
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        if out.new_token_ids:
            metrics = req.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            if out.new_logprobs is not None:
                if state.logprobs is None:
                    state.logprobs = []
                state.logprobs.append(out.new_logprobs)
                state.cumulative_logprob += out.new_sampled_logprob or 0.0
            if state.detok_state is not None:
                state.output_text += self.tokenizer.decode_incremental(
                    state.detok_state, out.new_token_ids
                )
            p = req.sampling_params
            # EOS and stop token ids win over stop strings; a stop string wins over a length cap.
            if p.stop_strings and finish_reason != "stop" and req.num_output_tokens >= p.min_tokens:
                stop = self._truncate_at_stop(state)
                if stop is not None:
                    if finish_reason is None:
                        reqs_to_abort.append(req.request_id)
                    finish_reason, stop_reason = "stop", stop
        if out.kv_transfer_params is not None:
            state.kv_transfer_params = out.kv_transfer_params
        if finish_reason is not None:
            state.finish_reason, state.stop_reason = finish_reason, stop_reason
            self._close(state, now)

    def _truncate_at_stop(self, state: RequestState) -> str | None:
        """The first stop string found in the text (which is cut there, keeping the stop
        string only with ``include_stop_str_in_output``), or None."""
        p = state.request.sampling_params
        text = state.output_text
        for stop in p.stop_strings:
            at = text.find(stop)
            if at >= 0:
                state.output_text = (
                    text[: at + len(stop)] if p.include_stop_str_in_output else text[:at]
                )
                return stop
        return None

    def _close(self, state: RequestState, now: float) -> None:
        """A sample just finished: flush text held back for an incomplete character (not
        after a stop string: the text was cut there on purpose) and stamp the finish time."""
        if state.detok_state is not None and not isinstance(state.stop_reason, str):
            state.output_text += self.tokenizer.decode_incremental(
                state.detok_state, [], final=True
            )
        state.request.metrics.finished_time = now

    def fail_requests(self, parent_ids: list[str], error: str, now: float) -> list[RequestOutput]:
        """Finish user requests whose step failed: every sample not reported finished gets
        reason "error"; one final output per request, with ``error`` set."""
        outputs = []
        for pid in parent_ids:
            for state in self.parent_requests.get(pid, ()):
                if state.finish_reason is None:
                    state.finish_reason = "error"
                    state.request.metrics.finished_time = now
            outputs.append(self._make_output(pid, error=error))
        return outputs

    def _make_output(self, parent_id: str, error: str | None = None) -> RequestOutput:
        """The cumulative output of user request ``parent_id``; once finished (or failed with
        ``error``: finished whatever its samples) the request is forgotten."""
        states = self.parent_requests[parent_id]
        first = states[0].request
        n = first.sampling_params.n
        finished = error is not None or (
            len(states) == n and all(s.finish_reason is not None for s in states)
        )
        outputs = [
            CompletionOutput(
                index=s.request.sample_index,
                text=s.output_text,
                token_ids=list(s.request.output_token_ids),
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                logprobs=s.logprobs,
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
            )
            for s in states
        ]
        if finished:
            del self.parent_requests[parent_id]
            for s in states:
                self.request_states.pop(s.request.request_id, None)
            if error is None and any(s.finish_reason == "error" for s in states):
                error = KV_LOAD_ERROR
        return RequestOutput(
            request_id=parent_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=outputs,
            prompt_logprobs=_copy(states[0].prompt_logprobs),
            finished=finished,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            metrics=first.metrics,
            error=error,
            kv_transfer_params=states[0].kv_transfer_params,
        )


def _copy(prompt_logprobs: PromptLogprobs | None) -> PromptLogprobs | None:
    """A snapshot: later steps extend the state's list, not the outputs already returned."""
    return None if prompt_logprobs is None else list(prompt_logprobs)
