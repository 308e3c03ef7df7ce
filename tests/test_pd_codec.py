"""Compressed prefill/decode transfers (`kv_transfer.staging`, the NixlConnector's
``transfer_codec``): the staging area, frames round-tripped over real memory regions, and two
real engines that hand KV over in encoded frames (NIXL where it imports, and the TCP backend).

Lossless codecs must give the consumer the producer's exact KV (greedy tokens equal a colocated
run, token by token) while fewer bytes cross the wire; the lossy int8 codec must give it
exactly the codec's round trip of the producer's blocks. Faults: a corrupted frame (CRC) is
recomputed, a staging area too small serves the blocks raw, a codec mismatch is refused in the
handshake, push with a codec is refused at construction.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from test_pd_engine import PROMPTS, all_free, backends, decode, greedy, make_llm, prefill, settle

from pagedkv import LLM
from pagedkv.kv_transfer import nixl_connector, staging
from pagedkv.kv_transfer.staging import (
    SLOT_BYTES,
    StagingArea,
    decode_blocks,
    encode_blocks,
    slots_of,
)
from pagedkv.offload.codec import CodecError, make_codec
from pagedkv.transfer.base import MemoryRegion
from pagedkv.transfer.tcp import gather

HEAD = 64


# ---- units ---------------------------------------------------------------------------------------


def test_staging_area_allocates_first_fit_and_merges_what_is_freed():
    area = StagingArea(10 * SLOT_BYTES)
    assert area.region.base_addr % 4096 == 0 and area.region.num_blocks == 10
    a, b, c = area.alloc(3), area.alloc(3), area.alloc(3)
    assert (a, b, c) == (0, 3, 6)
    assert area.alloc(2) is None  # one slot left
    area.free(a, 3)
    area.free(c, 3)
    assert area.alloc(5) is None  # 0..2 and 6..9 free: never 5 in a row
    assert area.alloc(4) == 6  # the freed extent merged with the last slot
    area.free(6, 4)
    area.free(b, 3)
    assert area.free_slots == 10 and area.alloc(10) == 0
    area.free(0, 10)
    with pytest.raises(AssertionError, match="freed twice"):
        area.free(2, 2)


class Blocks:
    """Two regions (two "layers") of ``num_blocks`` blocks of ``rows`` K/V rows of ``dtype``."""

    def __init__(self, dtype: torch.dtype, seed: int = 0, num_blocks: int = 6, rows: int = 32):
        g = torch.Generator().manual_seed(seed)
        self.t = [
            (torch.randn(num_blocks, rows, HEAD, generator=g) * 3).to(dtype) for _ in range(2)
        ]
        self.regions = [
            MemoryRegion(t.data_ptr(), num_blocks, n, n)
            for t in self.t
            for n in [rows * HEAD * t.element_size()]
        ]

    def bytes_of(self, b: int) -> bytes:
        return b"".join(bytes(gather(r, [b])) for r in self.regions)


@pytest.mark.parametrize("name", ["zstd", "lz4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frames_round_trip_into_other_blocks(name, dtype):
    dname = str(dtype).removeprefix("torch.")
    codec = make_codec(name, dname, HEAD, quantized=False)
    src, dst = Blocks(dtype), Blocks(dtype, seed=1)
    area = StagingArea(256 * SLOT_BYTES)
    frames = encode_blocks(area, codec, src.regions, [1, 4])
    assert frames is not None and len(frames) == 2
    # As the consumer lays them out: back to back in its own staging area.
    local = StagingArea(256 * SLOT_BYTES)
    first = local.alloc(sum(f.num_slots for f in frames))
    for i, s in enumerate(slots_of(frames)):
        local.view(first + i, SLOT_BYTES)[:] = area.view(s, SLOT_BYTES)
    decode_blocks(local, codec, dst.regions, first, frames, [5, 0])
    for s, d in ((1, 5), (4, 0)):
        want = src.bytes_of(s)
        if codec.lossy:
            out = bytearray(len(want))
            codec.decode(codec.encode(memoryview(bytearray(want))), memoryview(out))
            want = bytes(out)
        assert dst.bytes_of(d) == want
    assert dst.bytes_of(1) == Blocks(dtype, seed=1).bytes_of(1)  # the others stay untouched
    wire = sum(f.nbytes for f in frames)
    assert wire < 2 * len(src.bytes_of(0))  # fewer bytes than the raw blocks


def test_a_corrupted_frame_fails_its_crc_and_a_full_area_keeps_nothing():
    codec = make_codec("zstd", "float32", HEAD, quantized=False)
    src, dst = Blocks(torch.float32), Blocks(torch.float32)
    area = StagingArea(256 * SLOT_BYTES)
    frames = encode_blocks(area, codec, src.regions, [0, 1])
    v = area.view(frames[1].slot, 8)
    v[4] ^= 0xFF
    with pytest.raises(CodecError, match="CRC"):
        decode_blocks(area, codec, dst.regions, frames[0].slot, frames, [2, 3])
    small = StagingArea(3 * SLOT_BYTES)  # one frame of 16 KiB of random floats cannot fit
    assert encode_blocks(small, codec, src.regions, [0, 1]) is None
    assert small.free_slots == 3


def test_layout_replies_round_trip_and_garbage_is_a_codec_error():
    frames = [staging.Frame(3, 2, 5000, 123), staging.Frame(5, 1, 10, 7)]
    assert staging.parse_layout(staging.layout_reply("ready", frames)) == ("ready", frames)
    assert staging.parse_layout(staging.layout_reply("pending")) == ("pending", [])
    with pytest.raises(CodecError):
        staging.parse_layout(b"\x01\x02")


# ---- two engines ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    llm = LLM(num_kv_blocks=96, max_model_len=512)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    llm.llm_engine.shutdown()
    return {p: list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, outs)}


def raw_bytes(llm: LLM, num_blocks: int) -> int:
    return num_blocks * llm.llm_engine.connector._bytes_per_block


@pytest.mark.slow
@pytest.mark.parametrize("backend", backends())
def test_lossless_transfer_is_exact_with_fewer_bytes_and_a_corrupt_frame_is_recomputed(
    backend, reference
):
    p = make_llm("kv_producer", backend, transfer_codec="zstd")
    d = make_llm("kv_consumer", backend, transfer_codec="zstd")
    try:
        params = prefill(p, PROMPTS)
        assert decode(d, PROMPTS, params) == [reference[x] for x in PROMPTS]
        st = d.llm_engine.connector.xfer_stats
        assert st.num_transfers == len(PROMPTS) and st.num_failed == 0
        assert st.num_bytes < raw_bytes(d, st.num_blocks) / 1.05  # zstd on fp32 KV
        settle(p, d)
        for x in (p, d):
            conn = x.llm_engine.connector
            assert conn.staging.free_slots == conn.staging.num_slots  # every frame freed
        assert p.llm_engine.connector.num_expired_leases == 0

        # A frame damaged in the producer's staging memory: the CRC catches it, D recomputes.
        conn = p.llm_engine.connector
        params = prefill(p, PROMPTS[1:2])
        rid = params[0]["remote_request_id"]
        settle_encoded(p, rid)
        frame = conn._staged[rid][0]
        conn.staging.view(frame.slot, 16)[8] ^= 0xFF
        assert decode(d, PROMPTS[1:2], params) == [reference[PROMPTS[1]]]
        assert d.llm_engine.connector.xfer_stats.num_failed == 1
        settle(p, d)
    finally:
        p.llm_engine.shutdown()
        d.llm_engine.shutdown()


def settle_encoded(p: LLM, rid: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while p.llm_engine.connector._staged.get(rid) == "pending":
        assert time.monotonic() < deadline
        time.sleep(0.005)


@pytest.mark.slow
def test_int8_gives_the_consumer_the_codecs_round_trip_of_the_producers_blocks(monkeypatch):
    p = make_llm("kv_producer", "tcp", transfer_codec="int8")
    d = make_llm("kv_consumer", "tcp", transfer_codec="int8")
    landed: list[int] = []

    def spy(area, codec, regions, first_slot, frames, block_ids):
        landed.extend(block_ids)
        return decode_blocks(area, codec, regions, first_slot, frames, block_ids)

    monkeypatch.setattr(nixl_connector, "decode_blocks", spy)
    try:
        prompt = PROMPTS[2] * 4  # several full blocks
        params = prefill(p, [prompt])
        src_ids = params[0]["remote_block_ids"]
        pc, dc = p.llm_engine.connector, d.llm_engine.connector
        src = [b"".join(bytes(gather(r, [b])) for r in pc._regions) for b in src_ids]
        toks = decode(d, [prompt], params)[0]
        assert len(toks) > 0 and dc.xfer_stats.num_failed == 0
        assert len(landed) == len(src_ids) > 2
        # The last block is D's own from its last prompt token on (recomputed, then decoded).
        for s, b in zip(src[:-1], landed[:-1]):
            out = bytearray(len(s))
            pc.codec.decode(pc.codec.encode(memoryview(bytearray(s))), memoryview(out))
            got = b"".join(bytes(gather(r, [b])) for r in dc._regions)
            assert got == bytes(out)
            assert got != s  # lossy: it did change the bytes
        # fp32 pages as int8 rows with an fp16 scale: ~3.8x fewer bytes on the wire.
        assert dc.xfer_stats.num_bytes < raw_bytes(d, len(src_ids)) / 3.5
        settle(p, d)
    finally:
        p.llm_engine.shutdown()
        d.llm_engine.shutdown()


@pytest.mark.slow
def test_staging_fallbacks_to_raw_reads_and_a_codec_mismatch_is_refused(
    reference, caplog, monkeypatch
):
    tiny = {"transfer_codec": "lz4", "transfer_staging_mib": 0.01}  # 2 slots: no frame fits
    p_tiny = make_llm("kv_producer", "tcp", **tiny)
    p = make_llm("kv_producer", "tcp", transfer_codec="lz4")
    d_tiny = make_llm("kv_consumer", "tcp", **tiny)
    d_raw = make_llm("kv_consumer", "tcp")
    try:
        # The producer cannot stage the frames: it serves the blocks raw.
        params = prefill(p_tiny, PROMPTS[:2])
        assert decode(d_tiny, PROMPTS[:2], params) == [reference[x] for x in PROMPTS[:2]]
        st = d_tiny.llm_engine.connector.xfer_stats
        assert st.num_failed == 0 and st.num_bytes == raw_bytes(d_tiny, st.num_blocks)
        # The consumer cannot hold the frames: it reads the raw blocks instead.
        before = st.num_bytes
        params = prefill(p, PROMPTS[1:2])
        assert decode(d_tiny, PROMPTS[1:2], params) == [reference[PROMPTS[1]]]
        n = st.num_blocks
        assert st.num_failed == 0 and st.num_bytes == raw_bytes(d_tiny, n)
        assert st.num_bytes > before
        settle(p_tiny, p, d_tiny)
        assert p.llm_engine.connector.staging.free_slots == p.llm_engine.connector.staging.num_slots

        # An encoder that fails (fault injected): the producer serves the blocks raw.
        def broken(*args):
            raise RuntimeError("injected")

        monkeypatch.setattr(nixl_connector, "encode_blocks", broken)
        before = st.num_bytes
        params = prefill(p, PROMPTS[2:3])
        assert decode(d_tiny, PROMPTS[2:3], params) == [reference[PROMPTS[2]]]
        assert st.num_failed == 0 and st.num_bytes - before == raw_bytes(d_tiny, st.num_blocks - n)
        assert "encoding its KV failed" in caplog.text
        monkeypatch.undo()

        # A consumer without the codec refuses the producer by name and recomputes.
        params = prefill(p, PROMPTS[:1])
        assert decode(d_raw, PROMPTS[:1], params) == [reference[PROMPTS[0]]]
        assert d_raw.llm_engine.connector.xfer_stats.num_failed == 1
        assert "transfer_codec differs" in caplog.text
        assert all_free(d_raw)
    finally:
        for x in (p_tiny, p, d_tiny, d_raw):
            x.llm_engine.shutdown()


def test_push_with_a_codec_and_an_unknown_codec_are_refused():
    with pytest.raises(ValueError, match="transfer_mode 'pull'"):
        make_llm("kv_producer", "tcp", transfer_codec="zstd", transfer_mode="push")
    with pytest.raises(ValueError, match="unknown KV codec"):
        make_llm("kv_producer", "tcp", transfer_codec="gzip")


def test_numpy_is_the_staging_buffer():  # the region addresses the area's own memory
    area = StagingArea(2 * SLOT_BYTES)
    area.view(1, 4)[:] = b"abcd"
    got = np.ctypeslib.as_array(
        (np.ctypeslib.ctypes.c_uint8 * 4).from_address(area.region.block_addr(1))
    )
    assert bytes(got) == b"abcd"
