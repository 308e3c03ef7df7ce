"""One replica as the router sees it: its address and event endpoints (``--replica`` specs), its
KV cache configuration (``GET /v1/kv_cache_config``), its liveness and load.

A replica is a pagedkv server (``GET /v1/kv_cache_config``) or a vLLM server (no such route:
`vllm_replica.config_from_vllm` reads its ``/metrics`` and ``/v1/models``, and the router's
flags fill in the rest). It is *compatible* with the router's reference configuration (the
first replica's) when they agree on every field of `MUST_AGREE`: otherwise the router would hash
prompts differently from the replica's events (block size, algorithm, seed) or tokenize them
differently (model, tokenizer and chat template), and every prediction for it would be wrong.
The model and tokenizer identities are compared where both replicas report one (vLLM does not;
the router's ``--tokenizer`` is then what both are hashed with). Such a replica is
refused: at start the router exits with the differing fields; later (a replica restarted with
other flags) it stays out of rotation and ``/router/state`` says why.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from pagedkv.router.scoring import ReplicaLoad

MUST_AGREE = ("block_size", "hash_algo", "hash_seed", "model_identity", "tokenizer")
IF_REPORTED = ("model_identity", "tokenizer")  # compared only when both replicas report them


@dataclass(slots=True, frozen=True)
class ReplicaSpec:
    """``URL[,events=tcp://HOST:PORT][,replay=tcp://HOST:PORT]``: endpoints given here override
    what the replica reports (for NAT, or a server started with endpoints the router cannot
    reach as printed)."""

    url: str
    events: str | None = None
    replay: str | None = None

    @classmethod
    def parse(cls, text: str) -> ReplicaSpec:
        url, *opts = [p.strip() for p in text.split(",")]
        if not re.fullmatch(r"https?://[^/\s,]+/?", url):
            raise ValueError(f"invalid replica URL {url!r}: use http://host:port")
        kw: dict[str, str] = {}
        for opt in opts:
            key, sep, value = opt.partition("=")
            if (
                not sep
                or key not in ("events", "replay")
                or not value.startswith(("tcp://", "ipc://"))
            ):
                raise ValueError(
                    f"invalid replica option {opt!r} in {text!r}: use events=tcp://HOST:PORT "
                    f"or replay=tcp://HOST:PORT"
                )
            kw[key] = value
        return cls(url.rstrip("/"), **kw)


@dataclass(slots=True, frozen=True)
class ReplicaConfig:
    """A replica's answer to ``GET /v1/kv_cache_config`` (the fields the router uses), or
    what a vLLM replica publishes (``kind="vllm"``; None where it says nothing)."""

    block_size: int
    hash_algo: str
    hash_seed: str | None
    model: str
    model_path: str
    model_identity: str | None
    tokenizer: str | None
    num_blocks: int
    enable_prefix_caching: bool
    events: str | None
    replay: str | None
    started: float | None = None  # the server's start time: a new value means a restart
    kind: str = "pagedkv"  # or "vllm"

    @classmethod
    def from_json(cls, d: dict[str, Any], spec: ReplicaSpec) -> ReplicaConfig:
        ev = d.get("kv_events") or {}
        host = urlsplit(spec.url).hostname or "127.0.0.1"
        return cls(
            int(d["block_size"]),
            str(d["hash_algo"]),
            str(d["hash_seed"]),
            str(d["model"]),
            str(d["model_path"]),
            str(d["model_identity"]),
            d.get("tokenizer"),
            int(d["num_blocks"]),
            bool(d.get("enable_prefix_caching", True)),
            spec.events or reachable(ev.get("endpoint"), host),
            spec.replay or reachable(ev.get("replay_endpoint"), host),
            d.get("started"),
        )

    def differences(self, ref: ReplicaConfig) -> list[str]:
        """``"field: mine != reference"`` for every `MUST_AGREE` field that differs."""
        return [
            f"{k}: {getattr(self, k)!r} != {getattr(ref, k)!r}"
            for k in MUST_AGREE
            if getattr(self, k) != getattr(ref, k)
            and not (k in IF_REPORTED and None in (getattr(self, k), getattr(ref, k)))
        ]


def reachable(endpoint: str | None, host: str) -> str | None:
    """A bound endpoint as a subscriber must connect to it: a wildcard host (``*``, 0.0.0.0,
    ``::``) becomes the replica's own host."""
    if endpoint is None:
        return None
    return re.sub(r"^tcp://(\*|0\.0\.0\.0|\[::\]|::):", f"tcp://{host}:", endpoint)


@dataclass(slots=True)
class Replica:
    """Runtime state of one replica. ``up``: answering and indexed; ``refused``: answering but
    incompatible (the reason).

    Load = its last /metrics scrape (``load``, taken every health interval) corrected by what
    the router did since: ``delta_requests``/``delta_blocks`` count the requests (and their
    prompt blocks) the router sent there since the scrape minus those that finished since. So a
    request that finished after a scrape stops counting at once, and a burst sent between two
    scrapes counts at once; traffic that bypasses the router still shows at the next scrape."""

    spec: ReplicaSpec
    config: ReplicaConfig | None = None
    up: bool = False
    refused: str | None = None
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    inflight: int = 0  # the router's requests on it now
    delta_requests: int = 0
    delta_blocks: int = 0
    feed: Any = None  # its `EventFeed` while up
    # Held while it is probed (and brought up or taken down): one transition at a time, so a
    # health probe and a failover probe never start two feeds.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def url(self) -> str:
        return self.spec.url

    def scraped(self, load: ReplicaLoad) -> None:
        """A new /metrics scrape: it already counts everything sent and finished so far."""
        if self.config is not None:
            load.active_blocks = round(load.kv_usage * self.config.num_blocks)
        self.load, self.delta_requests, self.delta_blocks = load, 0, 0

    def started(self, blocks: int) -> None:
        self.inflight += 1
        self.delta_requests += 1
        self.delta_blocks += blocks

    def finished(self, blocks: int) -> None:
        self.inflight -= 1
        self.delta_requests -= 1
        self.delta_blocks -= blocks

    def current_load(self) -> ReplicaLoad:
        """The scraped load corrected by the router's deltas (see the class docstring)."""
        ld = self.load
        return ReplicaLoad(
            max(0, ld.num_running + self.delta_requests),
            ld.num_waiting,
            ld.kv_usage,
            max(0, ld.active_blocks + self.delta_blocks),
        )
