"""The fleet simulator: a discrete-event loop over arrivals and replica step ends.

Events (a ``heapq`` of ``(time, seq, replica index, version)`` plus the trace's arrivals, which
are already sorted): an arrival is hashed (`hashes.PrefixHasher`), routed with the router's own
code (`pagedkv.router.scoring.RoutingPolicy` over a `pagedkv.router.index.PrefixIndex` fed from
the replicas' real KV events, and each replica's live `ReplicaLoad`) and queued on its replica;
an idle replica schedules a step at once, a replica in a decode run is cut after the step in
flight. A step end whose version is stale (the run was cut) is skipped.

Routing at scale: `RoutingPolicy.choose` scores every replica it is given, O(replicas) Python
work per request. ``route_candidates = K > 0`` gives it the K replicas holding the deepest blocks
of the prompt (`PrefixIndex.deepest_holders`) plus K replicas sampled at random (power-of-K
choices), each matched exactly (`PrefixIndex.match_replicas`), instead of all of them: a prefix
every replica holds (a shared system prompt) then costs O(K) per request, not O(replicas); 0
gives it all (exact, the `pagedkv router` behaviour). Round-robin always gets all.
"""

from __future__ import annotations

import gc
import heapq
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from pagedkv.core.kv_cache_manager import PrefixCacheStats
from pagedkv.router.index import PrefixIndex
from pagedkv.router.scoring import RoutingPolicy, RoutingWeights
from pagedkv.sim.cost import CostModel
from pagedkv.sim.hashes import PrefixHasher
from pagedkv.sim.replica import (
    HostShare,
    Replica,
    ReplicaConfig,
    SimRequest,
    handoff_request,
    make_sim_request,
)
from pagedkv.sim.report import Histogram, summarize
from pagedkv.sim.trace import TraceRequest


@dataclass(slots=True)
class FleetConfig:
    """Fleet shape and routing. ``hash_mode``: "fast" (segment hashes) or "real" (the engine's
    token hashes, ``hash_algo``). ``reply_hashes``: output blocks of a request whose trace names
    its reply segment get that segment's hashes (the next turn hits them)."""

    replicas: int = 3
    replica: ReplicaConfig = field(default_factory=ReplicaConfig)
    policy: str = "kv"
    weights: RoutingWeights = field(default_factory=RoutingWeights)
    seed: int = 0
    hash_mode: str = "fast"
    hash_algo: str = "sha256_cbor"
    route_candidates: int = 0
    reply_hashes: bool = True
    host_cores: int = 0  # > 0: all replicas share this many CPU cores (see replica.HostShare)
    # Give the router each replica's exact blocks in use (Dynamo's active blocks); False: what
    # `pagedkv router` sees (running/waiting/usage; active blocks estimated by the policy).
    exact_active_blocks: bool = False
    # PD split: the first ``pd_prefill`` replicas only prefill (routed by ``policy``), the
    # others only decode (least loaded); KV moves at ``CostModel.kv_transfer_bw_bytes_s``.
    pd_prefill: int = 0


class Fleet:
    """Replicas, index, policy, and the event loop (`run`)."""

    def __init__(self, cfg: FleetConfig, cost: CostModel) -> None:
        if cfg.replicas < 1:
            raise ValueError(f"a fleet needs at least one replica, got {cfg.replicas}")
        self.cfg = cfg
        self.cost = cost
        self.itl = Histogram()
        self.index = PrefixIndex() if cfg.policy == "kv" else None
        host = HostShare(cfg.host_cores) if cfg.host_cores > 0 else None
        self.replicas = [
            Replica(f"r{i}", cfg.replica, cost, self.index, self.itl, host)
            for i in range(cfg.replicas)
        ]
        for r in self.replicas:
            r.report_active_blocks = cfg.exact_active_blocks
        if not 0 <= cfg.pd_prefill < cfg.replicas:
            raise ValueError(
                f"pd_prefill must leave at least one decode replica, got {cfg.pd_prefill}"
                f" of {cfg.replicas}"
            )
        self.names = [r.name for r in self.replicas]
        self.decode_names: list[str] = []
        if cfg.pd_prefill:
            for r in self.replicas[: cfg.pd_prefill]:
                r.prefill_only = True
            self.decode_names = self.names[cfg.pd_prefill :]
            self.names = self.names[: cfg.pd_prefill]
            self.decode_policy = RoutingPolicy("load", seed=cfg.seed)
        self._decode_set = set(self.decode_names)
        self._transfers: dict[int, SimRequest] = {}
        self.transfer_blocks = 0
        self.by_name = {r.name: r for r in self.replicas}
        self.loads = {r.name: r.load for r in self.replicas}
        self.policy = RoutingPolicy(cfg.policy, cfg.weights, seed=cfg.seed)
        self.hasher = PrefixHasher(cfg.replica.block_size, cfg.hash_mode, cfg.hash_algo)
        self._rng = random.Random(cfg.seed)
        self.reasons: Counter[str] = Counter()
        self.events = 0
        self.cpu_s = 0.0

    def route(self, req: SimRequest) -> Replica:
        cfg = self.cfg
        names = self.names
        k = cfg.route_candidates
        if k > 0 and cfg.policy != "round-robin" and len(names) > 2 * k:
            # Power-of-K: K replicas at random + the K holding the deepest blocks, matched exactly.
            picked = set(self._rng.sample(names, k))
            matches = {}
            if self.index is not None:
                picked.update(self.index.deepest_holders(req.ext_hashes, k, self._decode_set))
                matches = self.index.match_replicas(req.ext_hashes, picked)
            names = (
                [n for n in names if n in picked]
                if len(picked) > 64
                else sorted(picked, key=lambda n: int(n[1:]))
            )
        elif self.index is None:
            matches = {}
        else:
            matches = self.index.match(req.ext_hashes)
            if self.decode_names and matches:  # PD: only prefill replicas are candidates
                matches = {n: m for n, m in matches.items() if n not in self._decode_set}
        d = self.policy.choose(
            names, len(req.ext_hashes), matches, self.loads, cfg.replica.block_size
        )
        req.predicted_hit_blocks = d.predicted_hit_blocks
        req.route_reason = d.reason
        self.reasons[d.reason] += 1
        return self.by_name[d.replica]

    def run(self, trace: list[TraceRequest], progress_s: float = 0.0) -> dict:
        """Simulate ``trace`` (sorted by arrival) to the end; returns the report (see `report`).
        ``progress_s > 0``: a progress line on stderr that often (wall seconds).

        The cyclic garbage collector is off during the run: the simulation holds millions of
        long-lived objects (blocks, requests) that a full collection would rescan again and
        again, and it makes no reference cycles worth collecting."""
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run(trace, progress_s)
        finally:
            if gc_was_enabled:
                gc.enable()

    def _run(self, trace: list[TraceRequest], progress_s: float) -> dict:
        t0 = time.perf_counter()
        next_progress = t0 + progress_s if progress_s > 0 else float("inf")
        c0 = time.process_time()
        heap: list[tuple[float, int, int, int]] = []
        seq = 0
        push = heapq.heappush
        pop = heapq.heappop
        replicas = self.replicas
        real_tokens = self.cfg.hash_mode == "real"
        ai, n = 0, len(trace)
        now = 0.0
        while ai < n or heap:
            if ai < n and (not heap or trace[ai].arrival <= heap[0][0]):
                tr = trace[ai]
                ai += 1
                now = tr.arrival
                hashes = self.hasher.hashes(tr)
                reply = self.hasher.reply_hashes(tr, tr.output_len) if self.cfg.reply_hashes else []
                req = make_sim_request(
                    tr,
                    hashes,
                    reply,
                    materialize_tokens=real_tokens,
                    external=self.index is not None,
                )
                rep = self.route(req)
                req.replica = int(rep.name[1:])
                rep.add(req)
                if not rep.busy:
                    end = rep.schedule(now)
                else:
                    end = rep.interrupt(now)
                if end is not None:
                    seq += 1
                    push(heap, (end, seq, req.replica, rep.version))
            else:
                end_t, tseq, ri, ver = pop(heap)
                rep = replicas[ri]
                now = end_t
                if ver == -1:  # a PD transfer landed: the request joins its decode replica
                    rep.add(self._transfers.pop(tseq))
                    end = rep.interrupt(now) if rep.busy else rep.schedule(now)
                    if end is not None:
                        seq += 1
                        push(heap, (end, seq, ri, rep.version))
                    self.events += 1
                    continue
                if ver != rep.version:
                    continue  # a cut decode run's old end
                rep.finish_step(now)
                end = rep.schedule(now)
                if end is not None:
                    seq += 1
                    push(heap, (end, seq, ri, rep.version))
                while rep.handoff:  # PD: prefill done, ship the KV to a decode replica
                    req = handoff_request(rep.handoff.pop())
                    d = self.decode_policy.choose(
                        self.decode_names, 0, {}, self.loads, self.cfg.replica.block_size
                    )
                    drep = self.by_name[d.replica]
                    req.replica = int(d.replica[1:])
                    blocks = -(-req.kv.num_prompt_tokens // self.cfg.replica.block_size)
                    self.transfer_blocks += blocks
                    seq += 1
                    self._transfers[seq] = req
                    drep.load.num_waiting += 1  # in flight to it: the next choice sees it
                    push(heap, (now + self.cost.transfer_time(blocks), seq, req.replica, -1))
            self.events += 1
            if not self.events & 4095 and time.perf_counter() > next_progress:
                next_progress += progress_s
                print(
                    f"[simulate] {ai}/{n} arrived, {self.events} events, sim t={now:.1f}s, "
                    f"{time.process_time() - c0:.0f}s CPU",
                    file=sys.stderr,
                    flush=True,
                )
        wall = time.perf_counter() - t0
        self.cpu_s = time.process_time() - c0
        return self.report(trace, wall)

    # ---- report -------------------------------------------------------------------------------

    def report(self, trace: list[TraceRequest], wall_s: float) -> dict:
        done: list[SimRequest] = [r for rep in self.replicas for r in rep.finished]
        pcs = PrefixCacheStats()
        # With a PD split only the prefill replicas look prompts up (decode replicas load them).
        for rep in self.replicas[: self.cfg.pd_prefill or len(self.replicas)]:
            pcs.merge(rep.mgr.total_prefix_cache_stats)
        start = min((t.arrival for t in trace), default=0.0)
        end = max((r.finish for r in done), default=start)
        span = max(end - start, 1e-9)
        out_tokens = sum(r.num_output for r in done)
        in_tokens = sum(r.trace.prompt_len for r in done)
        cost = self.cost
        overhead = cost.request_overhead_s
        rc = self.cfg.replica
        steps = sum(rep.stats.steps for rep in self.replicas)
        busy = sum(rep.stats.busy_s for rep in self.replicas)
        usage_mean = (
            (sum(rep.stats.usage_time_integral for rep in self.replicas) / busy) if busy else 0.0
        )
        tier_stored = [rep.tier.num_stored for rep in self.replicas if rep.tier is not None]
        q = pcs.queries or 1
        predicted = sum(r.predicted_hit_blocks for r in done) * rc.block_size
        return {
            "requests": {
                "total": len(trace),
                "finished": len(done),
                "length_capped": sum(rep.stats.length_capped for rep in self.replicas),
            },
            "fleet": {
                "replicas": self.cfg.replicas,
                "policy": self.cfg.policy,
                "route_candidates": self.cfg.route_candidates,
                "hash_mode": self.cfg.hash_mode,
                "replica": asdict(rc),
                "weights": asdict(self.cfg.weights),
            },
            "cost_model": cost.to_json(),
            "sim_time_s": span,
            "hit_rate": {
                "device": pcs.hits / q,
                "cpu_tier": pcs.external_hits / q,
                "total": (pcs.hits + pcs.external_hits) / q,
                "router_predicted": predicted / q,
                "queries_tokens": pcs.queries,
                "device_hit_tokens": pcs.hits,
                "cpu_tier_hit_tokens": pcs.external_hits,
                "preempted_recompute_queries": pcs.preempted_queries,
            },
            "latency_s": {
                "ttft": summarize([r.first_token - r.arrival + overhead for r in done]),
                "itl": self.itl.summary(),
                "e2e": summarize([r.finish - r.arrival + overhead for r in done]),
            },
            "throughput": {
                "requests_per_s": len(done) / span,
                "output_tokens_per_s": out_tokens / span,
                "input_tokens_per_s": in_tokens / span,
            },
            "preemptions": sum(rep.stats.preemptions for rep in self.replicas),
            "memory": {
                "device": {
                    "blocks_per_replica": rc.num_blocks,
                    "block_bytes": cost.block_bytes,
                    "capacity_bytes_per_replica": rc.num_blocks * cost.block_bytes,
                    "mean_usage_while_busy": usage_mean,
                    "peak_used_blocks_max": max(
                        rep.stats.peak_used_blocks for rep in self.replicas
                    ),
                },
                "cpu_tier": {
                    "blocks_per_replica": rc.cpu_tier_blocks,
                    "capacity_bytes_per_replica": rc.cpu_tier_blocks * cost.block_bytes,
                    "stored_blocks_mean_at_end": (sum(tier_stored) / len(tier_stored))
                    if tier_stored
                    else 0,
                    "peak_stored_blocks_max": max(
                        (rep.stats.peak_tier_blocks for rep in self.replicas), default=0
                    ),
                    "loaded_blocks": sum(rep.stats.tier_load_blocks for rep in self.replicas),
                },
            },
            "routing": dict(self.reasons),
            "pd": {
                "prefill_replicas": self.cfg.pd_prefill,
                "decode_replicas": len(self.decode_names),
                "transferred_blocks": self.transfer_blocks,
                "transferred_bytes": self.transfer_blocks * cost.block_bytes,
            }
            if self.cfg.pd_prefill
            else None,
            "per_replica_requests": [len(rep.finished) for rep in self.replicas],
            # cpu_s: this process's CPU time (the machine may be shared: wall time then overstates).
            "perf": {
                "events": self.events,
                "wall_s": wall_s,
                "cpu_s": self.cpu_s,
                "events_per_s": self.events / max(wall_s, 1e-9),
                "events_per_cpu_s": self.events / max(self.cpu_s, 1e-9),
                "engine_steps": steps,
                "decode_runs": sum(rep.stats.decode_runs for rep in self.replicas),
                "requests_per_s_wall": len(done) / max(wall_s, 1e-9),
            },
        }


def simulate(trace: list[TraceRequest], cfg: FleetConfig, cost: CostModel) -> dict:
    """Run ``trace`` through a fresh fleet; returns the JSON-able report."""
    return Fleet(cfg, cost).run(trace)
