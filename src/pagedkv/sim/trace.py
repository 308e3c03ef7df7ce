"""Traces for `pagedkv simulate`: a JSONL format and generators of realistic prefix structure.

One JSON object per line, sorted by arrival time::

    {"id": "s3-t2", "t": 1.25, "prompt_token_ids": [...], "output_len": 32}
    {"id": "s3-t2", "t": 1.25, "segments": [[17, 300], [912, 40]], "output_len": 32, "reply": 913}

``t``: arrival in seconds from the trace start. A prompt is either explicit token ids, or a list of
``[segment_id, length]`` pieces (a prefix tree: requests sharing their first segments share
those tokens). A segment's tokens are a pure function of its id (`segment_tokens`), so the same
trace gives the same tokens — and the same block hashes — in the simulator and on a real fleet.
``reply`` (optional) names the segment the model's answer is: the next turn of a chat re-sends
it, so the simulator gives the request's output blocks that segment's hashes (a real engine
generating exactly those tokens would cache them the same way). Without it output blocks get
hashes no prompt can match.

Generators (`GENERATORS`): ``chat`` (multi-turn chat sessions over a few shared system prompts),
``system-prompt`` (single-turn requests over Zipf-popular shared system prompts), ``agentic``
(tool loops: a growing context, short think times, small outputs). All take a seed and are
deterministic.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

Segment = tuple[int, int]  # (segment id, length in tokens)

# Token ids of synthetic segments: inside SmolLM2's vocabulary, clear of its special tokens.
TOKEN_LOW, TOKEN_HIGH = 1000, 40000


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace. Exactly one of ``prompt_token_ids`` / ``segments`` is set."""

    request_id: str
    arrival: float
    output_len: int
    prompt_token_ids: list[int] | None = None
    segments: list[Segment] | None = None
    reply: int | None = None  # segment id of the answer (re-sent by the next turn)
    session: str | None = None

    @property
    def prompt_len(self) -> int:
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        return sum(n for _, n in self.segments or ())

    def token_ids(self) -> list[int]:
        """The prompt as token ids (materializing segments)."""
        if self.prompt_token_ids is not None:
            return self.prompt_token_ids
        return materialize(self.segments or [])

    def to_json(self) -> dict:
        d: dict = {
            "id": self.request_id,
            "t": round(self.arrival, 6),
            "output_len": self.output_len,
        }
        if self.prompt_token_ids is not None:
            d["prompt_token_ids"] = self.prompt_token_ids
        else:
            d["segments"] = [list(s) for s in self.segments or ()]
        if self.reply is not None:
            d["reply"] = self.reply
        if self.session is not None:
            d["session"] = self.session
        return d

    @staticmethod
    def from_json(d: dict) -> TraceRequest:
        segs = d.get("segments")
        return TraceRequest(
            str(d["id"]),
            float(d["t"]),
            int(d["output_len"]),
            d.get("prompt_token_ids"),
            None if segs is None else [(int(a), int(b)) for a, b in segs],
            d.get("reply"),
            d.get("session"),
        )


_segment_cache: dict[int, list[int]] = {}


def segment_tokens(seg_id: int, length: int) -> list[int]:
    """The first ``length`` tokens of segment ``seg_id``: deterministic, any process."""
    toks = _segment_cache.get(seg_id)
    if toks is None or len(toks) < length:
        rng = random.Random(seg_id * 2654435761 + 12345)
        toks = [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(max(length, 64))]
        if len(_segment_cache) < 100_000:
            _segment_cache[seg_id] = toks
    return toks[:length]


def materialize(segments: Iterable[Segment]) -> list[int]:
    out: list[int] = []
    for seg_id, length in segments:
        out.extend(segment_tokens(seg_id, length))
    return out


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> int:
    n = 0
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")
            n += 1
    return n


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Read a JSONL trace; requests come back sorted by arrival (stable)."""
    with open(path) as f:
        reqs = [TraceRequest.from_json(json.loads(line)) for line in f if line.strip()]
    reqs.sort(key=lambda r: r.arrival)
    return reqs


# ---------------------------------------------------------------------------------- generators


@dataclass(slots=True)
class _Ids:
    next_id: int = 1_000_000

    def new(self) -> int:
        self.next_id += 1
        return self.next_id


def _zipf_cdf(n: int, s: float) -> list[float]:
    w = [1.0 / (k + 1) ** s for k in range(n)]
    total = sum(w)
    acc, cdf = 0.0, []
    for x in w:
        acc += x / total
        cdf.append(acc)
    return cdf


def _pick(rng: random.Random, cdf: list[float]) -> int:
    import bisect

    return min(bisect.bisect_left(cdf, rng.random()), len(cdf) - 1)


def _around(rng: random.Random, mean: int) -> int:
    """A length near ``mean`` (uniform in [mean/2, 3mean/2]), at least 1."""
    return max(1, int(rng.uniform(0.5, 1.5) * mean))


def _session(
    rng: random.Random,
    ids: _Ids,
    session: str,
    step_tag: str,
    t: float,
    segs: list[Segment],
    n: int,
    new_segment: Callable[[int], Segment | None],
    output_len: int,
    gap: float,
) -> list[TraceRequest]:
    """``n`` calls of one session from ``t``: call k re-sends ``segs`` plus ``new_segment(k)``
    (None: nothing new), and its reply joins the context of call k+1; calls are ``gap``
    (exponential mean; 0: none) apart."""
    out = []
    for k in range(n):
        seg = new_segment(k)
        if seg is not None:
            segs = segs + [seg]
        reply = ids.new()
        olen = _around(rng, output_len)
        out.append(
            TraceRequest(
                f"{session}-{step_tag}{k}",
                t,
                olen,
                segments=list(segs),
                reply=reply,
                session=session,
            )
        )
        segs = segs + [(reply, olen)]
        t += rng.expovariate(1.0 / gap) if gap > 0 else 0.0
    return out


def gen_chat(
    num_requests: int,
    rate: float,
    seed: int = 0,
    *,
    num_system_prompts: int = 4,
    system_len: int = 256,
    turns: int = 4,
    user_len: int = 64,
    output_len: int = 64,
    think_time: float = 5.0,
    zipf_s: float = 1.0,
) -> list[TraceRequest]:
    """Multi-turn chat: sessions start as a Poisson process (``rate / turns`` sessions/s, so
    requests arrive at about ``rate``/s). Each session picks a system prompt (Zipf) and runs
    ``turns`` turns: turn k's prompt is the system prompt, every earlier user message and reply,
    and a new user message; turns are ``think_time`` (exponential mean) apart after arrival."""
    rng = random.Random(seed)
    ids = _Ids(seed * 10_000_000 + 1_000_000)
    systems = [(ids.new(), system_len) for _ in range(num_system_prompts)]
    cdf = _zipf_cdf(num_system_prompts, zipf_s)
    out: list[TraceRequest] = []
    t, s = 0.0, 0
    session_rate = rate / turns
    while len(out) < num_requests:
        t += rng.expovariate(session_rate)
        out += _session(
            rng,
            ids,
            f"s{s}",
            "t",
            t,
            [systems[_pick(rng, cdf)]],
            turns,
            lambda k: (ids.new(), _around(rng, user_len)),
            output_len,
            think_time,
        )
        s += 1
    out.sort(key=lambda r: r.arrival)
    return out[:num_requests]


def gen_system_prompt(
    num_requests: int,
    rate: float,
    seed: int = 0,
    *,
    num_system_prompts: int = 100,
    system_len: int = 1024,
    user_len: int = 128,
    output_len: int = 128,
    zipf_s: float = 1.1,
) -> list[TraceRequest]:
    """Single-turn requests: a system prompt drawn by Zipf(``zipf_s``) popularity from
    ``num_system_prompts``, then a unique user message. Poisson arrivals at ``rate``/s."""
    rng = random.Random(seed)
    ids = _Ids(seed * 10_000_000 + 5_000_000)
    systems = [(ids.new(), system_len) for _ in range(num_system_prompts)]
    cdf = _zipf_cdf(num_system_prompts, zipf_s)
    out, t = [], 0.0
    for i in range(num_requests):
        t += rng.expovariate(rate)
        segs = [systems[_pick(rng, cdf)], (ids.new(), _around(rng, user_len))]
        out.append(TraceRequest(f"r{i}", t, _around(rng, output_len), segments=segs))
    return out


def gen_agentic(
    num_requests: int,
    rate: float,
    seed: int = 0,
    *,
    num_system_prompts: int = 8,
    system_len: int = 2048,
    task_len: int = 256,
    tool_len: int = 512,
    steps: int = 8,
    output_len: int = 48,
    tool_time: float = 1.0,
) -> list[TraceRequest]:
    """Agentic tool loops: a task (system prompt + task) then ``steps`` model calls; each call
    re-sends the whole context plus the last tool result; the model's (short) answer is the next
    tool call. Calls of one loop are ``tool_time`` (exponential mean) apart after arrival."""
    rng = random.Random(seed)
    ids = _Ids(seed * 10_000_000 + 8_000_000)
    systems = [(ids.new(), system_len) for _ in range(num_system_prompts)]
    cdf = _zipf_cdf(num_system_prompts, 1.0)
    out: list[TraceRequest] = []
    t, s = 0.0, 0
    while len(out) < num_requests:
        t += rng.expovariate(rate / steps)
        first: list[Segment] = [systems[_pick(rng, cdf)], (ids.new(), _around(rng, task_len))]
        out += _session(
            rng,
            ids,
            f"a{s}",
            "k",
            t,
            first,
            steps,
            lambda k: (ids.new(), _around(rng, tool_len)) if k else None,
            output_len,
            tool_time,
        )
        s += 1
    out.sort(key=lambda r: r.arrival)
    return out[:num_requests]


GENERATORS: dict[str, Callable[..., list[TraceRequest]]] = {
    "chat": gen_chat,
    "system-prompt": gen_system_prompt,
    "agentic": gen_agentic,
}


def iter_segment_ids(requests: Iterable[TraceRequest]) -> Iterator[int]:
    for r in requests:
        for seg_id, _ in r.segments or ():
            yield seg_id


__all__ = [
    "TraceRequest",
    "Segment",
    "GENERATORS",
    "gen_chat",
    "gen_system_prompt",
    "gen_agentic",
    "read_trace",
    "write_trace",
    "materialize",
    "segment_tokens",
]
