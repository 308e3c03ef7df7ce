"""Prefill/decode disaggregation between two real engines in one process (`NixlConnector`), over
both transfer backends (NIXL and the TCP fallback).

The producer P (``kv_producer``) prefills with ``do_remote_decode`` and ``max_tokens=1``, holds
its blocks and returns ``kv_transfer_params``; the consumer D (``kv_consumer``) fetches the
blocks (pull: reads them; push: P writes them) and decodes. Every test checks D's greedy tokens
against P run colocated, token by token, and that both pools end all free with their
invariants holding. Faults: a dead producer, a handshake mismatch (block size, hash seed), an
expired lease, a push that never comes, an abort while fetching.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from redis_server import free_port

from pagedkv import LLM, SamplingParams
from pagedkv.kv_transfer.side_channel import HandshakeError, KVAgentMetadata, check_compatible
from pagedkv.transfer import nixl_import_error

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea. The sea is wide and",  # > 1 block
    "def fibonacci(n):\n    # return the n-th Fibonacci number\n    if n < 2:\n        return n\n",
]
MAX_TOKENS = 8


def backends() -> list[str]:
    return ["tcp"] if nixl_import_error() else ["nixl", "tcp"]


def make_llm(role: str, backend: str, **extra) -> LLM:
    engine_kw = {
        k: extra.pop(k)
        for k in list(extra)
        if k
        in ("block_size", "prefix_caching_hash_algo", "enable_kv_cache_events", "kv_cache_layout")
    }
    cfg = {
        "kv_connector": "NixlConnector",
        "kv_role": role,
        "kv_connector_extra_config": {
            "side_channel_port": free_port(),
            "backend": backend,
            "handshake_timeout_s": 2.0,
            **extra,
        },
    }
    return LLM(num_kv_blocks=96, max_model_len=512, kv_transfer_config=cfg, **engine_kw)


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def all_free(llm: LLM) -> bool:
    e = llm.llm_engine
    e.check_invariants()
    return e.kv_cache_manager.num_free_blocks == e.kv_cache_config.num_blocks - 1


def settle(*llms: LLM, timeout_s: float = 10.0) -> None:
    """Step every engine until its pool is all free (notifications and leases settle)."""
    deadline = time.monotonic() + timeout_s
    while not all(all_free(x) for x in llms):
        assert time.monotonic() < deadline, "blocks leaked: pools not free"
        for x in llms:
            x.llm_engine.step()
        time.sleep(0.005)


def prefill(p: LLM, prompts: list[str]) -> list[dict]:
    outs = p.generate(
        prompts, greedy(1, kv_transfer_params={"do_remote_decode": True}), use_tqdm=False
    )
    params = [o.kv_transfer_params for o in outs]
    for prm, _prompt in zip(params, prompts):
        assert prm is not None and prm["do_remote_prefill"] and prm["remote_block_ids"], prm
    return params


def decode(d: LLM, prompts: list[str], params: list[dict], **kw) -> list[list[int]]:
    outs = d.generate(
        prompts, [greedy(kv_transfer_params=prm, **kw) for prm in params], use_tqdm=False
    )
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module", params=backends())
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    llm = LLM(num_kv_blocks=96, max_model_len=512)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    return {p: list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, outs)}


@pytest.fixture(scope="class")
def pair(backend: str) -> Iterator[tuple[LLM, LLM]]:
    p = make_llm("kv_producer", backend)
    d = make_llm("kv_consumer", backend)
    try:
        yield p, d
    finally:
        p.llm_engine.shutdown()
        d.llm_engine.shutdown()


class TestOnePair:
    """Tests that share one producer/consumer pair (class scope: it is let go before the
    tests below build their own engines, so at most four engines are alive at once)."""

    def test_pull_is_exact_and_frees_both_pools(self, pair, reference):
        p, d = pair
        params = prefill(p, PROMPTS)
        assert not all_free(p)  # held for the consumer
        d_conn = d.llm_engine.connector
        before = d_conn.num_transfers
        assert decode(d, PROMPTS, params) == [reference[x] for x in PROMPTS]
        assert d_conn.num_transfers - before == len(PROMPTS)
        settle(p, d)
        # Freed by the consumer's notification, not by the lease.
        assert p.llm_engine.connector.num_expired_leases == 0

    def test_a_second_producer_reusing_request_ids_is_read_too(self, pair, backend, reference):
        """Request ids are unique per producer only (an `LLM` counts from 0): a consumer that has
        read P1's request "0" still reads P2's "0" (regression: it recomputed it, silently)."""
        _, d = pair
        p1, p2 = make_llm("kv_producer", backend), make_llm("kv_producer", backend)
        try:
            params1, params2 = prefill(p1, PROMPTS[:1]), prefill(p2, PROMPTS[:1])
            assert params1[0]["remote_request_id"] == params2[0]["remote_request_id"]
            for p, params in ((p1, params1), (p2, params2)):
                before = d.llm_engine.connector.num_transfers
                assert decode(d, PROMPTS[:1], params) == [reference[PROMPTS[0]]]
                assert d.llm_engine.connector.num_transfers == before + 1
                settle(p, d)
        finally:
            p1.llm_engine.shutdown()
            p2.llm_engine.shutdown()

    def test_consumer_reads_only_the_tail_after_its_prefix_hit(self, pair, reference):
        p, d = pair
        prompt = PROMPTS[2]
        d.generate([prompt[:60]], greedy(1), use_tqdm=False)  # D caches a prefix of it
        stats = d.llm_engine.kv_cache_manager.total_prefix_cache_stats
        hits0 = stats.hits
        params = prefill(p, [prompt])
        assert decode(d, [prompt], params) == [reference[prompt]]
        assert stats.hits > hits0  # D used its own prefix; only the tail moved
        settle(p, d)

    def test_consumer_n_greater_than_one(self, pair, reference):
        p, d = pair
        params = prefill(p, PROMPTS[:1])
        outs = d.generate(PROMPTS[:1], greedy(n=2, kv_transfer_params=params[0]), use_tqdm=False)
        assert [list(c.token_ids) for c in outs[0].outputs] == [reference[PROMPTS[0]]] * 2
        settle(p, d)

    def test_abort_while_fetching_leaks_nothing(self, pair):
        p, d = pair
        params = prefill(p, PROMPTS[1:2])
        engine = d.llm_engine
        engine.add_request("abort-me", PROMPTS[1], greedy(kv_transfer_params=params[0]))
        engine.step()  # admitted: its blocks wait for the remote KV
        engine.abort_request("abort-me")
        settle(p, d)

    def test_a_peer_that_never_answers_the_handshake_is_recomputed_after_the_timeout(
        self, pair, backend, reference, caplog
    ):
        """The params name a side channel that accepts connections but never replies: the
        handshake times out (2 s here), the read fails and the consumer recomputes, exactly."""
        import socket

        _, d = pair
        # Its own producer with a short lease: nobody reads these blocks, the lease frees them.
        p = make_llm("kv_producer", backend, kv_lease_duration=1.0)
        params = prefill(p, PROMPTS[:1])[0]
        with socket.socket() as silent:
            silent.bind(("127.0.0.1", 0))
            silent.listen(8)  # connections complete in the kernel; nobody ever reads or answers
            bad = {
                **params,
                "remote_port": silent.getsockname()[1],
                "remote_engine_id": "silent-engine",
            }
            failed0 = d.llm_engine.connector.num_failed_transfers
            with caplog.at_level("WARNING"):
                assert decode(d, PROMPTS[:1], [bad]) == [reference[PROMPTS[0]]]
        assert "did not answer the handshake within 2 s" in caplog.text  # bounded, not hung
        assert d.llm_engine.connector.num_failed_transfers > failed0
        try:
            settle(p, d, timeout_s=20.0)  # P's blocks for these params go by lease
            assert p.llm_engine.connector.num_expired_leases == 1
        finally:
            p.llm_engine.shutdown()


def test_a_completed_read_is_a_remote_kv_event_with_the_producers_hashes(reference):
    """The consumer reports each completed read as BlockStored(medium REMOTE): the full blocks
    that moved, hashed as the producer's pool hashed them, with their tokens."""
    from pagedkv.core.events import BlockStored

    be = backends()[0]
    p = make_llm("kv_producer", be, enable_kv_cache_events=True)
    d = make_llm("kv_consumer", be, enable_kv_cache_events=True)
    try:
        prompt = PROMPTS[2]
        params = prefill(p, [prompt])
        p_stored = [ev for ev in p.llm_engine.take_kv_events() if isinstance(ev, BlockStored)]
        d.llm_engine.take_kv_events()
        assert decode(d, [prompt], params) == [reference[prompt]]
        remote = [
            ev
            for ev in d.llm_engine.take_kv_events()
            if isinstance(ev, BlockStored) and ev.medium == "REMOTE"
        ]
        assert len(remote) == 1
        ev = remote[0]
        p_hashes = [h for e in p_stored for h in e.block_hashes]
        assert ev.block_hashes and ev.block_hashes == p_hashes[: len(ev.block_hashes)]
        n = len(ev.block_hashes) * ev.block_size
        assert (
            ev.token_ids == [t for e in p_stored for t in e.token_ids][:n]
            and ev.parent_block_hash is None
        )
        settle(p, d)
    finally:
        p.llm_engine.shutdown()
        d.llm_engine.shutdown()


def test_block_contiguous_layout_transfers_exactly_and_a_layout_mismatch_is_refused(
    reference, caplog
):
    """BLNHC (each block one range across layers: one large descriptor per block) moves the
    same KV; a peer with another layout is refused naming the field, and D recomputes."""
    be = backends()[0]
    # A short lease: the refused read's blocks on P go by lease, and settle waits for it.
    p = make_llm("kv_producer", be, kv_cache_layout="BLNHC", kv_lease_duration=5.0)
    d = make_llm("kv_consumer", be, kv_cache_layout="BLNHC")
    other = None
    try:
        params = prefill(p, PROMPTS)
        assert decode(d, PROMPTS, params) == [reference[x] for x in PROMPTS]
        assert d.llm_engine.connector.num_failed_transfers == 0
        settle(p, d)
        d.llm_engine.shutdown()
        d = None  # done with it: one engine fewer alive at once (the suite's memory peak)
        other = make_llm("kv_consumer", be)
        params = prefill(p, PROMPTS[:1])
        with caplog.at_level("WARNING"):
            assert decode(other, PROMPTS[:1], params) == [reference[PROMPTS[0]]]
        assert "kv_cache_layout" in caplog.text
        settle(p, other, timeout_s=30.0)
    finally:
        for x in (p, d, other):
            if x is not None:
                x.llm_engine.shutdown()


def test_a_lost_done_notification_is_covered_by_the_lease(backend, reference):
    """The consumer's done-notification is lost in transit (its reads are posted without it:
    fault injection on the real backend): the consumer still decodes exactly from the KV it
    read, and the producer frees the blocks when the lease (1 s) expires, counting it."""
    p = make_llm("kv_producer", backend, kv_lease_duration=1.0)
    d = make_llm("kv_consumer", backend)
    try:
        be = d.llm_engine.connector.backend
        real_read = be.read_blocks
        be.read_blocks = lambda peer, local, remote, notif=b"": real_read(peer, local, remote, b"")
        params = prefill(p, PROMPTS[:1])
        assert decode(d, PROMPTS[:1], params) == [reference[PROMPTS[0]]]
        assert d.llm_engine.connector.num_failed_transfers == 0  # the KV did move
        assert not all_free(p)  # no notification: still held
        settle(p, d)
        assert p.llm_engine.connector.num_expired_leases >= 1
    finally:
        p.llm_engine.shutdown()
        d.llm_engine.shutdown()


def test_dead_producer_consumer_recomputes(backend, reference):
    p = make_llm("kv_producer", backend)
    d = make_llm("kv_consumer", backend)
    try:
        params = prefill(p, PROMPTS)
        p.llm_engine.shutdown()  # gone after answering, before the read
        assert decode(d, PROMPTS, params) == [reference[x] for x in PROMPTS]
        assert d.llm_engine.connector.num_failed_transfers == len(PROMPTS)
        settle(d)
    finally:
        d.llm_engine.shutdown()


def test_lease_expiry_frees_the_producer(backend):
    p = make_llm("kv_producer", backend, kv_lease_duration=0.3)
    try:
        prefill(p, PROMPTS[:1])
        assert not all_free(p)
        settle(p, timeout_s=5)
        assert p.llm_engine.connector.num_expired_leases == 1
    finally:
        p.llm_engine.shutdown()


@pytest.mark.parametrize(
    "field,p_kw,d_kw",
    [
        ("block_size", {}, {"block_size": 32}),
        ("hash_seed", {}, {"prefix_caching_hash_algo": "sha256"}),
    ],
)
def test_handshake_mismatch_refused_with_the_field_named(
    backend, reference, caplog, field, p_kw, d_kw
):
    p = make_llm("kv_producer", backend, **p_kw)
    d = make_llm("kv_consumer", backend, **d_kw)
    try:
        params = prefill(p, PROMPTS[:1])
        with caplog.at_level("ERROR"):
            assert decode(d, PROMPTS[:1], params) == [reference[PROMPTS[0]]]
        assert any(f"{field} differs" in r.getMessage() for r in caplog.records), caplog.text
        settle(d)
    finally:
        p.llm_engine.shutdown()
        d.llm_engine.shutdown()


def test_check_compatible_names_the_model():
    base = KVAgentMetadata("e", "tcp", b"", "model-a", "s", 16, "float32", "LBNHC", 10, (64,))
    other = KVAgentMetadata("e", "tcp", b"", "model-b", "s", 16, "float32", "LBNHC", 10, (64,))
    with pytest.raises(HandshakeError, match="model differs"):
        check_compatible(base, other)
    with pytest.raises(HandshakeError, match="engine_id mismatch"):
        check_compatible(base, base, expected_engine_id="someone-else")


def test_push_is_exact(backend, reference):
    p = make_llm("kv_producer", backend, transfer_mode="push")
    d = make_llm("kv_consumer", backend)
    try:
        params = prefill(p, PROMPTS)
        assert all(prm["transfer_mode"] == "push" for prm in params)
        # The producer must step to serve the registrations: alternate the two engines.
        engine = d.llm_engine
        for i, (prompt, prm) in enumerate(zip(PROMPTS, params)):
            engine.add_request(f"push-{i}", prompt, greedy(kv_transfer_params=prm))
        done: dict[str, list[int]] = {}
        deadline = time.monotonic() + 60
        while len(done) < len(PROMPTS):
            assert time.monotonic() < deadline
            p.llm_engine.step()
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        assert [done[f"push-{i}"] for i in range(len(PROMPTS))] == [reference[x] for x in PROMPTS]
        assert engine.connector.num_transfers >= len(PROMPTS)
        settle(p, d)
    finally:
        p.llm_engine.shutdown()
        d.llm_engine.shutdown()


def test_push_that_never_arrives_fails_over_to_recompute(backend, reference):
    p = make_llm("kv_producer", backend, transfer_mode="push")
    d = make_llm("kv_consumer", backend, push_timeout_s=1.0)
    try:
        params = prefill(p, PROMPTS[:1])
        # P never steps while D decodes: the registration is never served.
        assert decode(d, PROMPTS[:1], params) == [reference[PROMPTS[0]]]
        assert d.llm_engine.connector.num_failed_transfers == 1
        settle(d)
    finally:
        p.llm_engine.shutdown()
        d.llm_engine.shutdown()


def test_async_llm_stats_follow_blocks_freed_outside_a_request_step():
    """An idle producer's stats (what /metrics' kv_cache_usage_perc and the dashboard read) follow
    the pool when a lease expiry frees the held blocks in a step that has no output (issue 35:
    the gauge stayed at the last request's usage while every block was free)."""
    import asyncio

    from pagedkv.engine.async_llm import AsyncLLM

    p = make_llm("kv_producer", "tcp", kv_lease_duration=0.3)
    a = AsyncLLM(p.llm_engine)
    try:

        async def run() -> None:
            params = greedy(1, kv_transfer_params={"do_remote_decode": True})
            stream = await a.add_request(
                "held", {"prompt_token_ids": list(range(100, 180))}, params
            )
            async for _ in stream:
                pass

        asyncio.run(run())
        total = p.llm_engine.kv_cache_config.num_blocks - 1
        deadline = time.monotonic() + 10
        while p.llm_engine.scheduler.has_pending_kv_transfers():  # the lease expires
            assert time.monotonic() < deadline, "the lease never expired"
            time.sleep(0.02)
        time.sleep(0.1)  # the engine thread finishes the step that freed the blocks
        assert p.llm_engine.connector.num_expired_leases == 1
        assert a.last_stats.num_free_blocks == total
        assert a.last_stats.kv_cache_usage == 0.0
    finally:
        a.shutdown()
        p.llm_engine.shutdown()
