"""A simulated replica: the real KV memory system, a modelled forward pass.

What is real: `pagedkv.core.KVCacheManager` (its `BlockPool`, prefix cache, LRU eviction, KV
events and `PrefixCacheStats`) with the requests' real block hashes, and, with a CPU tier, the
real `pagedkv.offload.cpu_manager.CPUOffloadingManager` (torch-free) keyed like the engine's
offloading connector (`make_offload_key(block hash)`, one chunk per block).

What is modelled: the forward pass (a `CostModel` gives each step's duration) and the sampled
tokens (placeholders; an output block gets the hash of the trace's reply segment when known, else
a hash no prompt can match).

Scheduling is the engine's own code: `Replica` is a `pagedkv.core.scheduling.SchedulingPolicy`,
the class `pagedkv.engine.scheduler.Scheduler` also derives from, so every decision is the
engine's: RUNNING requests first within the token budget (decode token or next prefill chunk),
preempting the most recently admitted running request when the pool is full (recompute: its
blocks are freed, it goes back to the head of the queue); then, only in a step without
preemption, WAITING requests in strict FCFS order up to ``max_num_seqs``, each admitted only if
its whole sequence fits (``full_sequence_must_fit``); a request alone in the pool that still
cannot grow stops (length-capped). The replica supplies the hooks: the external tokens of an
admission are a PD transfer's prompt or a CPU-tier lookup of the blocks after the prefix hit
(a synchronous load, its time added to the step), a preemption or stop offers the blocks to
the tier and counts.

Tier stores follow the connector's BLOCK_LEVEL policy at coarser grain: a request's registered
full blocks are offered to the tier when its prefill completes, when it finishes and when it is
preempted (the engine offers them each step as they fill; stores are asynchronous there and
cost no step time here).

Speed: a step whose batch is only decodes, with no admission and no preemption, repeats with
the same requests until one finishes; `schedule` runs such a stretch as one "decode run" of
``k`` steps, bounded so the free blocks cover every block the run allocates (so no allocation
can fail and no one is preempted, as in single steps: nothing is freed during a run). At its
end (`finish_step`) each request gets its tokens and one `allocate_slots` covering the run:
the pool then holds exactly what ``k`` single steps leave (the same free-queue blocks evicted,
the same blocks registered), so any admission after it sees the same cache; only the
evictions' and registrations' *timing* inside the run is coarser (the router's index sees them
at the run's end). An arrival during a run truncates it after the step in flight (`interrupt`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.core.kv_cache_manager import KVCacheManager
from pagedkv.core.request import KVCacheRequest, RequestStatus
from pagedkv.core.scheduling import Chunk, SchedulingPolicy
from pagedkv.core.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pagedkv.engine.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
)
from pagedkv.offload.base import LookupResult, make_offload_key
from pagedkv.offload.cpu_manager import CPUOffloadingManager
from pagedkv.router.hashing import to_external
from pagedkv.router.index import PrefixIndex
from pagedkv.router.scoring import ReplicaLoad
from pagedkv.sim.cost import CostModel
from pagedkv.sim.report import Histogram
from pagedkv.sim.trace import TraceRequest

_UNIQUE_BASE = 1 << 63


@dataclass(slots=True)
class ReplicaConfig:
    """Shape of one replica (the engine's flags of the same names)."""

    num_blocks: int = 4096  # KV pool blocks, the null block included
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int = 32768
    cpu_tier_blocks: int = 0  # CPU offload tier capacity in blocks (0: none)
    enable_caching: bool = True
    decode_runs: bool = True  # run repeated all-decode steps as one event (same result, faster)
    # Ranks of this replica (`-tp N`). A TP engine is one replica: one scheduler, one pool
    # (``num_blocks``: what `pagedkv plan -tp N` prints), one router target; on a shared host
    # (`HostShare`) it occupies N cores while it steps. Calibrate its cost model against the TP
    # engine itself (``pagedkv sim calibrate``): collectives are in its step times.
    tensor_parallel_size: int = 1


@dataclass(slots=True, eq=False)
class SimRequest:
    """A trace request in flight. Times are simulated seconds."""

    trace: TraceRequest
    kv: KVCacheRequest
    ext_hashes: list[int]  # prompt block hashes as the router keys them
    reply_hashes: list[bytes]  # hashes for output blocks (may be shorter than needed)
    arrival: float
    output_len: int
    replica: int = -1
    first_token: float = -1.0
    last_token: float = -1.0
    finish: float = -1.0
    hit_tokens: int = -1  # device prefix hit at first admission
    tier_tokens: int = 0  # tokens loaded from the CPU tier at first admission
    predicted_hit_blocks: int = 0
    offered_blocks: int = 0  # blocks offered to the CPU tier so far
    route_reason: str = ""
    pd_external: int = 0  # PD split: prompt tokens whose KV arrives from the prefill replica
    num_output: int = 0  # output tokens when finished (its KVCacheRequest is dropped then)


@dataclass(slots=True)
class ReplicaStats:
    steps: int = 0
    decode_runs: int = 0
    busy_s: float = 0.0
    preemptions: int = 0
    length_capped: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    tier_load_blocks: int = 0
    usage_time_integral: float = 0.0  # sum of kv usage * step time (for the mean)
    peak_used_blocks: int = 0
    peak_tier_blocks: int = 0


@dataclass(slots=True)
class HostShare:
    """Replicas sharing ``cores`` CPU cores (a CPU-engine fleet on one host, as in the validation
    against a real fleet): a step starting while ``busy`` replicas compute takes
    ``max(1, busy / cores)`` times longer (processor sharing, sampled at the step's start)."""

    cores: int
    busy: int = 0

    def factor(self) -> float:
        return max(1.0, self.busy / self.cores)


class Replica(SchedulingPolicy[SimRequest]):
    """One simulated engine, scheduled by the engine's own `SchedulingPolicy`. The fleet calls
    `add` on arrival, `schedule` when idle or after a step, `finish_step` at the step's end and
    `interrupt` when an arrival lands during a decode run. ``index`` (optional) receives this
    replica's KV events as they happen."""

    def __init__(
        self,
        name: str,
        cfg: ReplicaConfig,
        cost: CostModel,
        index: PrefixIndex | None = None,
        itl: Histogram | None = None,
        host: HostShare | None = None,
    ) -> None:
        self.name = name
        self.host = host
        self.cfg = cfg
        self.cost = cost
        self.index = index
        spec = FullAttentionSpec(
            block_size=cfg.block_size, num_kv_heads=1, head_size=1, dtype="float16"
        )
        kv_cfg = KVCacheConfig(
            cfg.num_blocks,
            [KVCacheGroupSpec(["sim"], spec)],
            cost.block_bytes or spec.page_size_bytes,
        )
        self.mgr = KVCacheManager(
            kv_cfg,
            cfg.max_model_len,
            enable_caching=cfg.enable_caching,
            enable_kv_cache_events=index is not None,
        )
        self._blocks_of = self.mgr.coordinator.single_type_managers[0].req_to_blocks
        self._num_cached = self.mgr.coordinator.single_type_managers[0].num_cached_block
        super().__init__(self.mgr, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len)
        self._now = 0.0  # the time `schedule` runs at (for the hooks)
        self._load_blocks = 0  # tier blocks loaded by this step's admissions
        self._ext_keys: list[bytes] = []  # the tier hits of the admission being decided
        self.tier = (
            CPUOffloadingManager(cfg.cpu_tier_blocks, enable_events=index is not None)
            if cfg.cpu_tier_blocks > 0
            else None
        )
        self.load = ReplicaLoad()
        # The router reads num_running / num_waiting / kv_usage from /metrics; active_blocks only
        # when told (else 0: `kv_cost` estimates it from num_running).
        self.report_active_blocks = False
        self.stats = ReplicaStats()
        self.itl = itl if itl is not None else Histogram()
        self.finished: list[SimRequest] = []
        # PD split: a prefill replica stops requests after their first token and hands them
        # over (`handoff`, drained by the fleet) instead of finishing them.
        self.prefill_only = False
        self.handoff: list[SimRequest] = []
        # The step in flight: its batch, start, per-step time, number of steps (decode run).
        self.batch: list[Chunk[SimRequest]] = []
        self.busy = False
        self.version = 0
        self.step_start = 0.0
        self.step_dt = 0.0
        self.step_k = 0
        self._unique = 0

    # ---- arrivals ----------------------------------------------------------------------------

    def add(self, req: SimRequest) -> None:
        self.waiting.append(req)
        self.load.num_waiting = len(self.waiting)

    def interrupt(self, now: float) -> float | None:
        """An arrival at ``now`` during a decode run: cut the run after the step in flight.
        Returns the new end time, or None when nothing changes."""
        if not self.busy or self.step_k <= 1:
            return None
        done = int((now - self.step_start) / self.step_dt) + 1
        if done >= self.step_k:
            return None
        self.step_k = done
        self.version += 1
        return self.step_start + done * self.step_dt

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self, now: float) -> float | None:
        """Build the next batch with the engine's policy (`SchedulingPolicy.build_batch`, see
        the module docstring); returns the time it ends, or None when there is nothing to run."""
        cfg = self.cfg
        self._now = now
        self._load_blocks = 0
        plan = self.build_batch()
        preempted, admitted = bool(plan.preempted), plan.num_admitted > 0
        load_blocks = self._load_blocks
        self.stats.tier_load_blocks += load_blocks
        self._update_load()
        self._drain_events()
        if not plan.chunks:
            return None
        batch = list(plan.chunks.values())
        prefill = decode = ctx = 0
        for s in batch:
            kv = s.request.kv
            kv.num_computed_tokens = end = s.start + s.n
            ctx += end
            if s.n == 1 and kv.num_output_tokens and s.start == kv.num_tokens - 1:
                decode += 1
            else:
                prefill += s.n
        k = 1
        if (
            cfg.decode_runs
            and self.host is None
            and decode == len(batch)
            and not preempted
            and not admitted
        ):
            k = self._decode_run_length(batch)
        if k > 1:
            dt = self.cost.decode_run_time(decode, ctx, k) / k
            self.stats.decode_runs += 1
        else:
            dt = self.cost.step_time(prefill, decode, ctx) + self.cost.load_time(load_blocks)
        if self.host is not None:
            self.host.busy += cfg.tensor_parallel_size
            dt *= self.host.factor()
        self.stats.prefill_tokens += prefill
        self.batch = batch
        self.busy = True
        self.version += 1
        self.step_start, self.step_dt, self.step_k = now, dt, k
        return now + dt * k

    def _decode_run_length(self, batch: list[Chunk[SimRequest]]) -> int:
        """Steps this all-decode batch repeats with the same requests: until one reaches its
        output length or ``max_model_len``, and no longer than the pool's free blocks cover the
        blocks the run's later steps allocate (so none of those allocations can fail, as none
        would have in single steps: no block is freed during the run)."""
        max_len = self.cfg.max_model_len
        k = 1 << 30
        for s in batch:
            kv = s.request.kv
            k = min(k, s.request.output_len - kv.num_output_tokens, max_len - kv.num_tokens)
        if k <= 1:
            return 1
        free = self.mgr.block_pool.get_num_free_blocks()
        if self._run_blocks(batch, k) <= free:
            return k
        lo, hi = 1, k  # _run_blocks(lo) == 0 <= free < _run_blocks(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._run_blocks(batch, mid) <= free:
                lo = mid
            else:
                hi = mid
        return lo

    def _run_blocks(self, batch: list[Chunk[SimRequest]], k: int) -> int:
        """New blocks the steps 2..k of a decode run allocate (step 1 already did)."""
        bs, blocks_of = self.cfg.block_size, self._blocks_of
        return sum(
            max(0, -(-(s.start + k) // bs) - len(blocks_of[s.request.kv.request_id])) for s in batch
        )

    # ---- the policy's hooks (`SchedulingPolicy`): what its decisions do to a `SimRequest` -------

    def _kv_request(self, item: SimRequest) -> KVCacheRequest:
        return item.kv

    def _external_tokens(self, req: SimRequest, num_hit: int) -> tuple[int, bool]:
        """The connector's answer, modelled: a PD split's transferred prompt, else the CPU
        tier's consecutive hits after the device hit (loaded synchronously, its time added to
        the step). The keys are kept for `_allocated`."""
        self._ext_keys = ext_keys = []
        if req.pd_external:  # its prompt's KV comes from the prefill replica
            return max(0, req.pd_external - num_hit), False
        if self.tier is not None:
            kv, bs = req.kv, self.cfg.block_size
            last = (kv.num_tokens - 1) // bs  # leave the last token to compute
            for h in kv.block_hashes[num_hit // bs : last]:
                key = make_offload_key(h)
                if self.tier.peek(key) is not LookupResult.HIT:
                    break
                ext_keys.append(key)
        return len(ext_keys) * self.cfg.block_size, False

    def _allocated(self, req: SimRequest, num_hit: int, num_ext: int, load_async: bool) -> bool:
        ext_keys = self._ext_keys
        if ext_keys:
            self.tier.touch(ext_keys)  # type: ignore[union-attr]
            self.tier.stats.hits += len(ext_keys)  # type: ignore[union-attr]
            self._load_blocks += len(ext_keys)
            self._ext_keys = []
        req.pd_external = 0  # a later preemption recomputes locally
        if req.hit_tokens < 0:
            req.hit_tokens, req.tier_tokens = num_hit, num_ext
        return True

    def _stop_cache_exhausted(self, req: SimRequest) -> None:
        self._stop(req, self._now, RequestStatus.FINISHED_LENGTH_CAPPED)

    def finish_step(self, now: float) -> list[SimRequest]:
        """The step (or decode run of ``step_k`` steps) in flight ended at ``now``: append the
        sampled tokens, stop and free finished requests. Returns the requests that finished."""
        k, dt = self.step_k, self.step_dt
        st = self.stats
        st.steps += k
        st.busy_s += k * dt
        st.usage_time_integral += self.mgr.usage * k * dt
        done: list[SimRequest] = []
        for s in self.batch:
            req = s.request
            kv = req.kv
            if k > 1:
                # Steps 2..k: their tokens, then the allocation and registration the last step
                # made (slots and hashes up to start + k), then its sampled token.
                kv.append_output_token_ids([0] * (k - 1))
                self._hash_output_blocks(req)
                kv.num_computed_tokens = s.start + k - 1
                if self.mgr.allocate_slots(kv, 1) is None:
                    raise AssertionError(
                        "a decode run's allocation failed (the run length bounds it)"
                    )
                kv.num_computed_tokens = s.start + k
            elif kv.status != RequestStatus.RUNNING or kv.num_computed_tokens < kv.num_tokens:
                continue  # mid-prefill chunk
            first = kv.num_output_tokens == 0
            n_new = k if k > 1 else 1
            kv.append_output_token_ids(0)
            st.decode_tokens += n_new
            self._hash_output_blocks(req)
            if first:
                req.first_token = self.step_start + dt
                self._offer(req)
                if n_new > 1:
                    self.itl.add(dt, n_new - 1)
            else:
                self.itl.add(self.step_start + dt - req.last_token, 1)
                if n_new > 1:
                    self.itl.add(dt, n_new - 1)
            req.last_token = self.step_start + n_new * dt
            if self.prefill_only and kv.num_output_tokens >= 1 and req.output_len > 1:
                self._stop(req, now, RequestStatus.FINISHED_STOPPED)
                done.append(req)
            elif kv.num_output_tokens >= req.output_len or kv.num_tokens >= self.cfg.max_model_len:
                self._stop(
                    req,
                    now,
                    RequestStatus.FINISHED_LENGTH_CAPPED
                    if kv.num_output_tokens < req.output_len
                    else RequestStatus.FINISHED_STOPPED,
                )
                done.append(req)
        self.batch = []
        self.busy = False
        if self.host is not None:
            self.host.busy -= self.cfg.tensor_parallel_size
        self.step_k = 0
        self._update_load()
        self._drain_events()
        return done

    # ---- request lifecycle --------------------------------------------------------------------

    def _hash_output_blocks(self, req: SimRequest) -> None:
        kv = req.kv
        hashes = kv.block_hashes
        need = kv.num_tokens // self.cfg.block_size
        while len(hashes) < need:
            j = len(hashes) - len(req.ext_hashes)
            if 0 <= j < len(req.reply_hashes):
                hashes.append(req.reply_hashes[j])
            else:
                self._unique += 1
                hashes.append(
                    (_UNIQUE_BASE | (id(self) & 0xFFFFFF) << 32 | self._unique).to_bytes(8, "big")
                )

    def _offer(self, req: SimRequest) -> None:
        """Offer the request's registered full blocks to the CPU tier (see module docstring)."""
        if self.tier is None:
            return
        upto = self._num_cached.get(req.kv.request_id, 0)
        if upto <= req.offered_blocks:
            return
        keys = [make_offload_key(h) for h in req.kv.block_hashes[req.offered_blocks : upto]]
        req.offered_blocks = upto
        if self.tier.prepare_store(keys) is not None:
            self.tier.complete_store(keys)
        self.stats.peak_tier_blocks = max(self.stats.peak_tier_blocks, self.tier.num_stored)

    def _preempt(self, req: SimRequest) -> None:
        self._offer(req)
        kv = req.kv
        self.mgr.free(kv)
        kv.status = RequestStatus.PREEMPTED
        kv.num_computed_tokens = 0
        kv.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)

    def _stop(self, req: SimRequest, now: float, status: RequestStatus) -> None:
        self._offer(req)
        kv = req.kv
        if kv.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        if status == RequestStatus.FINISHED_LENGTH_CAPPED and kv.num_output_tokens < req.output_len:
            self.stats.length_capped += 1
        kv.status = status
        self.mgr.free(kv)
        if req.first_token < 0:
            req.first_token = now
        if (
            self.prefill_only
            and kv.num_output_tokens < req.output_len
            and status == RequestStatus.FINISHED_STOPPED
        ):
            self.handoff.append(req)
            return
        req.finish = now
        req.num_output = kv.num_output_tokens
        req.kv = None  # type: ignore[assignment]  # its token lists: memory a million requests can't keep
        self.finished.append(req)

    def _update_load(self) -> None:
        ld, pool = self.load, self.mgr.block_pool
        ld.num_running = len(self.running)
        ld.num_waiting = len(self.waiting)
        used = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
        if self.report_active_blocks:
            ld.active_blocks = used
        ld.kv_usage = used / max(pool.num_gpu_blocks - 1, 1)
        if used > self.stats.peak_used_blocks:
            self.stats.peak_used_blocks = used

    def _drain_events(self) -> None:
        if self.index is None:
            return
        events = self.mgr.take_events()
        if events:
            self.index.apply_batch(self.name, events)
        if self.tier is not None:
            for ev in self.tier.take_events():
                self.index.apply_batch(self.name, ev.to_kv_events(self.cfg.block_size))


def handoff_request(req: SimRequest) -> SimRequest:
    """The decode side of a PD-split request after its prefill replica produced the first
    token: a new `KVCacheRequest` (prompt + that token, the same block hashes) whose prompt KV
    is external (``pd_external``: loaded from the prefill replica, as NIXL does)."""
    old = req.kv
    kv = KVCacheRequest(old.request_id + "@decode", old.prompt_token_ids)
    kv.append_output_token_ids(list(old.output_token_ids))
    kv.block_hashes = list(old.block_hashes)
    req.kv = kv
    req.pd_external = old.num_prompt_tokens
    req.offered_blocks = 0
    return req


def make_sim_request(
    trace: TraceRequest,
    hashes: list[bytes],
    reply_hashes: list[bytes],
    materialize_tokens: bool = False,
    external: bool = True,
) -> SimRequest:
    """A `SimRequest` whose `KVCacheRequest` carries ``hashes`` as its block hashes (no hasher:
    output blocks are hashed by the replica). Token ids are placeholders unless
    ``materialize_tokens`` (KV events then carry the real tokens). ``external``: compute the
    router's int form of the hashes (else ``ext_hashes`` only has the right length)."""
    tokens = trace.token_ids() if materialize_tokens else [0] * trace.prompt_len
    kv = KVCacheRequest(trace.request_id, tokens)
    kv.block_hashes = list(hashes)
    ext = [to_external(h) for h in hashes] if external else [0] * len(hashes)
    return SimRequest(trace, kv, ext, reply_hashes, trace.arrival, max(trace.output_len, 1))
