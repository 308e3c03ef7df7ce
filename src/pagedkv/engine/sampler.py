"""`Sampler`: logits → next tokens, per-request parameters, batched where it can be.

Order of operations (vLLM's): raw logprobs (for ``logprobs=k``) → penalties (repetition,
presence, frequency) → ``min_tokens`` (stop tokens masked) → the structured-output grammar's
token bitmask (it wins over ``min_tokens``: a complete grammar allows only its stop tokens, and
the output must parse) → greedy rows take the argmax;
other rows: temperature → top-k → top-p → min-p → sample. A request with a ``seed`` samples
with its own `torch.Generator` (built here at its first sample, kept by request id until
`remove_requests`), so its tokens do not depend on what else is in the batch.

`compute_prompt_logprobs` scores given tokens under logits rows (``prompt_logprobs=k``), in
vLLM's `LogprobsTensors` shape, batched on the logits' device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from pagedkv.engine.outputs import Logprob
from pagedkv.engine.request import Request
from pagedkv.ops import native


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # Per row: {token id: Logprob} for the sampled token and the top-k, or None.
    logprobs: list[dict[int, Logprob] | None]
    sampled_logprobs: list[float | None]


@dataclass(slots=True)
class LogprobsTensors:
    """Logprobs of ``R`` rows (vLLM's shape), on the CPU: column 0 of ``token_ids`` /
    ``logprobs`` is the scored token, columns ``1..k`` the top-k (best first); ``ranks`` is
    the scored token's 1-based rank (1 + the number of strictly likelier tokens)."""

    token_ids: torch.Tensor  # [R, k + 1] int64
    logprobs: torch.Tensor  # [R, k + 1] float32
    ranks: torch.Tensor  # [R] int64

    def to_dicts(self, decode: Callable[[int], str] | None = None) -> list[dict[int, Logprob]]:
        """One dict per row: the scored token first, then the top-k not already in it (each
        top-k entry keeps its own rank, 1..k). ``decode`` fills ``decoded_token``."""
        out: list[dict[int, Logprob]] = []
        for ids, lps, rank in zip(
            self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        ):
            d = {ids[0]: Logprob(lps[0], rank, decode(ids[0]) if decode else None)}
            for r, (t, v) in enumerate(zip(ids[1:], lps[1:]), start=1):
                if t not in d:
                    d[t] = Logprob(v, r, decode(t) if decode else None)
            out.append(d)
        return out


def compute_prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> LogprobsTensors:
    """``targets[i]``'s raw logprob and rank under ``logits[i]`` (log-softmax in float32, before
    any temperature or penalty: vLLM's ``raw_logprobs``) and the top ``k`` of each row."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, targets.unsqueeze(1))
    ranks = (lp > chosen).sum(dim=-1) + 1
    if k > 0:
        top_v, top_i = lp.topk(k, dim=-1)
        ids = torch.cat([targets.unsqueeze(1), top_i], dim=1)
        vals = torch.cat([chosen, top_v], dim=1)
    else:
        ids, vals = targets.unsqueeze(1), chosen
    return LogprobsTensors(ids.cpu(), vals.cpu(), ranks.cpu())


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)  # rows of unseeded requests
        self.generators: dict[str, torch.Generator] = {}  # request id -> its seeded generator

    def remove_requests(self, request_ids: Iterable[str]) -> None:
        """Forget the generators of finished requests (a reused id starts from its seed)."""
        for rid in request_ids:
            self.generators.pop(rid, None)

    def _generator(self, req: Request) -> torch.Generator:
        if req.seed is None:
            return self.generator
        gen = self.generators.get(req.request_id)
        if gen is None:
            gen = self.generators[req.request_id] = torch.Generator().manual_seed(req.seed)
        return gen

    def __call__(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        grammar_bitmask: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """``logits[i]`` (float32, [vocab]) is the next-token distribution of ``requests[i]``;
        ``grammar_bitmask[i]`` (`StructuredOutputManager.grammar_bitmask`) the tokens it may take."""
        logits = logits.float()
        raw_logprobs = None
        if any(r.sampling_params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        penalized = any(
            r.sampling_params.needs_penalties or r.sampling_params.min_tokens for r in requests
        )
        if penalized or grammar_bitmask is not None:
            original, logits = logits, logits.clone()  # never write into the runner's logits
        if penalized:
            for i, req in enumerate(requests):
                _apply_penalties(logits[i], req)
        if grammar_bitmask is not None:
            _apply_bitmask(logits, grammar_bitmask)
            if penalized:
                _let_grammar_win(logits, original, grammar_bitmask, requests)
        greedy = [i for i, r in enumerate(requests) if r.sampling_params.is_greedy]
        tokens = torch.empty(len(requests), dtype=torch.long)
        if len(greedy) == len(requests):
            tokens = _argmax(logits)
        else:
            if greedy:
                idx = torch.tensor(greedy)
                tokens[idx] = _argmax(logits[idx])
            random = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
            self._sample_random(logits, requests, random, tokens)
        token_list = tokens.tolist()
        lps: list[dict[int, Logprob] | None] = [None] * len(requests)
        sampled: list[float | None] = [None] * len(requests)
        if raw_logprobs is not None:
            for i, req in enumerate(requests):
                k = req.sampling_params.logprobs
                if k is not None:
                    lps[i], sampled[i] = _logprobs(raw_logprobs[i], token_list[i], k)
        return SamplerOutput(token_list, lps, sampled)

    def _sample_random(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        rows: list[int],
        tokens: torch.Tensor,
    ) -> None:
        idx = torch.tensor(rows)
        x = logits[idx]
        temps = torch.tensor([requests[i].sampling_params.temperature for i in rows])
        x = x / temps.unsqueeze(1)
        top_k = [requests[i].sampling_params.top_k for i in rows]
        if any(k > 0 for k in top_k):
            x = _apply_top_k(x, top_k)
        top_p = torch.tensor([requests[i].sampling_params.top_p for i in rows])
        if (top_p < 1).any():
            x = _apply_top_p(x, top_p)
        probs = torch.softmax(x, dim=-1)
        min_p = torch.tensor([requests[i].sampling_params.min_p for i in rows])
        if (min_p > 0).any():
            keep = probs >= min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs * keep
        for j, i in enumerate(rows):
            tokens[i] = torch.multinomial(probs[j], 1, generator=self._generator(requests[i]))[0]


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy tokens of ``logits [rows, vocab]``: the native kernel on CPU float32 rows (same
    result as torch's argmax, a tenth of its time at batch 1), else torch."""
    if (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.stride(-1) == 1
        and native.available()
    ):
        return native.argmax_rows(logits)
    return logits.argmax(dim=-1)


def _apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Disallowed tokens (clear bits) become -inf, in place: the native kernel on CPU float32
    (~20 us a constrained 49,152-token row), else torch's unpack."""
    if (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.stride(-1) == 1
        and native.available()
    ):
        native.apply_token_bitmask(logits, bitmask)
        return
    vocab = logits.shape[-1]
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    logits.masked_fill_(~allowed.to(logits.device), float("-inf"))


def _let_grammar_win(
    logits: torch.Tensor, original: torch.Tensor, bitmask: torch.Tensor, requests: Sequence[Request]
) -> None:
    """A structured row left with no token (``min_tokens`` masked the stop tokens a complete
    grammar allows, the only ones it allows) is masked by its grammar alone: the output must
    parse, so the grammar wins over ``min_tokens``."""
    for i, req in enumerate(requests):
        if req.grammar is not None and torch.isneginf(logits[i]).all():
            row = original[i : i + 1].clone()
            _apply_bitmask(row, bitmask[i : i + 1])
            logits[i] = row[0]


def _apply_penalties(row: torch.Tensor, req: Request) -> None:
    p = req.sampling_params
    out_ids = req.output_token_ids
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.prompt_token_ids) | set(out_ids)), dtype=torch.long)
        vals = row[seen]
        vals = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        # An extreme (but positive) penalty overflows to inf, and sampling to NaN: stay finite.
        big = torch.finfo(row.dtype).max
        row[seen] = vals.clamp(-big, big)
    if out_ids and (p.presence_penalty or p.frequency_penalty):
        ids, counts = torch.tensor(out_ids, dtype=torch.long).unique(return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
    if req.num_output_tokens < p.min_tokens:
        stop = list(p.stop_token_ids or [])
        if req.eos_token_id is not None and not p.ignore_eos:
            stop.append(req.eos_token_id)
        if stop:
            row[torch.tensor(stop, dtype=torch.long)] = float("-inf")


def _apply_top_k(x: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    vocab = x.shape[-1]
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k])
    sorted_x = x.sort(dim=-1, descending=True).values
    kth = sorted_x.gather(1, (ks - 1).unsqueeze(1))
    return x.masked_fill(x < kth, float("-inf"))


def _apply_top_p(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_x, order = x.sort(dim=-1, descending=True)
    probs = sorted_x.softmax(dim=-1)
    # Drop a token when the tokens strictly more likely already cover top_p of the mass.
    drop = probs.cumsum(dim=-1) - probs > top_p.unsqueeze(1)
    drop[:, 0] = False
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)


def _logprobs(row: torch.Tensor, token: int, k: int) -> tuple[dict[int, Logprob], float]:
    chosen = float(row[token])
    rank = int((row > chosen).sum()) + 1
    out = {token: Logprob(chosen, rank)}
    if k > 0:
        vals, ids = row.topk(k)
        for r, (v, t) in enumerate(zip(vals.tolist(), ids.tolist()), start=1):
            out.setdefault(t, Logprob(v, r))
    return out, chosen
