"""What the router's parts share: `RouterOptions` (the command's flags), `RouterState` (replicas,
index, policy, metrics; ``app.state.router``) and `RouterConfigError`."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pagedkv.router.index import PrefixIndex
from pagedkv.router.metrics import RouterMetrics
from pagedkv.router.replica import Replica, ReplicaConfig
from pagedkv.router.scoring import RoutingPolicy, RoutingWeights
from pagedkv.router.tokens import PromptTokenizer

CONFIG_PATH = "/v1/kv_cache_config"


class RouterConfigError(ValueError):
    """The replicas cannot be routed together (see the module docstring)."""


@dataclass(slots=True)
class RouterOptions:
    policy: str = "kv"
    weights: RoutingWeights = field(default_factory=RoutingWeights)
    health_interval: float = 1.0  # seconds between /metrics scrapes
    timeout: float = 600.0  # longest wait for a replica's next bytes
    startup_timeout: float = 60.0  # how long to wait for every replica's config at start
    sync_timeout: float = 10.0  # how long to wait for a replica's first replay
    tokenizer: str | None = None  # default: the reference replica's model_path
    # What a replica does not report (vLLM: the hash seed, maybe more), or must agree with.
    block_size: int | None = None
    hash_algo: str | None = None
    hash_seed: str | None = None  # the vLLM replicas' PYTHONHASHSEED
    cooldown: float = 5.0  # PD mode: a failed decode instance is skipped this long
    seed: int = 0


@dataclass(slots=True)
class RouterState:
    """What the routes and the health loop share (``app.state.router``)."""

    replicas: dict[str, Replica]
    reference: ReplicaConfig
    tokenizer: PromptTokenizer
    policy: RoutingPolicy
    options: RouterOptions
    index: PrefixIndex
    lock: threading.Lock
    metrics: RouterMetrics
    client: Any = None  # httpx.AsyncClient (opened by the app)
    decode: Any = None  # PD mode: the `pagedkv.forwarding.InstancePool` of decode instances
    decisions: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=1000))

    @property
    def block_size(self) -> int:
        return self.reference.block_size

    def up(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.up]
