"""The P2P tier: instances serve each other's cached prefixes over the KV transfer backend.

Unit level: the chunk store (LRU, leases, checksums); two tiers in one process over NIXL and the
TCP backend (lookups, reads byte for byte, pins released, a refused handshake naming the field,
a dead peer). Engine level: two real engines, each serving its CPU tier's chunks to the other:
the second one loads the first one's prefix from it and generates the same tokens.
"""

from __future__ import annotations

import logging
import time

import pytest
from redis_server import free_port

from pagedkv.offload.p2p_tier import ChunkStore, P2PTier, compat_error
from pagedkv.transfer import nixl_import_error

CHUNK = 4096


def backends() -> list[str]:
    return ["tcp"] if nixl_import_error() else ["nixl", "tcp"]


def chunk(i: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(CHUNK))


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def test_chunk_store_lru_skips_leased_entries_and_checks_sums():
    store = ChunkStore(2, CHUNK)
    assert store.put(key(1), chunk(1)) and store.put(key(2), chunk(2))
    (e1,) = store.lookup([key(1)], pin_s=60)  # leased: key 2 is now the LRU victim
    assert store.put(key(3), chunk(3))
    assert key(1) in store and key(2) not in store and store.evicted == [key(2)]
    assert store.verify(e1.units, e1.length, e1.checksum)
    assert not store.verify(e1.units, e1.length, e1.checksum ^ 1)
    store.release([key(1)])
    assert store.put(key(4), chunk(4)) and key(1) not in store  # released: evictable again
    reserved = [store.reserve(CHUNK), store.reserve(CHUNK)]
    assert None not in reserved and store.reserve(CHUNK) is None  # every unit reserved


def test_chunk_store_units_hold_variable_payloads():
    store = ChunkStore(8, 100)
    a, b = bytes(range(250)), bytes(x % 7 for x in range(600))
    assert store.put(key(1), a) and store.stored_bytes() == 300  # 3 units
    assert store.put(key(2), b)  # 6 units: evicts key 1 (LRU) to find them
    assert key(1) not in store and store.evicted == [key(1)]
    (e,) = store.lookup([key(2)])
    assert len(e.units) == 6 and store.read(e.units, e.length) == b
    assert not store.put(key(3), bytes(1000))  # larger than the store: refused, nothing lost
    assert key(2) in store


def test_the_offload_factory_builds_the_p2p_tier_like_every_tier(tmp_path):
    """``--kv-offload ...,p2p:...`` goes through `build_offloading` like disk and Redis: the P2P
    tier comes last, with the fingerprint, the hash seed and the backend it was given."""
    import torch

    from pagedkv.offload.factory import build_offloading
    from pagedkv.offload.fingerprint import OffloadFingerprint
    from pagedkv.offload.spec import parse_offload_spec
    from pagedkv.offload.tiering import TieringOffloadingManager
    from pagedkv.ops.kv_cache import allocate_kv_cache

    fp = OffloadFingerprint.create("tiny", torch.float32, 4, "LBNHC", 2, 2, 8)
    buf, _ = allocate_kv_cache("LBNHC", 2, 8, 4, 2, 8, torch.float32)
    spec = parse_offload_spec(f"cpu:64KiB,disk:{tmp_path}:1MiB,p2p:127.0.0.1:{free_port()}")
    mgr, _ = build_offloading(spec, fp, buf, "LBNHC", hash_seed="seed", p2p_backend="tcp")
    try:
        assert isinstance(mgr, TieringOffloadingManager) and [t.name for t in mgr.tiers] == [
            "disk",
            "p2p",
        ]
        p2p = mgr.tiers[1]
        assert isinstance(p2p, P2PTier) and not p2p.serving and p2p.backend.kind == "tcp"
        assert (p2p.fingerprint, p2p.hash_seed) == (fp.hexdigest, "seed")
    finally:
        mgr.shutdown()


@pytest.fixture(params=backends())
def backend(request) -> str:
    return request.param


def make_tier(
    backend: str,
    peers=(),
    listen: int = 0,
    fingerprint: str = "fp",
    seed: str = "seed",
    codec=None,
) -> P2PTier:
    return P2PTier(
        list(peers),
        fingerprint,
        seed,
        CHUNK,
        listen_port=listen,
        capacity_bytes=16 * CHUNK,
        backend=backend,
        timeout_s=1.0,
        cooldown_s=0.5,
        codec=codec,
    )


def test_two_tiers_share_chunks_byte_for_byte(backend):
    port = free_port()
    server = make_tier(backend, listen=port)
    client = make_tier(backend, peers=[("127.0.0.1", port)])
    try:
        assert server.store_batch([(key(i), memoryview(chunk(i))) for i in range(4)]) == [True] * 4
        assert client.exists_batch([key(0), key(9), key(3)]) == [True, False, True]
        dst = [bytearray(CHUNK) for _ in range(3)]
        ok = client.load_batch([(key(i), memoryview(d)) for i, d in zip((0, 9, 3), dst)])
        assert ok == [True, False, True]
        assert (
            bytes(dst[0]) == chunk(0) and bytes(dst[2]) == chunk(3) and dst[1] == bytearray(CHUNK)
        )
        assert not server.store._pins  # the reader released its leases
        assert key(3) in client.store  # read chunks are kept, to be served onward
        st = client.get_stats()
        assert st.loads == 2 and st.load_failures == 1 and st.bytes_read == 2 * CHUNK
        assert [e.removed for e in server.take_events()] == [False]  # stored, medium P2P
    finally:
        client.shutdown()
        server.shutdown()


def test_a_mismatched_peer_is_refused_with_the_field_named(backend, caplog):
    port = free_port()
    server = make_tier(backend, listen=port, seed="seed-a")
    client = make_tier(backend, peers=[("127.0.0.1", port)], seed="seed-b")
    try:
        server.store_batch([(key(1), memoryview(chunk(1)))])
        with caplog.at_level(logging.WARNING):
            assert client.exists_batch([key(1)]) == [False]
        assert "hash_seed differs" in caplog.text and "PYTHONHASHSEED" in caplog.text
    finally:
        client.shutdown()
        server.shutdown()
    assert "fingerprint differs" in compat_error(
        {"version": 1, "fingerprint": "a"}, {"version": 1, "fingerprint": "b"}
    )


def test_a_dead_peer_is_a_quick_miss_and_skipped(backend):
    client = make_tier(backend, peers=[("127.0.0.1", free_port())])
    try:
        t0 = time.monotonic()
        assert client.exists_batch([key(1)]) == [False]
        assert time.monotonic() - t0 < 5
        assert not client.healthy  # cooling down
        t1 = time.monotonic()
        assert client.load_batch([(key(1), memoryview(bytearray(CHUNK)))]) == [False]
        assert time.monotonic() - t1 < 0.5  # skipped without a network round trip
    finally:
        client.shutdown()


@pytest.mark.slow
def test_an_engine_loads_its_prefix_from_a_peer_and_generates_the_same_tokens():
    from pagedkv import LLM, SamplingParams

    pa, pb = free_port(), free_port()
    prompt = (
        "A peer-to-peer KV cache lets every instance reuse the prefixes that any other instance "
        "has already computed, so a long shared system prompt is prefilled once per fleet. "
    ) * 2
    params = SamplingParams(temperature=0, max_tokens=8)
    a = LLM(
        num_kv_blocks=64,
        max_model_len=512,
        kv_offload=f"cpu:32MiB,p2p-listen:{pa}:32MiB,p2p:127.0.0.1:{pb}",
    )
    b = LLM(
        num_kv_blocks=64,
        max_model_len=512,
        kv_offload=f"cpu:32MiB,p2p-listen:{pb}:32MiB,p2p:127.0.0.1:{pa}",
    )
    try:
        ref = a.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert a.llm_engine.connector.manager.drain(30)  # A's chunks cascaded into its P2P store
        out = b.generate([prompt], params, use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == list(ref)
        tiers = b.llm_engine.make_stats().kv_connector_stats.tier_dicts()
        assert tiers["p2p"]["loads"] > 0 and tiers["p2p"]["bytes_read"] > 0
        assert out.num_cached_tokens >= 16  # loaded from the peer, not computed
    finally:
        a.llm_engine.shutdown()
        b.llm_engine.shutdown()


@pytest.mark.slow
def test_two_serve_processes_share_a_prefix_over_p2p():
    """Two ``pagedkv serve`` processes, each listening for the other: a prompt answered by A is
    served to B from A's P2P store (B's /metrics count P2P bytes read; its usage reports the
    prefix as cached) and B's greedy answer is token-identical to A's."""
    import re

    import httpx
    from test_proxy import START_TIMEOUT, _start, _stop, _wait_url

    pa, pb = free_port(), free_port()
    prompt = (
        "A peer-to-peer KV cache lets every instance reuse the prefixes that any other instance "
        "has already computed, so a long shared system prompt is prefilled once per fleet. "
    ) * 2
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    common = [
        "serve",
        "--port",
        "0",
        "--num-kv-blocks",
        "64",
        "--max-model-len",
        "512",
        "--log-stats-interval",
        "0",
    ]
    procs = [
        _start([*common, "--kv-offload", f"cpu:32MiB,p2p-listen:{pa}:32MiB,p2p:127.0.0.1:{pb}"]),
        _start([*common, "--kv-offload", f"cpu:32MiB,p2p-listen:{pb}:32MiB,p2p:127.0.0.1:{pa}"]),
    ]
    try:
        a, b = (_wait_url(p, q, START_TIMEOUT) for p, q in procs)
        want = httpx.post(a + "/v1/completions", json=body, timeout=120).json()

        def p2p_bytes_read(url: str) -> float:
            text = httpx.get(url + "/metrics", timeout=30).text
            m = re.search(
                r'^pagedkv:offload_bytes_read_total\{[^}]*tier="p2p"[^}]*\} (\S+)$', text, re.M
            )
            return float(m.group(1)) if m else 0.0

        def a_stored() -> float:  # A's P2P store has A's chunks once its CPU tier cascaded them
            text = httpx.get(a + "/metrics", timeout=30).text
            m = re.search(
                r'^pagedkv:offload_bytes_written_total\{[^}]*tier="p2p"[^}]*\} (\S+)$', text, re.M
            )
            return float(m.group(1)) if m else 0.0

        deadline = time.monotonic() + 60
        while a_stored() == 0:
            assert time.monotonic() < deadline, "A never stored its chunks in its P2P store"
            time.sleep(0.2)
        got = httpx.post(b + "/v1/completions", json=body, timeout=120).json()
        assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
        assert p2p_bytes_read(b) > 0 and p2p_bytes_read(a) == 0
    finally:
        for p, _ in procs:
            _stop(p)


def kv_like_chunk(i: int) -> bytes:
    """bf16 values of a smooth signal: compressible like real K/V pages (exponents repeat)."""
    import torch

    x = torch.linspace(-2, 2, CHUNK // 2) * (1 + i / 10)
    return x.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("codec_name", ["zstd", "int8"])
def test_codec_shrinks_the_wire_and_restores_the_chunk(backend, codec_name):
    import numpy as np

    from pagedkv.offload.codec import make_codec

    codec = make_codec(codec_name, "bfloat16", 64, quantized=False)
    port = free_port()

    server = make_tier(backend, listen=port, codec=codec)
    client = make_tier(backend, peers=[("127.0.0.1", port)], codec=codec)
    raw_reader = make_tier(backend, peers=[("127.0.0.1", port)])
    try:
        chunks = [kv_like_chunk(i) for i in range(4)]
        assert (
            server.store_batch([(key(i), memoryview(c)) for i, c in enumerate(chunks)])
            == [True] * 4
        )
        assert server.get_stats().bytes_written < 4 * CHUNK / 1.3
        dst = [bytearray(CHUNK) for _ in range(4)]
        assert client.load_batch([(key(i), memoryview(d)) for i, d in enumerate(dst)]) == [True] * 4
        got = [np.frombuffer(bytes(d), dtype=np.uint16) for d in dst]
        if codec_name == "zstd":  # lossless: byte for byte
            assert [bytes(d) for d in dst] == chunks
        else:  # int8 rows: within one quantization step of each value
            import torch

            for g, c in zip(got, chunks):
                a = torch.frombuffer(bytearray(g.tobytes()), dtype=torch.bfloat16).float()
                b = torch.frombuffer(bytearray(c), dtype=torch.bfloat16).float()
                step = b.view(-1, 64).abs().amax(1, keepdim=True) / 127
                assert bool(((a - b).view(-1, 64).abs() <= step + 0.02 * b.abs().amax()).all())
        st = client.get_stats()
        assert st.loads == 4 and 0 < st.bytes_read < 4 * CHUNK / 1.3  # fewer bytes moved
        # A raw reader (another codec) is refused at the handshake, naming the field.
        assert raw_reader.exists_batch([key(0)]) == [False]
        assert "codec" in (raw_reader._peers[0].error or "") or "fingerprint" in (
            raw_reader._peers[0].error or ""
        )
    finally:
        raw_reader.shutdown()
        client.shutdown()
        server.shutdown()


def test_a_corrupted_encoded_chunk_is_a_miss(backend):
    from pagedkv.offload.codec import make_codec

    codec = make_codec("zstd", "bfloat16", 64, quantized=False)
    port = free_port()
    server, client = make_tier(backend, listen=port, codec=codec), None
    try:
        client = make_tier(backend, peers=[("127.0.0.1", port)], codec=codec)
        server.store_batch([(key(1), memoryview(kv_like_chunk(1)))])
        (e,) = server.store.lookup([key(1)])
        server.store.buffer[e.units[0], 20] ^= 0xFF  # a bit flip after encoding
        dst = bytearray(CHUNK)
        assert client.load_batch([(key(1), memoryview(dst))]) == [False]
        assert client.get_stats().corrupted == 1 and key(1) not in client.store
    finally:
        if client is not None:
            client.shutdown()
        server.shutdown()
