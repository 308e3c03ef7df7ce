"""Hypothesis stateful test of the whole core: random new requests (with shared prefixes),
chunked prefills, decode appends, preemption-style frees, finishes and prefix-cache resets over
small pools (several block sizes; hybrid full + sliding-window groups too).

After every step: `check_invariants()`, block tables are append-only (an id may only turn into
the null block when it leaves the window), and every prefix hit returns blocks whose *written
content* equals the request's tokens (so no hash ever points at a reused block).
CI runs >= 20,000 steps (MAX_EXAMPLES x STEPS).
"""

from __future__ import annotations

import os

import pytest
from core_utils import full_spec, make_manager, make_request, swa_spec
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pagedkv.core.request import RequestStatus

MAX_EXAMPLES = int(os.environ.get("PAGEDKV_STATEFUL_EXAMPLES", "600"))
STEPS = 50
MIN_STEPS = int(os.environ.get("PAGEDKV_STATEFUL_MIN_STEPS", "20000"))

CONFIGS = [
    ("full bs1", [full_spec(1)], 40),
    ("full bs4", [full_spec(4)], 24),
    ("full bs16", [full_spec(16)], 12),
    ("swa bs4", [swa_spec(4, window=10)], 24),
    ("hybrid bs4", [full_spec(4), swa_spec(4, window=7)], 40),
    ("hybrid 4/8", [full_spec(4), swa_spec(8, window=12)], 40),
]
PREFIXES = [[7] * 40, list(range(40)), [3, 1, 4, 1, 5, 9, 2, 6] * 5]


class CoreMachine(RuleBasedStateMachine):
    steps_run = 0  # rules executed across all examples (each followed by check_invariants)

    @initialize(
        config=st.sampled_from(CONFIGS), caching=st.booleans(), chunk=st.sampled_from([3, 8, 64])
    )
    def setup(self, config, caching, chunk):
        _, specs, num_blocks = config
        self.m = make_manager(
            num_blocks=num_blocks, specs=specs, caching=caching, max_model_len=200
        )
        self.chunk = chunk
        self.waiting: list = []
        self.running: list = []
        self.content: dict[int, dict[int, int]] = {}  # block id -> {slot offset: token}
        self.tables: dict[str, list[tuple[int, ...]]] = {}
        self.initialized = False

    # ---- helpers -------------------------------------------------------------------------

    def _write(self, req, start: int, end: int) -> None:
        """Pretend the forward pass wrote tokens [start, end) into the request's blocks."""
        for group, blocks in enumerate(self.m.get_blocks(req.request_id).blocks):
            bs = self.m.kv_cache_groups[group].kv_cache_spec.block_size
            for pos in range(start, end):
                blk = blocks[pos // bs]
                if not blk.is_null:
                    self.content.setdefault(blk.block_id, {})[pos % bs] = req.all_token_ids[pos]

    def _check_hits(self, req, hits) -> None:
        for group, blocks in enumerate(hits.blocks):
            bs = self.m.kv_cache_groups[group].kv_cache_spec.block_size
            for i, blk in enumerate(blocks):
                if blk.is_null:
                    continue
                want = req.all_token_ids[i * bs : (i + 1) * bs]
                got = [self.content.get(blk.block_id, {}).get(j) for j in range(bs)]
                assert got == want, f"hit block {blk.block_id} holds {got}, request needs {want}"

    def _schedule(self, req) -> bool:
        """Admit or continue ``req`` for one chunk; False when the pool is full."""
        new = req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        hits, num_hit = self.m.get_computed_blocks(req) if new else (None, 0)
        if new:
            self._check_hits(req, hits)
        num_new = min(req.num_tokens - req.num_computed_tokens - num_hit, self.chunk)
        out = self.m.allocate_slots(req, num_new, num_hit, hits, full_sequence_must_fit=new)
        if out is None:
            return False
        start = req.num_computed_tokens + num_hit
        self._write(req, start, start + num_new)
        req.num_computed_tokens = start + num_new
        req.status = RequestStatus.RUNNING
        return True

    # ---- rules ------------------------------------------------------------------------------

    @rule(
        prefix=st.sampled_from(PREFIXES),
        cut=st.integers(0, 40),
        tail=st.lists(st.integers(0, 5), max_size=20),
    )
    def add_request(self, prefix, cut, tail):
        tokens = prefix[:cut] + tail
        if tokens:
            self.waiting.append(make_request(tokens, self.m))

    @precondition(lambda self: self.waiting)
    @rule()
    def admit_next(self):
        req = self.waiting[0]
        if self._schedule(req):
            self.waiting.pop(0)
            self.running.append(req)
            self.tables[req.request_id] = [tuple(g) for g in self.m.get_block_ids(req.request_id)]

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 10), token=st.integers(0, 5))
    def step_running(self, i, token):
        req = self.running[i % len(self.running)]
        if req.num_computed_tokens == req.num_tokens:
            if req.num_tokens >= 190:
                return
            req.append_output_token_ids(token)  # decode: the sampled token becomes input
        self._schedule(req)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 10))
    def preempt(self, i):
        req = self.running.pop(i % len(self.running))
        self.m.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.tables.pop(req.request_id)
        self.waiting.insert(0, req)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 10))
    def finish(self, i):
        req = self.running.pop(i % len(self.running))
        self.m.free(req)
        req.status = RequestStatus.FINISHED_STOPPED
        self.tables.pop(req.request_id)

    @rule()
    def reset(self):
        ok = self.m.reset_prefix_cache()
        assert ok == (not self.running)

    # ---- invariants --------------------------------------------------------------------------

    @invariant()
    def invariants_hold(self):
        if not hasattr(self, "m"):
            return
        if self.initialized:
            CoreMachine.steps_run += 1
        self.initialized = True
        self.m.check_invariants()
        null = self.m.block_pool.null_block.block_id
        for req in self.running:
            now = [tuple(g) for g in self.m.get_block_ids(req.request_id)]
            for old_g, new_g in zip(self.tables[req.request_id], now):
                assert len(new_g) >= len(old_g), "a block table shrank"
                for a, b in zip(old_g, new_g):
                    assert a == b or b == null, "a block id changed under a running request"
            self.tables[req.request_id] = now

    def teardown(self):
        if hasattr(self, "m"):
            for req in self.running:
                self.m.free(req)
            self.m.check_invariants()
            assert self.m.num_free_blocks == self.m.block_pool.num_gpu_blocks - 1


@pytest.mark.slow
def test_core_stateful_invariants():
    CoreMachine.steps_run = 0
    run_state_machine_as_test(
        CoreMachine,
        settings=settings(
            max_examples=MAX_EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        ),
    )
    assert CoreMachine.steps_run >= MIN_STEPS, f"only {CoreMachine.steps_run} steps ran"
