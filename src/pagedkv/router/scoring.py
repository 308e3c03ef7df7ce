"""Routing policies: which replica gets a request.

``kv`` (Dynamo's KV router cost, vLLM-router's cache-aware idea): for each replica

    hit      = device_blocks + tier_credit * tier_blocks          (capped at the prompt's blocks)
    prefill  = prompt_blocks - hit                                 (blocks it must compute)
    decode   = active_blocks + num_waiting * prompt_blocks + prompt_blocks
    cost     = overlap * prefill + load * decode

and the lowest cost wins (``temperature > 0``: sampled with probability ∝ exp(-(cost - min) / T)).
``active_blocks`` is the replica's blocks held by running requests; when unknown (0 while
requests run) it is estimated as ``num_running * prompt_blocks``. Equal costs go to the longer
cached prefix (same load estimate, less to compute), then round-robin, so a cold start spreads
requests. Reason labels: ``kv_hit`` (the winner holds the longest cached prefix), ``load`` (no
replica holds one: the load term decided), ``load_over_prefix`` (a longer prefix was elsewhere
but its replica's load outweighed it), ``only_replica``.

``load``: fewest ``num_running + num_waiting``, then lowest ``kv_usage``, ties round-robin
(reason ``load``). ``round-robin``: the next replica in order (reason ``round_robin``).

All of it is pure and deterministic for a given ``seed``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.router.index import PrefixMatch

POLICIES = ("kv", "load", "round-robin")


@dataclass(slots=True)
class ReplicaLoad:
    """A replica's load, from its /metrics (and the router's own in-flight count)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # 0..1
    active_blocks: int = 0  # blocks held by running requests if known, else 0


@dataclass(slots=True)
class RoutingWeights:
    """The ``pagedkv router`` weight flags (Dynamo's defaults)."""

    overlap: float = (
        1.0  # Dynamo overlap_score_weight: cost = overlap * prefill_blocks + decode_blocks
    )
    tier_credit: float = 0.75  # a tier-held block counts this fraction of a device block
    load: float = 1.0  # weight of the decode/load term
    temperature: float = 0.0  # 0: argmin; > 0 softmax sampling over -cost


@dataclass(slots=True)
class RoutingDecision:
    replica: str
    reason: str  # "kv_hit" | "load" | "load_over_prefix" | "round_robin" | "only_replica" (a metric label)
    predicted_hit_blocks: int  # blocks the router expects the replica to hit (device + tier)
    cost: float = 0.0


def kv_cost(
    prompt_blocks: int, match: PrefixMatch | None, load: ReplicaLoad, weights: RoutingWeights
) -> float:
    """The ``kv`` policy's cost of one replica (see the module docstring), in blocks."""
    hit = 0.0
    if match is not None:
        hit = min(
            float(prompt_blocks), match.device_blocks + weights.tier_credit * match.tier_blocks
        )
    active = load.active_blocks
    if active == 0 and load.num_running > 0:
        active = load.num_running * prompt_blocks
    decode = active + load.num_waiting * prompt_blocks + prompt_blocks
    return weights.overlap * (prompt_blocks - hit) + weights.load * decode


class RoutingPolicy:
    """policy in {"kv", "load", "round-robin"}; stateful (round-robin cursor, RNG for temperature)."""

    def __init__(self, policy: str, weights: RoutingWeights | None = None, seed: int = 0) -> None:
        if policy not in POLICIES:
            raise ValueError(
                f"unknown routing policy {policy!r}; choose one of {', '.join(POLICIES)}"
            )
        self.policy = policy
        self.weights = weights or RoutingWeights()
        if self.weights.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.weights.temperature}")
        self._rng = random.Random(seed)
        self._cursor = 0

    def choose(
        self,
        replicas: Sequence[str],
        prompt_blocks: int,
        matches: dict[str, PrefixMatch],
        loads: dict[str, ReplicaLoad],
        block_size: int,
    ) -> RoutingDecision:
        """Pick one of ``replicas`` (non-empty) for a prompt of ``prompt_blocks`` full blocks.
        ``matches``/``loads`` may lack replicas (no prefix held / load unknown: zero).
        ``block_size`` is part of the interface for block-size-aware policies; these three work
        in blocks and do not need it."""
        if not replicas:
            raise ValueError("no replica to route to")
        start = self._cursor % len(replicas)
        self._cursor += 1
        order = [replicas[(start + i) % len(replicas)] for i in range(len(replicas))]

        def hit(r: str) -> int:
            m = matches.get(r)
            return m.total_blocks if m is not None else 0

        if len(replicas) == 1:
            return RoutingDecision(replicas[0], "only_replica", hit(replicas[0]))
        if self.policy == "round-robin":
            return RoutingDecision(order[0], "round_robin", hit(order[0]))
        if self.policy == "load":

            def key(r: str) -> tuple[int, float]:
                ld = loads.get(r) or ReplicaLoad()
                return ld.num_running + ld.num_waiting, ld.kv_usage

            best = min(order, key=key)  # min keeps the first of equals: round-robin ties
            return RoutingDecision(best, "load", hit(best))
        costs = {
            r: kv_cost(prompt_blocks, matches.get(r), loads.get(r) or ReplicaLoad(), self.weights)
            for r in order
        }
        if self.weights.temperature > 0:
            lo = min(costs.values())
            ws = [math.exp(-(costs[r] - lo) / self.weights.temperature) for r in order]
            best = self._rng.choices(order, weights=ws)[0]
        else:  # equal costs: the longer prefix (the same load estimate, less to compute), then round-robin
            best = min(order, key=lambda r: (round(costs[r], 9), -hit(r)))
        longest = max(hit(r) for r in order)
        reason = (
            "load" if longest == 0 else "kv_hit" if hit(best) == longest else "load_over_prefix"
        )
        return RoutingDecision(best, reason, hit(best), costs[best])
