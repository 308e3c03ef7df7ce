"""The router's pure parts: prompt hashing (against the engine's own hasher and a real engine's
KV events), the prefix index (events in, longest prefixes out; a hypothesis model check) and
the routing policies."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from pagedkv.core.hashing import HASH_FUNCTIONS, get_hash_fn_by_name, resolve_none_hash_seed
from pagedkv.core.request import KVCacheRequest, get_request_block_hasher
from pagedkv.router.hashing import prompt_block_hashes, to_external
from pagedkv.router.index import PrefixIndex, PrefixMatch
from pagedkv.router.scoring import ReplicaLoad, RoutingPolicy, RoutingWeights, kv_cost

# ---- hashing ------------------------------------------------------------------------------------


@pytest.mark.parametrize("algo", sorted(HASH_FUNCTIONS))
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_prompt_block_hashes_equal_the_engines_request_hasher(algo: str, salt: str | None) -> None:
    tokens = list(range(100, 171))  # 4 full blocks of 16 and a partial one
    fn = get_hash_fn_by_name(algo)
    req = KVCacheRequest(
        "r", tokens, block_hasher=get_request_block_hasher(16, fn), cache_salt=salt
    )
    want = [to_external(h) for h in req.block_hashes]
    got = prompt_block_hashes(tokens, 16, algo, resolve_none_hash_seed(fn), cache_salt=salt)
    assert len(got) == 4 and got == want


def test_prompt_block_hashes_with_lora_equal_the_engines() -> None:
    fn = get_hash_fn_by_name("sha256_cbor")
    req = KVCacheRequest(
        "r",
        list(range(40)),
        block_hasher=get_request_block_hasher(8, fn),
        lora_name="ad",
        lora_path="/p",
    )
    assert prompt_block_hashes(list(range(40)), 8, "sha256_cbor", None, lora=("ad", "/p")) == [
        to_external(h) for h in req.block_hashes
    ]


def test_another_seed_or_block_size_gives_other_hashes() -> None:
    toks = list(range(64))
    base = prompt_block_hashes(toks, 16, "sha256_cbor", "vllm-none-hash")
    assert prompt_block_hashes(toks, 16, "sha256_cbor", "other") != base
    assert prompt_block_hashes(toks, 32, "sha256_cbor", "vllm-none-hash")[0] != base[0]
    assert prompt_block_hashes(toks[:15], 16, "sha256_cbor", None) == []
    with pytest.raises(ValueError):
        prompt_block_hashes(toks, 0, "sha256_cbor", None)


def test_to_external_agrees_for_bytes_and_int_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedkv.core.hashing import maybe_convert_block_hash

    h = bytes(range(32))
    as_bytes = maybe_convert_block_hash(h)
    monkeypatch.setenv("PAGEDKV_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    as_int = maybe_convert_block_hash(h)
    assert isinstance(as_bytes, bytes) and isinstance(as_int, int)
    assert to_external(as_bytes) == to_external(as_int) == as_int


@pytest.mark.slow
def test_prompt_block_hashes_equal_a_real_engines_block_stored_events() -> None:
    from pagedkv import LLM
    from pagedkv.engine.sampling_params import SamplingParams

    llm = LLM(num_kv_blocks=24, max_model_len=128, block_size=8, enable_kv_cache_events=True)
    eng = llm.llm_engine
    ids = eng.tokenizer.encode(
        "A router must predict which replica holds the prefix of this prompt, "
        "so it hashes the prompt's blocks exactly as every replica does."
    )
    assert len(ids) >= 24
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0.0))
    stored = [
        h
        for ev in eng.kv_cache_manager.take_events()
        if isinstance(ev, BlockStored)
        for h in ev.block_hashes
    ]
    want = prompt_block_hashes(ids, 8, eng.config.prefix_caching_hash_algo, None)
    assert [to_external(h) for h in stored][: len(want)] == want


# ---- index --------------------------------------------------------------------------------------


def stored(hashes: list[int], medium: str = "GPU", tokens: bool = True) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=[1] * (4 * len(hashes)) if tokens else [],
        block_size=4,
        lora_id=None,
        medium=medium,
    )


def test_index_match_device_then_tier_prefix() -> None:
    idx = PrefixIndex()
    idx.apply_batch("a", [stored([1, 2, 3])])
    idx.apply("b", stored([1, 2]))
    idx.apply("b", stored([3, 4], medium="STORAGE", tokens=False))  # a tier: hashes only
    idx.apply("c", stored([2, 3]))  # no block 0: no prefix
    m = idx.match([1, 2, 3, 4, 5])
    assert m == {"a": PrefixMatch(3, 0), "b": PrefixMatch(2, 2)}
    assert len(idx) == 4 and idx.num_blocks("b") == 4
    assert idx.match([]) == {} and idx.match([9, 1]) == {}


def test_index_removed_drops_one_medium_and_cleared_drops_the_replica() -> None:
    idx = PrefixIndex()
    idx.apply("a", stored([1, 2]))
    idx.apply("a", stored([1, 2], medium="CPU", tokens=False))  # also in the CPU offload tier
    idx.apply("a", BlockRemoved(block_hashes=[1], medium="GPU"))
    assert idx.match([1, 2]) == {"a": PrefixMatch(0, 2)}  # block 0 now only in the tier
    idx.apply("a", BlockRemoved(block_hashes=[1], medium="CPU"))
    assert idx.match([1, 2]) == {}
    idx.apply("b", stored([1, 2]))
    idx.apply("a", AllBlocksCleared())
    assert idx.match([1, 2]) == {"b": PrefixMatch(2, 0)} and len(idx) == 2
    idx.remove_replica("b")
    assert len(idx) == 0 and idx.replicas() == []


def test_index_ignores_remote_and_unknown_removals_and_keys_bytes_as_ints() -> None:
    idx = PrefixIndex()
    idx.apply("a", stored([5], medium="REMOTE"))
    idx.apply("a", BlockRemoved(block_hashes=[77], medium="GPU"))  # never stored: no-op
    assert len(idx) == 0
    h = bytes(range(16))
    idx.apply(
        "a",
        BlockStored(
            block_hashes=[h],
            parent_block_hash=None,
            token_ids=[1, 2],
            block_size=2,
            lora_id=None,
            medium=None,
        ),
    )  # vLLM's default medium: GPU
    assert idx.match([to_external(h)]) == {"a": PrefixMatch(1, 0)}


def test_index_cpu_engine_pool_is_device() -> None:
    idx = PrefixIndex()
    idx.apply("a", stored([1], medium="CPU"))  # a CPU engine's pool reports "CPU" with tokens
    assert idx.match([1]) == {"a": PrefixMatch(1, 0)}


_ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "tier", "remove_dev", "remove_tier", "clear"]),
        st.sampled_from(["a", "b", "c"]),
        st.lists(st.integers(0, 5), min_size=1, max_size=3),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(_ops, st.lists(st.integers(0, 5), max_size=6))
def test_index_agrees_with_a_set_model(ops: list, query: list[int]) -> None:
    """Model: per replica, a set of device hashes and a set of tier hashes (one tier, "STORAGE").
    Also checks the index's device sets (what `match` intersects) against the model."""
    idx = PrefixIndex()
    dev: dict[str, set[int]] = {"a": set(), "b": set(), "c": set()}
    tier: dict[str, set[int]] = {"a": set(), "b": set(), "c": set()}
    for op, r, hs in ops:
        if op == "store":
            idx.apply(r, stored(hs))
            dev[r] |= set(hs)
        elif op == "tier":
            idx.apply(r, stored(hs, medium="STORAGE", tokens=False))
            tier[r] |= set(hs)
        elif op == "remove_dev":
            idx.apply(r, BlockRemoved(block_hashes=hs, medium="GPU"))
            dev[r] -= set(hs)
        elif op == "remove_tier":
            idx.apply(r, BlockRemoved(block_hashes=hs, medium="STORAGE"))
            tier[r] -= set(hs)
        else:
            idx.apply(r, AllBlocksCleared())
            dev[r].clear()
            tier[r].clear()
    assert len(idx) == len(set().union(*dev.values(), *tier.values()))
    on_device = {h: {r for r in dev if h in dev[r]} for h in set().union(*dev.values())}
    assert idx._device_of == on_device
    want = {}
    for r in ("a", "b", "c"):
        d = 0
        while d < len(query) and query[d] in dev[r]:
            d += 1
        t = d
        while t < len(query) and (query[t] in dev[r] or query[t] in tier[r]):
            t += 1
        if t > 0:
            want[r] = PrefixMatch(d, t - d)
    assert idx.match(query) == want
    # The simulator's power-of-K path: exact matches for chosen replicas, and the deepest holders.
    assert idx.match_replicas(query, ["a", "b", "c"]) == want
    assert idx.match_replicas(query, ["b"]) == {k: v for k, v in want.items() if k == "b"}
    held = {r: {i for i, h in enumerate(query) if h in dev[r] or h in tier[r]} for r in dev}
    deepest = idx.deepest_holders(query, 2, exclude={"c"})
    ranked = sorted((r for r in ("a", "b") if held[r]), key=lambda r: -max(held[r]))
    assert len(deepest) == min(2, len(ranked)) and "c" not in deepest
    assert sorted(max(held[r]) for r in deepest) == sorted(max(held[r]) for r in ranked[:2])


# ---- scoring ------------------------------------------------------------------------------------

R = ["a", "b", "c"]


def test_round_robin_cycles_and_load_picks_the_least_loaded() -> None:
    rr = RoutingPolicy("round-robin")
    assert [rr.choose(R, 4, {}, {}, 16).replica for _ in range(4)] == ["a", "b", "c", "a"]
    lp = RoutingPolicy("load")
    loads = {"a": ReplicaLoad(2, 1), "b": ReplicaLoad(0, 0, 0.5), "c": ReplicaLoad(0, 0, 0.1)}
    d = lp.choose(R, 4, {"a": PrefixMatch(4, 0)}, loads, 16)
    assert (d.replica, d.reason) == ("c", "load")
    with pytest.raises(ValueError):
        RoutingPolicy("random")
    with pytest.raises(ValueError):
        rr.choose([], 1, {}, {}, 16)
    assert RoutingPolicy("kv").choose(["x"], 3, {}, {}, 16).reason == "only_replica"


def test_kv_picks_the_holder_and_spreads_cold_requests() -> None:
    kv = RoutingPolicy("kv")
    d = kv.choose(R, 8, {"b": PrefixMatch(6, 0), "c": PrefixMatch(2, 0)}, {}, 16)
    assert (d.replica, d.reason, d.predicted_hit_blocks) == ("b", "kv_hit", 6)
    cold = [kv.choose(R, 8, {}, {}, 16) for _ in range(3)]
    assert {x.replica for x in cold} == set(R) and {x.reason for x in cold} == {"load"}


def test_kv_trades_prefix_against_load() -> None:
    kv = RoutingPolicy("kv")
    busy = {"a": ReplicaLoad(num_running=4), "b": ReplicaLoad()}
    # A 1-block hit does not pay for 4 running requests; a 10-block hit outweighs 1 running one.
    d = kv.choose(["a", "b"], 10, {"a": PrefixMatch(1, 0)}, busy, 16)
    assert (d.replica, d.reason, d.predicted_hit_blocks) == ("b", "load_over_prefix", 0)
    one = {"a": ReplicaLoad(num_running=1, active_blocks=5), "b": ReplicaLoad()}
    assert kv.choose(["a", "b"], 10, {"a": PrefixMatch(10, 0)}, one, 16).replica == "a"
    # Equal costs (a 2-block hit against 2 more active blocks): the prefix wins the tie.
    tie = {"a": ReplicaLoad(num_running=1, active_blocks=2), "b": ReplicaLoad()}
    assert kv_cost(10, PrefixMatch(2, 0), tie["a"], RoutingWeights()) == kv_cost(
        10, None, tie["b"], RoutingWeights()
    )
    assert {
        kv.choose(["a", "b"], 10, {"a": PrefixMatch(2, 0)}, tie, 16).replica for _ in range(4)
    } == {"a"}
    w = RoutingWeights(tier_credit=0.5)
    assert kv_cost(10, PrefixMatch(2, 4), ReplicaLoad(), w) == pytest.approx(10 - 4 + 10)
    assert (
        kv_cost(10, PrefixMatch(0, 0), ReplicaLoad(active_blocks=7, num_waiting=1), w)
        == 10 + 7 + 10 + 10
    )


def test_kv_temperature_samples_reproducibly() -> None:
    w = RoutingWeights(temperature=5.0)
    picks = [
        RoutingPolicy("kv", w, seed=1).choose(R, 8, {"a": PrefixMatch(3, 0)}, {}, 16).replica
        for _ in range(2)
    ]
    assert picks[0] == picks[1]
    many = RoutingPolicy("kv", w, seed=2)
    got = {many.choose(R, 8, {"a": PrefixMatch(3, 0)}, {}, 16).replica for _ in range(60)}
    assert got == set(R)  # softmax, not argmax
    with pytest.raises(ValueError):
        RoutingPolicy("kv", RoutingWeights(temperature=-1))


# ---- event feed (a real ZMQ publisher, no model) ----------------------------------------------------


def _wait(cond, timeout: float = 5.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_event_feed_replays_on_connect_follows_live_and_resyncs_after_a_restart() -> None:
    import threading
    import time

    from pagedkv.core.event_transport import ZmqEventPublisher
    from pagedkv.router.subscriber import EventFeed

    idx, lock, resyncs = PrefixIndex(), threading.Lock(), []
    pub = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    feed = None
    try:
        pub.publish([stored([1, 2])])
        pub.publish([BlockRemoved(block_hashes=[2], medium="GPU")])
        assert _wait(lambda: pub.next_seq == 2)
        feed = EventFeed(
            "a",
            pub.endpoint,
            pub.replay_endpoint,
            idx,
            lock,
            on_resync=lambda r, why: resyncs.append(why),
        ).start()
        assert feed.wait_synced(5) and resyncs == ["connect"]
        assert (
            idx.match([1, 2]) == {"a": PrefixMatch(1, 0)} and feed.last_seq == 1
        )  # from the replay
        pub.publish([stored([7])])
        assert _wait(lambda: 7 in idx) and feed.last_seq == 2  # live
        # The replica restarts on the same endpoints: numbering starts at 0 again.
        endpoints = pub.endpoint, pub.replay_endpoint
        pub.shutdown()
        pub = ZmqEventPublisher(*endpoints)
        time.sleep(0.5)  # the SUB reconnects (a real replica takes seconds to come back)
        for h in (40, 41, 42, 43):  # seq 0..3 <= last: only a restart explains them
            pub.publish([stored([h])])
        assert _wait(lambda: 43 in idx and 1 not in idx and 7 not in idx)
        assert resyncs[-1] == "restart" and len(idx) == 4
    finally:
        if feed is not None:
            feed.stop()
        pub.shutdown()
