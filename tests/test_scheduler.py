"""The scheduler without a model (vLLM's ``tests/v1/core/test_scheduler.py`` shape).

Every step is ``schedule()`` → a fake runner output (`ModelRunnerOutput` built here: one token
per sampling row, chosen by the test) → ``update_from_output``. The KV side is the real
`KVCacheManager`; ``check_invariants()`` runs after every step. Covered: admission under the
token budget and ``max_num_seqs``, chunked prefill, preemption and resume, ``n > 1`` forks
(through the coordinator, one and two KV cache groups, and when the pool or ``max_num_seqs``
forces the fallback), token-level stops (EOS, stop token ids, ``max_tokens``, min_tokens,
ignore_eos, ``max_model_len``, a sequence the whole cache cannot hold), aborts, a failed step,
and a hypothesis state machine over schedule / update with random stops, finishes and aborts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest
from core_utils import full_spec, make_kv_cache_config, swa_spec
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from pagedkv.core.hashing import sha256
from pagedkv.core.request import RequestStatus, get_request_block_hasher
from pagedkv.engine.request import Request
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.scheduler_output import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    EngineCoreOutputs,
    ModelRunnerOutput,
    SchedulerOutput,
)

BS = 4
EOS = 2
Pick = Callable[[Request], int]


def counting(req: Request) -> int:
    """The fake sampler's default: a token that tells the output position (never EOS)."""
    return 1000 + req.num_output_tokens


def make_scheduler(
    num_blocks: int = 64,
    *,
    specs=None,
    max_num_seqs: int = 8,
    budget: int = 64,
    max_model_len: int = 256,
    caching: bool = True,
) -> Scheduler:
    config = make_kv_cache_config(num_blocks, specs, block_size=BS)
    return Scheduler(config, max_num_seqs, budget, max_model_len, enable_caching=caching)


def make_req(
    rid: str, prompt: list[int], *, max_tokens: int = 4, n: int = 1, eos: int | None = EOS, **params
) -> Request:
    p = SamplingParams(n=n, max_tokens=max_tokens, **params)
    req = Request(
        request_id=rid,
        prompt_token_ids=list(prompt),
        block_hasher=get_request_block_hasher(BS, sha256),
        sampling_params=p,
        eos_token_id=eos,
        parent_id=rid,
        max_tokens=max_tokens,
        seed=p.seed,
    )
    req.fork_pending = n - 1
    return req


def fake_run(so: SchedulerOutput, pick: Pick = counting) -> ModelRunnerOutput:
    """What the runner + sampler return: one row per sampling request, its forked children
    right after it (sampled from the same logits)."""
    children: dict[str, list[Request]] = {}
    for parent, child in so.forks:
        children.setdefault(parent.request_id, []).append(child)
    ids: list[str] = []
    tokens: list[int] = []
    for s in so.scheduled:
        if s.samples:
            for r in (s.request, *children.get(s.request.request_id, ())):
                ids.append(r.request_id)
                tokens.append(pick(r))
    return ModelRunnerOutput(ids, tokens)


def step(sched: Scheduler, pick: Pick = counting) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    so = sched.schedule()
    assert so.num_batched_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    eco = sched.update_from_output(so, fake_run(so, pick))
    sched.kv_cache_manager.check_invariants()
    return so, eco


def run_to_end(sched: Scheduler, pick: Pick = counting, max_steps: int = 500) -> dict[str, str]:
    """Step until nothing is left; the finish reason of every request that finished."""
    reasons: dict[str, str] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return reasons
        _, eco = step(sched, pick)
        reasons.update((o.request_id, o.finish_reason) for o in eco.outputs if o.finished)
    raise AssertionError("the scheduler made no progress")


def assert_all_free(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    assert not sched.requests and not sched.running and not sched.waiting
    kv.check_invariants()
    assert kv.num_free_blocks == kv.block_pool.num_gpu_blocks - 1


# ---- admission and chunked prefill -------------------------------------------------------------


def test_admission_respects_max_num_seqs_and_the_token_budget():
    sched = make_scheduler(max_num_seqs=2, budget=16)
    for i in range(3):
        sched.add_request(make_req(f"r{i}", list(range(10 * i, 10 * i + 6))))
    so, _ = step(sched)
    assert [(s.request.request_id, s.start, s.num_tokens) for s in so.scheduled] == [
        ("r0", 0, 6),
        ("r1", 0, 6),
    ]
    assert so.num_batched_tokens == 12
    assert [r.request_id for r in sched.waiting] == ["r2"]  # max_num_seqs, not the budget

    sched = make_scheduler(budget=8)
    sched.add_request(make_req("a", list(range(6))))
    sched.add_request(make_req("b", list(range(50, 56))))
    so, eco = step(sched)
    # b is admitted with the 2 tokens left in the budget: a chunk, not sampled yet.
    assert [(s.request.request_id, s.num_tokens) for s in so.scheduled] == [("a", 6), ("b", 2)]
    assert [o.request_id for o in eco.outputs] == ["a"]
    so, eco = step(sched)
    assert [(s.request.request_id, s.start, s.num_tokens) for s in so.scheduled] == [
        ("a", 6, 1),
        ("b", 2, 4),
    ]
    assert [o.request_id for o in eco.outputs] == ["a", "b"]


def test_a_new_request_waits_until_its_whole_prompt_fits():
    sched = make_scheduler(num_blocks=7, budget=24)  # 6 usable blocks = 24 tokens
    sched.add_request(make_req("big", list(range(20)), max_tokens=1))
    sched.add_request(make_req("next", list(range(100, 112)), max_tokens=1))
    so, eco = step(sched)
    # 4 tokens of budget are left and one block is free, enough for a first chunk of "next";
    # but its 12-token prompt needs 3 blocks, so it is not admitted to be preempted later.
    assert [s.request.request_id for s in so.scheduled] == ["big"]
    assert sched.waiting[0].request_id == "next"
    assert [(o.request_id, o.finish_reason) for o in eco.outputs] == [("big", "length")]
    assert run_to_end(sched) == {"next": "length"}
    assert_all_free(sched)


def test_chunked_prefill_samples_only_when_the_prompt_ends():
    sched = make_scheduler(budget=8)
    req = make_req("long", list(range(20)), max_tokens=2)
    sched.add_request(req)
    chunks = []
    for _ in range(3):
        so = sched.schedule()
        (s,) = so.scheduled
        chunks.append((s.start, s.num_tokens, s.samples))
        eco = sched.update_from_output(so, fake_run(so))
        assert [o.new_token_ids for o in eco.outputs] == ([[1000]] if chunks[-1][2] else [])
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert req.num_computed_tokens == 20 and req.output_token_ids == [1000]
    assert run_to_end(sched) == {"long": "length"}
    assert req.output_token_ids == [1000, 1001]
    assert_all_free(sched)


# ---- preemption -----------------------------------------------------------------------------------


def test_preemption_frees_the_latest_request_and_it_resumes_from_the_prefix_cache():
    sched = make_scheduler(num_blocks=7)  # 6 usable blocks of 4 tokens; each needs 4 at the end
    a = make_req("a", list(range(8)), max_tokens=8)
    b = make_req("b", list(range(100, 108)), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    num_tokens_at_preemption = resumed = None
    for _ in range(60):
        so, _ = step(sched)
        if so.preempted:
            assert so.preempted == [b] and num_tokens_at_preemption is None
            num_tokens_at_preemption = b.num_tokens
            assert b.status == RequestStatus.PREEMPTED and sched.waiting[0] is b
            assert b.num_computed_tokens == 0 and b.num_preemptions == 1
            assert sched.kv_cache_manager.get_block_ids("b") == ([],)
            assert [s.request for s in so.scheduled] == [a]
        elif num_tokens_at_preemption is not None and resumed is None:
            resumed = next((s for s in so.scheduled if s.request is b), None)
        if not sched.has_unfinished_requests():
            break
    # Re-admitted later, it recomputes its prompt and generated tokens, except what the prefix
    # cache still holds (whole blocks).
    assert resumed is not None and 0 < resumed.start and resumed.start % BS == 0
    assert resumed.start + resumed.num_tokens == num_tokens_at_preemption
    assert sched.num_preemptions == 1
    assert a.output_token_ids == b.output_token_ids == list(range(1000, 1008))
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_all_free(sched)


def test_a_sequence_the_whole_cache_cannot_hold_stops_with_length():
    sched = make_scheduler(num_blocks=4)  # 3 usable blocks = 12 tokens
    req = make_req("r", list(range(10)), max_tokens=50)
    sched.add_request(req)
    reasons = run_to_end(sched)
    assert reasons == {"r": "length"}
    assert req.num_tokens == 13 and req.num_output_tokens == 3  # the 13th token has no slot
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_all_free(sched)


# ---- n > 1 -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "specs",
    [[full_spec(BS)], [full_spec(BS), swa_spec(BS, window=6)]],
    ids=["one group", "full + sliding window"],
)
def test_fork_shares_full_blocks_and_copies_the_partial_one_in_every_group(specs):
    sched = make_scheduler(specs=specs)
    parent = make_req("p", list(range(10)), n=3, max_tokens=3, seed=5)  # 2 full blocks + 2 tokens
    sched.add_request(parent)
    so = sched.schedule()
    assert [(p.request_id, c.request_id, c.seed) for p, c in so.forks] == [
        ("p", "p#1", 6),
        ("p", "p#2", 7),
    ]
    mro = fake_run(so, lambda r: 1000 + r.sample_index)
    assert mro.req_ids == ["p", "p#1", "p#2"]
    eco = sched.update_from_output(so, mro)
    kv = sched.kv_cache_manager
    kv.check_invariants()
    assert [c.request_id for c in eco.forked] == ["p#1", "p#2"]
    assert [(o.request_id, o.new_token_ids) for o in eco.outputs] == [
        ("p", [1000]),
        ("p#1", [1001]),
        ("p#2", [1002]),
    ]
    copies = []
    for g in range(len(specs)):
        tables = [kv.get_block_ids(rid)[g] for rid in ("p", "p#1", "p#2")]
        assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # full (or null) blocks shared
        assert len({t[2] for t in tables}) == 3  # the partial block copied on write
        copies += [(tables[0][2], t[2]) for t in tables[1:]]
        shared = kv.block_pool.blocks[tables[0][1]]
        assert shared.ref_cnt == 3
    assert sorted(sched.pending_copies) == sorted(copies)
    for c in eco.forked:
        assert c.status == RequestStatus.RUNNING and c.num_computed_tokens == 10
    so, _ = step(sched)
    assert sorted(so.blocks_to_copy) == sorted(copies)  # done before the next forward pass
    assert run_to_end(sched) == {"p": "length", "p#1": "length", "p#2": "length"}
    assert_all_free(sched)


def test_a_fork_past_max_num_seqs_queues_the_child_and_it_can_finish_at_once():
    """With max_num_seqs=2 the second child cannot run: it is queued (it will hit the prefix
    cache) yet gets its first token this step, and with max_tokens=1 it finishes at once, from
    the waiting queue."""
    sched = make_scheduler(max_num_seqs=2)
    sched.add_request(make_req("p", list(range(10)), n=3, max_tokens=1))
    so, eco = step(sched)
    assert [c.request_id for c in eco.forked] == ["p#1", "p#2"]
    assert [(o.request_id, o.finish_reason) for o in eco.outputs] == [
        ("p", "length"),
        ("p#1", "length"),
        ("p#2", "length"),
    ]
    assert so.forks == []  # consumed
    assert_all_free(sched)

    sched = make_scheduler(max_num_seqs=2)
    sched.add_request(make_req("q", list(range(10)), n=3, max_tokens=3))
    _, eco = step(sched)
    assert [r.request_id for r in sched.waiting] == ["q#2"]
    assert run_to_end(sched) == {"q": "length", "q#1": "length", "q#2": "length"}
    assert_all_free(sched)


def test_a_fork_without_free_blocks_for_the_copies_queues_the_child():
    sched = make_scheduler(num_blocks=4)  # 3 usable blocks; the parent takes 3 (10 tokens)
    sched.add_request(make_req("p", list(range(10)), n=2, max_tokens=1))
    _, eco = step(sched)
    (child,) = eco.forked
    assert child.status == RequestStatus.FINISHED_LENGTH_CAPPED  # queued, then finished at once
    assert [o.finish_reason for o in eco.outputs] == ["length", "length"]
    assert_all_free(sched)


# ---- stops -------------------------------------------------------------------------------------------


def stop_run(pick_tokens: list[int], **kwargs) -> tuple[Request, str, object]:
    sched = make_scheduler(max_model_len=kwargs.pop("max_model_len", 256))
    req = make_req("r", list(range(8)), **kwargs)
    sched.add_request(req)
    reasons = {}
    stop_reason = None
    for _ in range(len(pick_tokens) + 1):
        _, eco = step(sched, lambda r: pick_tokens[r.num_output_tokens])
        for o in eco.outputs:
            if o.finished:
                reasons[o.request_id], stop_reason = o.finish_reason, o.stop_reason
        if not sched.has_unfinished_requests():
            break
    assert_all_free(sched)
    return req, reasons["r"], stop_reason


def test_eos_stops_with_stop_and_no_stop_reason():
    req, reason, stop_reason = stop_run([5, 6, EOS, 7], max_tokens=10)
    assert (reason, stop_reason, req.output_token_ids) == ("stop", None, [5, 6, EOS])
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_stop_token_ids_stop_with_the_token_as_stop_reason():
    req, reason, stop_reason = stop_run([5, 9, 7], max_tokens=10, stop_token_ids=[9])
    assert (reason, stop_reason, req.output_token_ids) == ("stop", 9, [5, 9])


def test_max_tokens_stops_with_length():
    req, reason, stop_reason = stop_run([5, 6, 7, 8], max_tokens=3)
    assert (reason, stop_reason, req.output_token_ids) == ("length", None, [5, 6, 7])
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_min_tokens_and_ignore_eos_defer_eos():
    req, reason, _ = stop_run([EOS, 9, EOS, 4], max_tokens=10, min_tokens=2, stop_token_ids=[9])
    assert (reason, req.output_token_ids) == ("stop", [EOS, 9])  # EOS at 1 < min_tokens ignored
    req, reason, _ = stop_run([EOS, EOS, EOS], max_tokens=3, ignore_eos=True)
    assert (reason, req.output_token_ids) == ("length", [EOS, EOS, EOS])


def test_max_model_len_stops_with_length():
    req, reason, _ = stop_run([5, 6, 7, 8, 9], max_tokens=100, max_model_len=11)
    assert (reason, req.num_tokens) == ("length", 11)


# ---- aborts and failed steps ---------------------------------------------------------------------------


def test_finish_requests_frees_running_and_waiting_and_tells_the_workers_once():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_req("run", list(range(8)), max_tokens=10))
    sched.add_request(make_req("wait", list(range(50, 58))))
    step(sched)
    done = sched.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in done] == ["run", "wait"]
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in done)
    assert_all_free(sched)
    assert sched.schedule().finished_req_ids == {"run", "wait"}
    assert sched.schedule().finished_req_ids == set()


def test_a_failed_step_frees_its_requests_and_drops_the_hashes_it_never_wrote():
    sched = make_scheduler()
    sched.add_request(make_req("ok", list(range(100, 110)), max_tokens=5))
    step(sched)  # "ok" is running; its prompt blocks hold real KV
    sched.add_request(make_req("p", list(range(12)), n=2, max_tokens=5))
    so = sched.schedule()
    assert so.forks  # p's prompt ends this step: its child was to be forked
    failed = sched.fail_requests(so, ["p"])
    assert [r.request_id for r in failed] == ["p"] and failed[
        0
    ].status == RequestStatus.FINISHED_ABORTED
    eco = sched.update_from_output(so, EMPTY_MODEL_RUNNER_OUTPUT)
    assert eco.forked == [] and eco.outputs == []  # no fork of a failed parent
    kv = sched.kv_cache_manager
    kv.check_invariants()
    assert kv.get_computed_blocks(make_req("again", list(range(12))))[1] == 0  # not a cache hit
    assert sched.requests.keys() == {"ok"}
    assert run_to_end(sched) == {"ok": "length"}
    assert_all_free(sched)


def test_the_scheduler_modules_import_no_torch():
    code = (
        "import sys; import pagedkv.engine.scheduler, pagedkv.engine.scheduler_output; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    src = os.path.join(os.path.dirname(__file__), os.pardir, "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr


# ---- a state machine over schedule / update -------------------------------------------------------------

CONFIGS = [
    ("full bs4", [full_spec(BS)], 20),
    ("hybrid bs4", [full_spec(BS), swa_spec(BS, window=7)], 28),
]
PREFIXES = [[7] * 24, list(range(10, 34)), [3, 1, 4, 1, 5, 9, 2, 6] * 3]
STOP_ID = 9
MAX_EXAMPLES = int(os.environ.get("PAGEDKV_SCHEDULER_EXAMPLES", "150"))


class SchedulerMachine(RuleBasedStateMachine):
    """Random requests (shared prefixes, n up to 3, EOS / stop ids / max_tokens), steps with
    random tokens, random finishes (a stop string found by the output processor), aborts of
    whole user requests, and failed steps. After every rule: the pool's invariants, and the
    scheduler's queues agree with its request table."""

    @initialize(
        config=st.sampled_from(CONFIGS),
        budget=st.sampled_from([3, 8, 64]),
        max_seqs=st.sampled_from([1, 2, 4]),
        caching=st.booleans(),
    )
    def setup(self, config, budget, max_seqs, caching):
        _, specs, num_blocks = config
        self.sched = make_scheduler(
            num_blocks,
            specs=specs,
            max_num_seqs=max_seqs,
            budget=budget,
            max_model_len=40,
            caching=caching,
        )
        self.num_added = 0
        self.finished: set[str] = set()

    @rule(
        prefix=st.sampled_from(PREFIXES),
        length=st.integers(1, 20),
        tail=st.integers(0, 3),
        n=st.integers(1, 3),
        max_tokens=st.integers(1, 8),
    )
    def add(self, prefix, length, tail, n, max_tokens):
        rid = f"r{self.num_added}"
        self.num_added += 1
        prompt = prefix[:length] + [500 + self.num_added] * tail
        self.sched.add_request(
            make_req(rid, prompt, n=n, max_tokens=max_tokens, stop_token_ids=[STOP_ID])
        )

    @rule(data=st.data())
    def step(self, data):
        sched = self.sched
        so = sched.schedule()
        assert so.num_batched_tokens <= sched.max_num_batched_tokens
        assert not (so.finished_req_ids & sched.requests.keys())
        mro = fake_run(so, lambda r: data.draw(st.sampled_from([EOS, STOP_ID, 11, 12, 13])))
        eco = sched.update_from_output(so, mro)
        for o in eco.outputs:
            assert o.request_id not in self.finished
            if o.finished:
                assert o.request_id not in sched.requests
                self.finished.add(o.request_id)
            else:
                assert sched.requests[o.request_id].status in (
                    RequestStatus.RUNNING,
                    RequestStatus.WAITING,
                )
        assert len(sched.running) <= sched.max_num_seqs

    @rule()
    def failed_step(self):
        sched = self.sched
        so = sched.schedule()
        parents = list(dict.fromkeys(s.request.parent_id for s in so.scheduled))
        for r in sched.fail_requests(so, parents):
            self.finished.add(r.request_id)
        eco = sched.update_from_output(so, EMPTY_MODEL_RUNNER_OUTPUT)
        assert not eco.forked and all(o.finished and not o.new_token_ids for o in eco.outputs)
        self.finished.update(o.request_id for o in eco.outputs)

    @rule(data=st.data())
    def finish_one(self, data):
        """The output processor found a stop string: the scheduler finishes that sample."""
        if self.sched.running:
            req = data.draw(st.sampled_from(self.sched.running))
            assert self.sched.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED) == [
                req
            ]
            self.finished.add(req.request_id)

    @rule(data=st.data())
    def abort_user_request(self, data):
        if self.sched.requests:
            pid = data.draw(
                st.sampled_from(sorted({r.parent_id for r in self.sched.requests.values()}))
            )
            ids = [rid for rid, r in self.sched.requests.items() if r.parent_id == pid]
            done = self.sched.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            assert [r.request_id for r in done] == ids
            self.finished.update(ids)

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
        assert all(r.status == RequestStatus.RUNNING for r in sched.running)
        for r in sched.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert all(not group for group in kv.get_block_ids(r.request_id))  # holds no blocks
        assert not self.finished & sched.requests.keys()

    def teardown(self):
        if hasattr(self, "sched"):
            sched = self.sched
            sched.finish_requests(list(sched.requests), RequestStatus.FINISHED_ABORTED)
            assert_all_free(sched)


@pytest.mark.slow
def test_scheduler_state_machine():
    run_state_machine_as_test(
        SchedulerMachine,
        settings=settings(
            max_examples=MAX_EXAMPLES,
            stateful_step_count=40,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        ),
    )
