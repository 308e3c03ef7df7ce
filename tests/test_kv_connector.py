"""The KV connector seam (`kv_transfer.base.KVConnectorBase`, vLLM's ``KVConnectorBase_V1``).

Scheduler level (no model): `kv_test_connectors.ScriptedConnector` answers what each test
configures; the worker is simulated by a `KVConnectorOutput` in the fake `ModelRunnerOutput`.
Covered: asynchronous loads (``WAITING_FOR_REMOTE_KVS``), full-prompt hits, the
``update_state_after_alloc`` contract, undecided connectors, delayed frees, aborts while
loading, load failures under both ``kv_load_failure_policy`` values, ``request_finished`` once
per request, ``on_preempt``, and a hypothesis state machine over all of it.

Engine level (the real model): the order of the worker hooks around the forward pass, a real
in-memory remote store (`InMemoryKVConnector`) that must reproduce the tokens of a local run,
its failure modes, and `KVTransferConfig` / factory errors.
"""

from __future__ import annotations

from collections import Counter

import pytest
from core_utils import full_spec, make_kv_cache_config
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from kv_test_connectors import ScriptedConnector
from test_scheduler import BS, assert_all_free, counting, fake_run, make_req

from pagedkv.core.request import RequestStatus
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.scheduler_output import EngineCoreOutputs, SchedulerOutput
from pagedkv.kv_transfer.base import KVConnectorOutput, KVConnectorRole
from pagedkv.kv_transfer.config import KVTransferConfig

W = RequestStatus.WAITING
WR = RequestStatus.WAITING_FOR_REMOTE_KVS
PROMPT = list(range(100, 116))  # 16 tokens = 4 blocks of BS=4


def scripted_config(policy: str = "recompute") -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="ScriptedConnector",
        kv_role="kv_both",
        kv_connector_module_path="kv_test_connectors",
        kv_load_failure_policy=policy,
    )


def make_sched(
    policy: str = "recompute",
    *,
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    budget: int = 64,
    max_model_len: int = 256,
) -> tuple[Scheduler, ScriptedConnector]:
    conn = ScriptedConnector(scripted_config(policy), KVConnectorRole.SCHEDULER)
    config = make_kv_cache_config(num_blocks, [full_spec(BS)], block_size=BS)
    return Scheduler(config, max_num_seqs, budget, max_model_len, conn), conn


def kstep(
    sched: Scheduler, kco: KVConnectorOutput | None = None
) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    """One step whose worker reports ``kco`` (an empty report when None)."""
    so = sched.schedule()
    assert so.num_batched_tokens <= sched.max_num_batched_tokens
    assert so.kv_connector_metadata is not None  # built every step
    mro = fake_run(so)
    mro.kv_connector_output = kco or KVConnectorOutput()
    eco = sched.update_from_output(so, mro)
    sched.kv_cache_manager.check_invariants()
    return so, eco


def scheduled(so: SchedulerOutput) -> dict[str, tuple[int, int]]:
    return {s.request.request_id: (s.start, s.num_tokens) for s in so.scheduled}


def finish_reasons(eco: EngineCoreOutputs) -> dict[str, str]:
    return {o.request_id: o.finish_reason for o in eco.outputs if o.finished}


def run_all(sched: Scheduler, max_steps: int = 200) -> dict[str, str]:
    reasons: dict[str, str] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return reasons
        _, eco = kstep(sched)
        reasons.update(finish_reasons(eco))
    raise AssertionError("the scheduler made no progress")


def blocks_of(sched: Scheduler, rid: str) -> list[int]:
    return sched.kv_cache_manager.get_block_ids(rid)[0]


def num_hits(sched: Scheduler, prompt: list[int]) -> int:
    return sched.kv_cache_manager.get_computed_blocks(make_req("probe", prompt))[1]


# ---- asynchronous loads -------------------------------------------------------------------------


def test_async_load_parks_the_request_then_resumes_from_the_loaded_prefix():
    sched, conn = make_sched()
    conn.answers["a"] = (8, True)
    a = make_req("a", PROMPT)
    sched.add_request(a)
    sched.add_request(make_req("b", list(range(200, 206)), max_tokens=8))
    so, _ = kstep(sched)
    assert scheduled(so) == {"b": (0, 6)}  # b is admitted behind the parked a
    assert a.status == WR and a in sched.waiting
    assert len(blocks_of(sched, "a")) == 2  # blocks for the 8 external tokens, allocated
    assert num_hits(sched, PROMPT[:8] + [1, 2, 3, 4]) == 0  # not a cache hit while it arrives
    so, _ = kstep(sched)
    assert "a" not in scheduled(so) and a.status == WR
    so, _ = kstep(sched, KVConnectorOutput(finished_recving={"a"}))
    assert "a" not in scheduled(so)
    so, _ = kstep(sched)  # promoted, and scheduled from the loaded prefix
    assert scheduled(so)["a"] == (8, 8)
    assert a.status == RequestStatus.RUNNING and a.num_cached_tokens == 8
    assert num_hits(sched, PROMPT[:8] + [1, 2, 3, 4]) == 8  # the loaded blocks are cache hits
    assert run_all(sched) == {"a": "length", "b": "length"}
    assert a.output_token_ids == [1000, 1001, 1002, 1003]
    assert_all_free(sched)


def test_async_load_after_a_local_hit_counts_both():
    sched, conn = make_sched()
    sched.add_request(make_req("p", PROMPT[:8] + [7, 7, 7, 7]))
    run_all(sched)
    conn.answers["a"] = (4, True)
    a = make_req("a", PROMPT)
    sched.add_request(a)
    kstep(sched)
    assert conn.matched_calls[-1] == ("a", 8) and a.status == WR
    assert len(blocks_of(sched, "a")) == 3
    kstep(sched, KVConnectorOutput(finished_recving={"a"}))
    so, _ = kstep(sched)
    assert scheduled(so)["a"] == (12, 4)  # local hit 8 + external 4
    run_all(sched)
    assert_all_free(sched)


def test_full_prompt_async_hit_recomputes_only_the_last_prompt_token():
    sched, conn = make_sched()
    conn.answers["a"] = (16, True)
    a = make_req("a", PROMPT, max_tokens=1)
    sched.add_request(a)
    kstep(sched)
    assert a.status == WR and len(blocks_of(sched, "a")) == 4
    kstep(sched, KVConnectorOutput(finished_recving={"a"}))
    so, eco = kstep(sched)
    assert scheduled(so) == {"a": (15, 1)}  # its logits give the first output token
    assert finish_reasons(eco) == {"a": "length"} and a.output_token_ids == [1000]
    assert_all_free(sched)


def test_full_prompt_sync_hit_recomputes_only_the_last_prompt_token():
    sched, conn = make_sched()
    conn.answers["a"] = (16, False)
    sched.add_request(make_req("a", PROMPT, max_tokens=1))
    so = sched.schedule()
    assert scheduled(so) == {"a": (15, 1)}


def test_update_state_after_alloc_gets_every_block_and_the_local_hit():
    sched, conn = make_sched()
    sched.add_request(make_req("p", PROMPT[:8] + [7] * 8))
    run_all(sched)
    assert conn.alloc_calls[0][0] == "p" and conn.alloc_calls[0][2:] == (0, 0)  # called with 0 too
    conn.answers["q"] = (4, False)
    sched.add_request(make_req("q", PROMPT))
    so, _ = kstep(sched)
    rid, block_ids, num_ext, computed_at_call = conn.alloc_calls[-1]
    assert (rid, num_ext, computed_at_call) == ("q", 4, 8)
    assert conn.matched_calls[-1] == ("q", 8)
    assert block_ids == sched.kv_cache_manager.get_block_ids("q") and len(block_ids[0]) == 4
    assert scheduled(so) == {"q": (12, 4)}  # synchronous: scheduled after local + external
    run_all(sched)
    assert_all_free(sched)


def test_an_undecided_connector_leaves_the_request_waiting_and_is_asked_again():
    sched, conn = make_sched()
    conn.answers["a"] = (None, False)
    a = make_req("a", PROMPT)
    sched.add_request(a)
    sched.add_request(make_req("b", list(range(200, 206))))
    so, _ = kstep(sched)
    assert scheduled(so) == {"b": (0, 6)}
    assert a.status == W and blocks_of(sched, "a") == [] and a.num_computed_tokens == 0
    kstep(sched)
    assert [c for c in conn.matched_calls if c[0] == "a"] == [("a", 0), ("a", 0)]
    assert not [c for c in conn.alloc_calls if c[0] == "a"]  # never allocated while undecided
    conn.answers["a"] = (0, False)
    so, _ = kstep(sched)
    assert scheduled(so)["a"] == (0, 16)
    run_all(sched)
    assert_all_free(sched)


# ---- finishing: delayed frees, aborts ---------------------------------------------------------------


def test_delayed_free_holds_the_blocks_until_finished_sending():
    sched, conn = make_sched()
    conn.finish_answers["a"] = (True, {"x": 1})
    sched.add_request(make_req("a", PROMPT, max_tokens=1))
    _, eco = kstep(sched)
    (out,) = eco.outputs
    assert out.finish_reason == "length" and out.kv_transfer_params == {"x": 1}
    kv = sched.kv_cache_manager
    assert "a" not in sched.requests and "a" in sched.delayed_free
    assert len(blocks_of(sched, "a")) == 4  # its 16 computed tokens
    assert kv.num_free_blocks == kv.block_pool.num_gpu_blocks - 1 - 4
    assert sched.has_pending_kv_transfers() and not sched.has_unfinished_requests()
    kstep(sched, KVConnectorOutput(finished_sending={"other"}))
    assert sched.has_pending_kv_transfers() and len(blocks_of(sched, "a")) == 4
    kstep(sched, KVConnectorOutput(finished_sending={"a"}))
    assert not sched.has_pending_kv_transfers()
    assert conn.finished_calls == ["a"]
    assert_all_free(sched)


def test_abort_while_loading_holds_the_blocks_until_the_load_is_reported():
    sched, conn = make_sched()
    conn.answers["a"] = (8, True)
    sched.add_request(make_req("a", PROMPT))
    kstep(sched)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert conn.finished_calls == ["a"]
    assert (
        len(blocks_of(sched, "a")) == 2 and sched.has_pending_kv_transfers()
    )  # the load may still write
    kstep(sched)
    assert len(blocks_of(sched, "a")) == 2
    kstep(sched, KVConnectorOutput(finished_recving={"a"}))
    assert not sched.has_pending_kv_transfers() and conn.finished_calls == ["a"]
    assert_all_free(sched)


def test_abort_after_the_load_is_reported_frees_at_once():
    sched, conn = make_sched()
    conn.answers["a"] = (8, True)
    sched.add_request(make_req("a", PROMPT))
    kstep(sched)
    kstep(sched, KVConnectorOutput(finished_recving={"a"}))  # reported, not promoted yet
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_pending_kv_transfers() and not sched.finished_recving_kv_req_ids
    assert_all_free(sched)


# ---- load failures ----------------------------------------------------------------------------------


def test_recompute_policy_rewinds_an_async_load_to_its_first_invalid_block():
    sched, conn = make_sched("recompute")
    conn.answers["a"] = (12, True)
    a = make_req("a", PROMPT)
    sched.add_request(a)
    kstep(sched)
    ids = blocks_of(sched, "a")
    assert len(ids) == 3
    _, eco = kstep(sched, KVConnectorOutput(finished_recving={"a"}, invalid_block_ids={ids[1]}))
    assert eco.outputs == [] and a.num_computed_tokens == 4
    so, _ = kstep(sched)
    assert scheduled(so)["a"] == (4, 12)  # promoted, recomputing from the first invalid block
    assert blocks_of(sched, "a")[:3] == ids  # the same blocks, rewritten
    assert run_all(sched) == {"a": "length"}
    assert a.output_token_ids == [1000, 1001, 1002, 1003]
    assert_all_free(sched)


def test_recompute_policy_an_async_load_whose_first_block_failed_restarts_from_zero():
    sched, conn = make_sched("recompute")
    conn.answers["a"] = (8, True)
    a = make_req("a", PROMPT)
    sched.add_request(a)
    kstep(sched)
    ids = blocks_of(sched, "a")
    kstep(sched, KVConnectorOutput(finished_recving={"a"}, invalid_block_ids={ids[0]}))
    assert a.num_computed_tokens == 0
    conn.answers["a"] = (0, False)  # asked again (a new admission), the store has nothing now
    so, _ = kstep(sched)
    assert scheduled(so)["a"] == (0, 16)
    assert run_all(sched) == {"a": "length"}
    assert a.output_token_ids == [1000, 1001, 1002, 1003]
    assert_all_free(sched)


def test_recompute_policy_a_failed_sync_load_drops_the_token_and_recomputes():
    sched, conn = make_sched("recompute")
    conn.answers["a"] = (8, False)
    a = make_req("a", PROMPT)
    sched.add_request(a)
    so, _ = sched.schedule(), None
    assert scheduled(so) == {"a": (8, 8)}  # samples this step
    ids = blocks_of(sched, "a")
    assert num_hits(sched, PROMPT) == 12  # allocation registered the (loaded) blocks' hashes
    mro = fake_run(so)
    assert mro.req_ids == ["a"]
    mro.kv_connector_output = KVConnectorOutput(invalid_block_ids={ids[1]})
    eco = sched.update_from_output(so, mro)
    sched.kv_cache_manager.check_invariants()
    assert eco.outputs == [] and a.output_token_ids == []  # the sampled token is dropped
    assert a.num_computed_tokens == 4
    assert num_hits(sched, PROMPT) == 4  # hashes from the invalid block on are gone
    assert sched.kv_cache_manager.get_blocks("a").get_unhashed_block_ids() == ids[1:]
    so, _ = kstep(sched)
    assert scheduled(so)["a"] == (4, 12)
    assert num_hits(sched, PROMPT) == 12  # registered again once recomputed
    assert run_all(sched) == {"a": "length"}
    assert a.output_token_ids == [1000, 1001, 1002, 1003]
    assert conn.finished_calls == ["a"]
    assert_all_free(sched)


def test_fail_policy_finishes_the_request_with_error_and_frees_its_blocks():
    sched, conn = make_sched("fail")
    conn.answers["a"] = (8, True)
    a = make_req("a", PROMPT)
    sched.add_request(a)
    sched.add_request(make_req("b", list(range(200, 206))))
    kstep(sched)
    ids = blocks_of(sched, "a")
    _, eco = kstep(sched, KVConnectorOutput(finished_recving={"a"}, invalid_block_ids={ids[0]}))
    assert finish_reasons(eco) == {"a": "error"}
    assert a.status == RequestStatus.FINISHED_ERROR and "a" not in sched.requests
    assert blocks_of(sched, "a") == [] and not sched.has_pending_kv_transfers()
    assert conn.finished_calls == ["a"]
    assert [o.new_token_ids for o in eco.outputs if o.request_id == "b"] == [[1001]]  # b unaffected
    assert run_all(sched) == {"b": "length"}
    assert_all_free(sched)


def test_fail_policy_a_failed_sync_load_fails_the_running_request():
    sched, conn = make_sched("fail")
    conn.answers["a"] = (8, False)
    sched.add_request(make_req("a", PROMPT))
    sched.add_request(make_req("b", list(range(200, 206))))
    so = sched.schedule()
    mro = fake_run(so)
    mro.kv_connector_output = KVConnectorOutput(invalid_block_ids={blocks_of(sched, "a")[0]})
    eco = sched.update_from_output(so, mro)
    sched.kv_cache_manager.check_invariants()
    assert [
        (o.request_id, o.new_token_ids, o.finish_reason) for o in eco.outputs if o.request_id == "a"
    ] == [("a", [], "error")]  # its sampled token is not reported
    assert num_hits(sched, PROMPT) == 0
    assert run_all(sched) == {"b": "length"}
    assert conn.finished_calls.count("a") == 1
    assert_all_free(sched)


# ---- request_finished / on_preempt ----------------------------------------------------------------


def test_request_finished_is_called_exactly_once_per_request():
    sched, conn = make_sched(max_num_seqs=3)
    for rid in ("fin", "ab", "stop", "queued"):
        sched.add_request(
            make_req(rid, list(range(hash(rid) % 50, hash(rid) % 50 + 6)), max_tokens=3)
        )
    kstep(sched)
    assert sched.waiting[0].request_id == "queued"  # max_num_seqs
    sched.finish_requests(["ab", "queued"], RequestStatus.FINISHED_ABORTED)
    sched.finish_requests(["stop"], RequestStatus.FINISHED_STOPPED)
    sched.finish_requests(
        ["stop", "ab"], RequestStatus.FINISHED_ABORTED
    )  # already finished: ignored
    assert run_all(sched) == {"fin": "length"}
    assert Counter(conn.finished_calls) == {"fin": 1, "ab": 1, "stop": 1, "queued": 1}
    assert_all_free(sched)


def test_on_preempt_is_called_for_each_preemption():
    sched, conn = make_sched(num_blocks=7)  # 6 usable blocks = 24 tokens
    sched.add_request(make_req("a", list(range(8)), max_tokens=10))
    sched.add_request(make_req("b", list(range(50, 58)), max_tokens=10))
    preempted: list[str] = []
    reasons: dict[str, str] = {}
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        so, eco = kstep(sched)
        preempted += [r.request_id for r in so.preempted]
        reasons.update(finish_reasons(eco))
    assert preempted and conn.preempt_calls == preempted
    assert reasons == {"a": "length", "b": "length"}
    assert Counter(conn.finished_calls) == {"a": 1, "b": 1}
    assert_all_free(sched)


def test_recompute_policy_a_load_failed_at_block_0_while_the_prefix_got_cached_elsewhere():
    sched, conn = make_sched("recompute")
    conn.answers["a"] = (8, True)
    a = make_req("a", PROMPT)
    sched.add_request(a)
    kstep(sched)
    ids = blocks_of(sched, "a")
    sched.add_request(make_req("b", PROMPT, max_tokens=8))  # computes (and caches) the same prefix
    kstep(sched)
    assert num_hits(sched, PROMPT) == 12
    kstep(sched, KVConnectorOutput(finished_recving={"a"}, invalid_block_ids={ids[0]}))
    assert a.num_computed_tokens == 0
    so, _ = kstep(sched)  # promoted: must go on with the blocks it holds, not be admitted again
    assert scheduled(so)["a"][1] > 0
    run_all(sched)
    assert_all_free(sched)


def test_abort_while_loading_with_delay_free_waits_for_the_load_too():
    sched, conn = make_sched()
    conn.answers["a"] = (8, True)
    conn.finish_answers["a"] = (True, {"x": 1})
    sched.add_request(make_req("a", PROMPT))
    kstep(sched)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    kstep(sched, KVConnectorOutput(finished_sending={"a"}))
    assert len(blocks_of(sched, "a")) == 2  # the load is still in flight
    kstep(sched, KVConnectorOutput(finished_recving={"a"}))
    assert_all_free(sched)


# ---- a state machine over the connector's answers and reports ----------------------------------------

PREFIXES = [[7] * 24, list(range(10, 34))]


class KVConnectorMachine(RuleBasedStateMachine):
    """Random requests (shared prefixes) with random connector answers: none, synchronous or
    asynchronous external tokens, or undecided for a few asks; random delayed frees; steps whose
    worker reports random subsets of the loads and sends in flight and random invalid blocks
    among the blocks loaded from outside; random aborts. After every rule: the pool's
    invariants and the queues' states. At the end, with every transfer reported and every
    request done, every block is free and each request was finished exactly once.

    Invalid blocks may be any loaded block (block 0 included), an answer may cover the whole
    prompt, and a delayed send may be reported before the load of a request aborted while
    loading."""

    @initialize(
        policy=st.sampled_from(["recompute", "fail"]),
        num_blocks=st.sampled_from([8, 12, 24]),
        budget=st.sampled_from([4, 16, 64]),
        max_seqs=st.sampled_from([1, 2, 4]),
    )
    def setup(self, policy, num_blocks, budget, max_seqs):
        self.sched, self.conn = make_sched(
            policy, num_blocks=num_blocks, max_num_seqs=max_seqs, budget=budget, max_model_len=40
        )
        self.conn.answer_fn = self._answer
        self.plans: dict[str, tuple[str, int]] = {}  # rid -> (kind, external blocks)
        self.undecided: Counter[str] = Counter()
        self.loading: dict[
            str, list[int]
        ] = {}  # async loads not reported yet: rid -> external blocks
        self.num_alloc_calls = 0
        self.num_added = 0

    def _answer(self, req, num_computed):
        kind, k = self.plans[req.request_id]
        if kind == "undecided" and self.undecided[req.request_id] < k:
            self.undecided[req.request_id] += 1
            return None, False
        room = (req.num_tokens - num_computed) // BS * BS  # up to the whole prompt
        ext = max(0, min(k * BS, room)) if kind in ("sync", "async") else 0
        return ext, kind == "async" and ext > 0

    @rule(
        prefix=st.sampled_from(PREFIXES),
        length=st.integers(1, 20),
        tail=st.integers(0, 3),
        max_tokens=st.integers(1, 6),
        kind=st.sampled_from(["none", "sync", "async", "async", "undecided"]),
        k=st.integers(1, 4),
        delay=st.booleans(),
    )
    def add(self, prefix, length, tail, max_tokens, kind, k, delay):
        rid = f"r{self.num_added}"
        self.num_added += 1
        self.plans[rid] = (kind, k)
        self.conn.finish_answers[rid] = (delay, {"rid": rid} if delay else None)
        self.sched.add_request(
            make_req(rid, prefix[:length] + [500 + self.num_added] * tail, max_tokens=max_tokens)
        )

    def _new_loads(self) -> dict[str, list[int]]:
        """Loads queued by this schedule(): async ones join ``loading``; sync ones (loaded in
        this very step) are returned."""
        sync: dict[str, list[int]] = {}
        for rid, block_ids, num_ext, computed in self.conn.alloc_calls[self.num_alloc_calls :]:
            if num_ext == 0:
                continue
            ext = block_ids[0][computed // BS : (computed + num_ext) // BS]
            req = self.sched.requests.get(rid)
            if req is not None and req.status == WR:
                self.loading[rid] = ext
            else:
                sync[rid] = ext
        self.num_alloc_calls = len(self.conn.alloc_calls)
        return sync

    def _report(self, data, everything: bool = False) -> KVConnectorOutput:
        sched = self.sched

        def draw(xs) -> set[str]:
            if everything or not xs:
                return set(xs)
            return data.draw(st.sets(st.sampled_from(sorted(xs))))

        recving = draw(self.loading)
        # A delayed send may be reported before or after the request's (aborted) load.
        sending = draw({rid for rid in sched.delayed_free if self.conn.finish_answers[rid][0]})
        return KVConnectorOutput(sending, recving)

    def _invalid(self, data, recving: set[str], sync: dict[str, list[int]]) -> set[int]:
        candidates = {b for rid in recving for b in self.loading[rid]}
        candidates |= {b for ext in sync.values() for b in ext}
        if not candidates or not data.draw(st.booleans()):
            return set()
        return data.draw(st.sets(st.sampled_from(sorted(candidates)), min_size=1))

    def _step(self, data, everything: bool = False) -> None:
        sched = self.sched
        so = sched.schedule()
        assert so.num_batched_tokens <= sched.max_num_batched_tokens
        assert all(s.num_tokens > 0 for s in so.scheduled)
        sync = self._new_loads()
        assert not self.loading.keys() & scheduled(so).keys()  # parked requests never run
        kco = self._report(data, everything)
        if not everything:
            kco.invalid_block_ids = self._invalid(data, kco.finished_recving, sync)
        mro = fake_run(
            so, lambda r: data.draw(st.sampled_from([EOS_ID, 11, 12])) if data else counting(r)
        )
        mro.kv_connector_output = kco
        sched.update_from_output(so, mro)
        assert Counter(r.request_id for r in so.preempted) == Counter(
            self.conn.preempt_calls[len(self.conn.preempt_calls) - len(so.preempted) :]
        )
        for rid in kco.finished_recving:
            del self.loading[rid]

    @rule(data=st.data())
    def step(self, data):
        self._step(data)

    @rule(data=st.data())
    def abort(self, data):
        if self.sched.requests:
            rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
            assert [
                r.request_id
                for r in self.sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
            ] == [rid]

    @invariant()
    def consistent(self):
        if not hasattr(self, "sched"):
            return
        sched = self.sched
        kv = sched.kv_cache_manager
        kv.check_invariants()
        running = {r.request_id for r in sched.running}
        waiting = {r.request_id for r in sched.waiting}
        assert not running & waiting and running | waiting == sched.requests.keys()
        assert not sched.delayed_free.keys() & sched.requests.keys()
        assert all(r.status == RequestStatus.RUNNING for r in sched.running)
        for r in sched.waiting:
            assert r.status in (W, WR, RequestStatus.PREEMPTED)
            if (
                r.status != WR
                and r.num_computed_tokens == 0
                and r.request_id not in sched.promoted_req_ids
            ):
                assert not kv.get_block_ids(r.request_id)[0]  # holds blocks only for its load
        assert all(n == 1 for n in Counter(self.conn.finished_calls).values())  # finished once

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        sched = self.sched
        for _ in range(2000):  # every transfer reported at once; every request runs to its end
            if not sched.has_unfinished_requests() and not sched.delayed_free:
                break
            self._step(None, everything=True)
            sched.kv_cache_manager.check_invariants()
        assert not self.loading and not sched.delayed_free and not sched.has_unfinished_requests()
        assert sorted(self.conn.finished_calls) == sorted(self.plans)  # each request finished once
        assert_all_free(sched)


EOS_ID = 2


def test_kv_connector_state_machine():
    run_state_machine_as_test(
        KVConnectorMachine,
        settings=settings(
            max_examples=30,
            stateful_step_count=40,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        ),
    )


# ---- engine level: the real model -----------------------------------------------------------------

PROMPT_A = (
    "The history of the printing press begins in the fifteenth century, when a goldsmith in "
    "Mainz combined movable metal type, oil-based ink and a wooden press into one system. Within "
    "fifty years, presses were running in more than two hundred cities across Europe, and"
)
PROMPT_B = "List three colors of the rainbow:"
MAX_TOKENS = 6


def connector_llm(name: str, **extra):
    from pagedkv import LLM

    policy = extra.pop("policy", "recompute")
    return LLM(
        num_kv_blocks=64,
        max_model_len=256,
        kv_transfer_config={
            "kv_connector": name,
            "kv_role": "kv_both",
            "kv_connector_module_path": "kv_test_connectors",
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": extra,
        },
    )


def greedy():
    from pagedkv import SamplingParams

    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference_tokens() -> list[list[int]]:
    """What an engine without a connector generates for PROMPT_A and PROMPT_B."""
    from pagedkv import LLM

    llm = LLM(num_kv_blocks=64, max_model_len=256)
    return token_ids(llm.generate([PROMPT_A, PROMPT_B], greedy(), use_tqdm=False))


WORKER_HOOKS = {
    "bind",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "clear",
}


@pytest.mark.slow
def test_worker_hooks_run_in_order_around_every_step(reference_tokens):
    llm = connector_llm("RecordingConnector")
    engine = llm.llm_engine
    conn = engine.connector
    names = [engine.model_config.layer_name(i) for i in range(engine.model_config.num_layers)]
    assert conn.registered == names
    assert all(
        conn.kv_caches[n][0].data_ptr() == k.data_ptr()
        for n, (k, _) in zip(names, engine.kv_caches)
    )
    outputs = llm.generate([PROMPT_A, PROMPT_B], greedy(), use_tqdm=False)
    assert (
        token_ids(outputs) == reference_tokens
    )  # a connector that matches nothing changes nothing
    events = [e for e in conn.events if e[0] in WORKER_HOOKS]
    steps: list[list[tuple[str, object]]] = []
    for e in events:
        if e[0] == "bind":
            steps.append([])
        steps[-1].append(e)
    layers = [x for n in names for x in (("wait_for_layer_load", n), ("save_kv_layer", n))]
    head = [("bind", None), ("start_load_kv", None)]
    for s in steps:
        assert s[:2] == head and s[-2:] == [
            ("get_block_ids_with_load_errors", None),
            ("clear", None),
        ]
        assert s[-4] == ("wait_for_save", None) and s[-3][0] == "get_finished"
        assert s[2:-4] in (layers, [])  # one forward pass, layer by layer, or an empty step
    assert (
        sum(s[2:-4] == layers for s in steps) == MAX_TOKENS
    )  # a prefill and the decodes of one batch
    assert sorted(conn.finished_calls) == sorted(o.request_id for o in outputs)


@pytest.mark.slow
def test_in_memory_connector_reproduces_a_local_run(reference_tokens):
    llm = connector_llm("InMemoryKVConnector")
    engine = llm.llm_engine
    conn = engine.connector
    first = llm.generate(PROMPT_A, greedy(), use_tqdm=False)
    assert token_ids(first) == reference_tokens[:1]
    num_prompt = len(first[0].prompt_token_ids)
    assert conn.num_saved_blocks == num_prompt // 16 > 0 and conn.num_loaded_tokens == 0
    assert llm.reset_prefix_cache()
    stats = engine.kv_cache_manager.total_prefix_cache_stats
    hits, ext = stats.hits, stats.external_hits
    second = llm.generate(PROMPT_A, greedy(), use_tqdm=False)
    loaded = (num_prompt - 1) // 16 * 16
    assert (
        conn.num_loaded_tokens == loaded >= 32
    )  # a multi-block load (the corrupt run keeps block 0)
    assert (
        stats.hits == hits and stats.external_hits - ext == loaded
    )  # no local hit: all from the store
    assert token_ids(second) == token_ids(first)
    engine.check_invariants()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_config.num_blocks - 1

    # The same load, reported invalid: recomputed, same tokens.
    conn.corrupt_loads = True
    assert llm.reset_prefix_cache()
    third = llm.generate(PROMPT_A, greedy(), use_tqdm=False)
    assert conn.num_loaded_tokens == 2 * loaded and conn.num_failed_blocks == 1
    assert token_ids(third) == token_ids(first) and third[0].error is None
    engine.check_invariants()


@pytest.mark.slow
def test_in_memory_connector_fail_policy_fails_only_the_loading_request(reference_tokens):
    llm = connector_llm("InMemoryKVConnector", policy="fail", corrupt_loads=True)
    engine = llm.llm_engine
    assert token_ids(llm.generate(PROMPT_A, greedy(), use_tqdm=False)) == reference_tokens[:1]
    assert llm.reset_prefix_cache()
    failed, ok = llm.generate([PROMPT_A, PROMPT_B], greedy(), use_tqdm=False)
    assert engine.connector.num_loaded_tokens > 0
    assert failed.outputs[0].finish_reason == "error" and failed.error
    assert failed.outputs[0].token_ids == []
    assert ok.error is None and ok.outputs[0].token_ids == reference_tokens[1]
    engine.check_invariants()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_config.num_blocks - 1


# ---- configuration errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (
            {"kv_connector": "X", "kv_role": "kv_both", "bogus": 1},
            r"unknown kv_transfer_config field\(s\) \['bogus'\]",
        ),
        ({"kv_connector": "X"}, "kv_role.*a connector needs a role"),
        ({"kv_connector": "X", "kv_role": "sender"}, "kv_role='sender'.*choose one of"),
        (
            {"kv_connector": "X", "kv_role": "kv_both", "kv_load_failure_policy": "retry"},
            "kv_load_failure_policy='retry'.*choose one of",
        ),
    ],
)
def test_kv_transfer_config_errors(data, match):
    with pytest.raises(ValueError, match=match):
        KVTransferConfig.from_dict(data)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (
            {"kv_connector": "NoSuchConnector"},
            "unknown kv_connector 'NoSuchConnector'.*OffloadingConnector",
        ),
        (
            {"kv_connector": "X", "kv_connector_module_path": "no_such_module_xyz"},
            "cannot import kv_connector_module_path 'no_such_module_xyz'",
        ),
        (
            {"kv_connector": "NotAConnector", "kv_connector_module_path": "kv_test_connectors"},
            "'NotAConnector' is not a KVConnectorBase subclass",
        ),
        (
            {"kv_connector": "Missing", "kv_connector_module_path": "kv_test_connectors"},
            "'Missing' is not a KVConnectorBase subclass",
        ),
    ],
)
def test_connector_factory_errors(data, match):
    from pagedkv.kv_transfer.factory import KVConnectorFactory

    config = KVTransferConfig.from_dict({"kv_role": "kv_both", **data})
    with pytest.raises(ValueError, match=match):
        KVConnectorFactory.get_connector_class(config)


def test_the_factory_loads_a_connector_by_module_path():
    from pagedkv.kv_transfer.factory import KVConnectorFactory

    config = scripted_config()
    assert KVConnectorFactory.get_connector_class(config) is ScriptedConnector


def test_engine_config_refuses_both_kv_offload_and_kv_transfer_config():
    from pagedkv.engine.config import EngineConfig

    with pytest.raises(ValueError, match="either kv_offload.*or kv_transfer_config"):
        EngineConfig(
            kv_offload="cpu:1GiB", kv_transfer_config={"kv_connector": "X", "kv_role": "kv_both"}
        )
    with pytest.raises(ValueError, match=r"unknown kv_transfer_config field\(s\) \['nope'\]"):
        EngineConfig(kv_transfer_config={"nope": 1})
