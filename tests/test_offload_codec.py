"""Tier codecs (offload/codec.py): round trips for every KV dtype and for quantized pages,
the disk and Redis tiers storing encoded chunks (fewer bytes, checksummed as encoded, corrupt
or torn records detected and dropped, another codec's records never read), the option
string, and the engine restarting warm from a compressed disk tier with exact outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from redis_server import REDIS_SERVER, SKIP_REASON, RedisServer

from pagedkv import LLM, SamplingParams
from pagedkv.offload.base import make_offload_key
from pagedkv.offload.codec import CODECS, CodecError, make_codec
from pagedkv.offload.fingerprint import OffloadFingerprint
from pagedkv.offload.fs_tier import FileSystemTier
from pagedkv.offload.spec import parse_offload_spec

HEAD = 64
ROWS = 2 * 16 * 3 * 4  # K and V rows: 16 tokens, 3 heads, 4 layers


def kv_page(dtype: torch.dtype, seed: int = 0) -> bytearray:
    """A chunk of KV-like rows: per-channel magnitudes and an outlier channel, in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, HEAD, generator=g) * (torch.rand(HEAD, generator=g) * 3 + 0.2)
    x[:, 5] *= 12
    return bytearray(x.to(dtype).view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_every_dtype(name, dtype):
    dname = str(dtype).removeprefix("torch.")
    codec = make_codec(name, dname, HEAD, quantized=False)
    page = kv_page(dtype)
    enc = codec.encode(memoryview(page))
    out = bytearray(len(page))
    codec.decode(enc, memoryview(out))
    x = torch.frombuffer(page, dtype=dtype).float().view(ROWS, HEAD)
    y = torch.frombuffer(out, dtype=dtype).float().view(ROWS, HEAD)
    if name == "int8":
        # Within half a code of each row's absmax / 127 (plus the fp16 scale's and the
        # dtype's rounding).
        step = x.abs().amax(dim=1, keepdim=True) / 127
        assert ((y - x).abs() <= step * 0.51 + x.abs() * 2**-7).all()
        assert memoryview(enc).nbytes < len(page) / (1.9 if dtype != torch.float32 else 3.8)
    else:
        assert out == page  # lossless: bit for bit
    if name == "zstd" or (name == "lz4" and dtype == torch.bfloat16):
        assert memoryview(enc).nbytes < len(page)  # the shuffled exponent bytes compress


@pytest.mark.parametrize("name", ["zstd", "lz4"])
def test_quantized_pages_round_trip_and_refuse_the_lossy_codec(name):
    page = bytearray(torch.randint(0, 256, (4096,), dtype=torch.uint8).numpy().tobytes())
    codec = make_codec(name, "uint8", HEAD, quantized=True)
    out = bytearray(len(page))
    codec.decode(codec.encode(memoryview(page)), memoryview(out))
    assert out == page
    with pytest.raises(ValueError, match="int8 codec quantizes float pages"):
        make_codec("int8", "uint8", HEAD, quantized=True)
    with pytest.raises(ValueError, match="unknown KV codec"):
        make_codec("gzip", "bfloat16", HEAD, quantized=False)


@pytest.mark.parametrize("name", ["zstd", "lz4", "int8"])
def test_foreign_or_damaged_frames_raise_codec_errors(name):
    codec = make_codec(name, "bfloat16", HEAD, quantized=False)
    page = kv_page(torch.bfloat16)
    enc = bytearray(codec.encode(memoryview(page)))
    with pytest.raises(CodecError):
        codec.decode(enc, memoryview(bytearray(len(page) - 2 * HEAD)))  # another chunk size
    with pytest.raises(CodecError):
        codec.decode(enc[: len(enc) // 2], memoryview(bytearray(len(page))))  # torn


def test_option_string_takes_a_codec_per_tier():
    cfg = parse_offload_spec("cpu:1GiB,disk:/tmp/a:b:2GiB:zstd,redis://h:1/0?ttl=5&codec=int8")
    assert (cfg.disk.path, cfg.disk.codec, cfg.redis.codec) == ("/tmp/a:b", "zstd", "int8")
    assert parse_offload_spec(cfg.to_spec()) == cfg
    assert parse_offload_spec("cpu:1GiB,disk:/tmp/a:2GiB").disk.codec == "raw"
    with pytest.raises(ValueError, match="unknown codec 'gzip'"):
        parse_offload_spec("cpu:1GiB,disk:/tmp/a:2GiB:gzip")
    with pytest.raises(ValueError, match="unknown codec"):
        parse_offload_spec("cpu:1GiB,redis://h:1/0?codec=brotli")


FP = OffloadFingerprint("test-model", "bfloat16", 16, "LBNHC", 4, 3, HEAD)


def _tier(root: Path, name: str) -> FileSystemTier:
    from dataclasses import replace

    codec = make_codec(name, "bfloat16", HEAD, quantized=False)
    chunk = len(kv_page(torch.bfloat16))
    return FileSystemTier(root, replace(FP, codec=name), 1 << 30, chunk, codec=codec)


def _key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"))


def test_disk_tier_stores_fewer_bytes_and_detects_damage(tmp_path):
    raw = _tier(tmp_path, "raw")
    z = _tier(tmp_path, "zstd")
    pages = [kv_page(torch.bfloat16, seed=i) for i in range(6)]
    items = [(_key(i), memoryview(p)) for i, p in enumerate(pages)]
    assert raw.store_batch(items) == [True] * 6 and z.store_batch(items) == [True] * 6
    assert z.get_stats().usage_bytes < raw.get_stats().usage_bytes
    assert z.dir != raw.dir  # another codec, another namespace: never read as raw
    for i, p in enumerate(pages):
        out = bytearray(len(p))
        assert z.load_batch([(_key(i), memoryview(out))]) == [True] and out == p
    # A flipped byte of the encoded payload: the checksum catches it, the file goes.
    victim = z.path_for(_key(2))
    data = bytearray(victim.read_bytes())
    data[4096 + 10] ^= 0x40
    victim.write_bytes(bytes(data))
    out = bytearray(len(pages[2]))
    assert z.load_batch([(_key(2), memoryview(out))]) == [False]
    assert not victim.exists() and z.get_stats().corrupted == 1
    # A torn file (cut inside the payload) is a miss too.
    torn = z.path_for(_key(3))
    torn.write_bytes(torn.read_bytes()[: 4096 + 512])
    assert z.load_batch([(_key(3), memoryview(out))]) == [False]
    # A restarted tier indexes the encoded files (their sizes vary) and reads them.
    z.shutdown()
    again = _tier(tmp_path, "zstd")
    assert len(again) == 4
    assert again.load_batch([(_key(5), memoryview(out))]) == [True] and out == pages[5]
    again.shutdown()
    raw.shutdown()


@pytest.mark.skipif(REDIS_SERVER is None, reason=SKIP_REASON)
def test_redis_tier_round_trips_encoded_values():
    from dataclasses import replace

    from pagedkv.offload.redis_tier import RedisTier

    server = RedisServer().start()
    try:
        codec = make_codec("lz4", "bfloat16", HEAD, quantized=False)
        page = kv_page(torch.bfloat16)
        tier = RedisTier("127.0.0.1", server.port, replace(FP, codec="lz4"), len(page), codec=codec)
        assert tier.store_batch([(_key(1), memoryview(page))]) == [True]
        value = tier.client.get(tier.redis_key(_key(1)))
        assert len(value) < len(page)  # stored encoded
        out = bytearray(len(page))
        assert tier.load_batch([(_key(1), memoryview(out))]) == [True] and out == page
        bad = bytearray(value)
        bad[-3] ^= 0xFF
        tier.client.set(tier.redis_key(_key(1)), bytes(bad))
        assert tier.load_batch([(_key(1), memoryview(out))]) == [False]
        assert tier.get_stats().corrupted == 1
        tier.shutdown()
    finally:
        server.close()


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["zstd", "int8"])
def test_engine_restarts_warm_from_a_compressed_disk_tier(tmp_path, codec):
    engine = dict(num_kv_blocks=25, max_model_len=256, max_num_seqs=2)  # float32: exact
    prompts = [
        {"prompt_token_ids": [(97 * i + 13 * j) % 40000 + 100 for j in range(140)]}
        for i in range(4)
    ]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    reference = run(LLM(**engine))
    spec = f"cpu:64MiB,disk:{tmp_path}:256MiB:{codec}"
    first = LLM(**engine, kv_offload=spec)
    assert run(first) == reference
    mgr = first.llm_engine.connector.manager
    if hasattr(mgr, "drain"):
        assert mgr.drain(20.0)
    first.llm_engine.shutdown()
    second = LLM(**engine, kv_offload=spec)
    got = run(second)
    disk = second.stats()["offload"]["disk"]
    assert disk["hits"] > 0 and disk["bytes_read"] > 0 and disk["corrupted"] == 0
    if codec == "zstd":
        assert got == reference  # lossless: the loaded prefixes are the computed ones
    else:  # lossy: reported by bench_offload; here each request still completes
        assert all(len(t) == 6 for t in got)
    second.llm_engine.shutdown()
