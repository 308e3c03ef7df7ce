"""OffloadingWorker / HostChunkBuffer: device ↔ host chunk copies are exact for every layout,
dtype and chunk size, jobs are reported once, bad specs are refused, and the CPU load path
runs near memcpy speed."""

from __future__ import annotations

import time

import pytest
import torch

from pagedkv.offload.base import CPULoadStoreSpec, GPULoadStoreSpec, LookupResult, make_offload_key
from pagedkv.offload.cpu_manager import CPUOffloadingManager
from pagedkv.offload.worker import HostChunkBuffer, OffloadingWorker, block_major_view
from pagedkv.ops.kv_cache import allocate_kv_cache

L, B, N, H, D = 3, 16, 4, 2, 8


def make_cache(layout: str, dtype: torch.dtype, device: str = "cpu", num_blocks: int = B):
    buf, views = allocate_kv_cache(layout, L, num_blocks, N, H, D, dtype, device=device)
    if dtype.is_floating_point:
        buf.copy_(torch.randn(buf.shape, device=device).to(dtype))
    else:
        buf.copy_(torch.randint(0, 255, buf.shape, device=device).to(dtype))
    return buf, views


def block(views, b: int) -> list[torch.Tensor]:
    """Every layer's K and V of block ``b`` (the logical content, layout-independent)."""
    return [t[b].clone() for kv in views for t in kv]


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC", "LBHNC", "NBLHC"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("bpc", [1, 2])
def test_store_then_load_roundtrip_is_exact(layout: str, dtype: torch.dtype, bpc: int):
    buf, views = make_cache(layout, dtype)
    host = HostChunkBuffer.for_kv_cache(buf, layout, capacity_bytes=10**6, blocks_per_chunk=bpc)
    worker = OffloadingWorker(buf, layout, host)
    src_blocks = [5, 6, 2, 9][: 2 * bpc] if bpc == 2 else [5, 2, 9]
    n_chunks = len(src_blocks) // bpc
    chunks = tuple(range(3, 3 + n_chunks))[::-1]  # slots in reverse: no accidental alignment
    before = [block(views, b) for b in src_blocks]
    worker.submit_store(1, GPULoadStoreSpec(tuple(src_blocks)), CPULoadStoreSpec(chunks))
    dst_blocks = [11, 12, 13, 1][: len(src_blocks)]
    worker.submit_load(2, CPULoadStoreSpec(chunks), GPULoadStoreSpec(tuple(dst_blocks)))
    done = worker.get_finished()
    size = len(src_blocks) * host.block_bytes
    assert [(r.job_id, r.success, r.size) for r in done] == [(1, True, size), (2, True, size)]
    assert worker.get_finished() == []
    for want, b in zip(before, dst_blocks):
        got = block(views, b)
        assert all(torch.equal(w, g) for w, g in zip(want, got))


def test_host_slot_holds_the_blocks_bytes_in_block_major_order():
    buf, _ = make_cache("BLNHC", torch.float32)
    host = HostChunkBuffer.for_kv_cache(buf, "BLNHC", capacity_bytes=10**6, blocks_per_chunk=2)
    worker = OffloadingWorker(buf, "BLNHC", host)
    worker.submit_store(7, GPULoadStoreSpec((4, 8)), CPULoadStoreSpec((1,)))
    slot = bytes(host.chunk_view(1))
    expected = buf[4].contiguous().numpy().tobytes() + buf[8].contiguous().numpy().tobytes()
    assert slot == expected and len(slot) == host.chunk_bytes == 2 * host.block_bytes


def test_host_buffer_sizing_and_validation():
    buf, _ = make_cache("LBNHC", torch.bfloat16)
    blocks = block_major_view(buf, "LBNHC")
    assert blocks.shape == (B, L, N, H, 2 * D)
    block_bytes = L * N * H * 2 * D * 2
    host = HostChunkBuffer.for_kv_cache(buf, "LBNHC", capacity_bytes=10 * block_bytes + 1)
    assert host.num_chunks == 10 and host.capacity_bytes == 10 * block_bytes
    with pytest.raises(ValueError):
        HostChunkBuffer.for_kv_cache(buf, "LBNHC", capacity_bytes=block_bytes - 1)
    other = HostChunkBuffer(4, 1, (L, N, H, 2 * D), torch.float32)
    with pytest.raises(ValueError, match="do not match"):
        OffloadingWorker(buf, "LBNHC", other)
    with pytest.raises(ValueError):
        block_major_view(buf, "LBNH")


def test_bad_specs_are_refused():
    buf, _ = make_cache("LBNHC", torch.float32)
    host = HostChunkBuffer.for_kv_cache(buf, "LBNHC", capacity_bytes=10**5, blocks_per_chunk=2)
    worker = OffloadingWorker(buf, "LBNHC", host)
    with pytest.raises(ValueError, match="device blocks"):
        worker.submit_store(1, GPULoadStoreSpec((1, 2, 3)), CPULoadStoreSpec((0,)))
    with pytest.raises(ValueError, match="device block id"):
        worker.submit_store(1, GPULoadStoreSpec((1, B)), CPULoadStoreSpec((0,)))
    with pytest.raises(ValueError, match="chunk id"):
        worker.submit_load(1, CPULoadStoreSpec((host.num_chunks,)), GPULoadStoreSpec((1, 2)))
    assert worker.get_finished() == []
    worker.wait([1])  # nothing in flight: returns


def test_manager_and_worker_together():
    """The protocol the engine follows: prepare_store → copy → complete_store; lookup →
    prepare_load → copy → complete_load."""
    buf, views = make_cache("LBNHC", torch.float32)
    host = HostChunkBuffer.for_kv_cache(buf, "LBNHC", capacity_bytes=4 * L * N * H * 2 * D * 4)
    mgr = CPUOffloadingManager(host.num_chunks, chunk_bytes=host.chunk_bytes)
    worker = OffloadingWorker(buf, "LBNHC", host)
    keys = [make_offload_key(bytes([i]) * 32) for i in range(3)]
    device_blocks = (3, 7, 1)
    want = [block(views, b) for b in device_blocks]
    out = mgr.prepare_store(keys)
    worker.submit_store(10, GPULoadStoreSpec(device_blocks), out.store_spec)
    for result in worker.get_finished():
        mgr.complete_store(out.keys_to_store, result.success)
    buf.zero_()
    assert [mgr.lookup(k) for k in keys] == [LookupResult.HIT] * 3
    spec = mgr.prepare_load(keys)
    worker.submit_load(11, spec, GPULoadStoreSpec((2, 4, 6)))
    [result] = worker.get_finished()
    assert (result.job_id, result.success, result.size) == (11, True, 3 * host.block_bytes)
    assert result.time >= 0
    mgr.complete_load(keys)
    for w, b in zip(want, (2, 4, 6)):
        assert all(torch.equal(x, y) for x, y in zip(w, block(views, b)))
    mgr.check_invariants()


@pytest.mark.slow
def test_cpu_load_bandwidth_is_near_memcpy():
    """Loading 64 scattered chunks of SmolLM2-sized blocks (30 layers, 3 heads, 16 tokens) vs
    one memcpy of the same bytes; best of several runs on both sides."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the worker copies on one thread: compare like with like
    try:
        _measure_load_bandwidth()
    finally:
        torch.set_num_threads(threads)


def _measure_load_bandwidth() -> None:
    buf, _ = allocate_kv_cache("LBNHC", 30, 256, 16, 3, 64, torch.bfloat16)
    host = HostChunkBuffer.for_kv_cache(buf, "LBNHC", capacity_bytes=128 * 30 * 16 * 3 * 128 * 2)
    worker = OffloadingWorker(buf, "LBNHC", host)
    gen = torch.Generator().manual_seed(0)
    chunks = tuple(torch.randperm(host.num_chunks, generator=gen)[:64].tolist())
    blocks = tuple(torch.randperm(256, generator=gen)[:64].tolist())
    nbytes = 64 * host.block_bytes
    a = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    b = torch.empty_like(a)

    def best(fn, reps: int = 7) -> float:
        fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    t_memcpy = best(lambda: b.copy_(a))
    t_load = best(lambda: worker.submit_load(0, CPULoadStoreSpec(chunks), GPULoadStoreSpec(blocks)))
    ratio = t_memcpy / t_load
    print(
        f"load {nbytes / t_load / 1e9:.1f} GB/s, memcpy {nbytes / t_memcpy / 1e9:.1f} GB/s, ratio {ratio:.2f}"
    )
    assert ratio >= 0.3  # ≥ 0.5 on a quiet machine; loose here because CI shares 2 cores


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_roundtrip_with_streams_and_events():
    buf, views = make_cache("LBNHC", torch.bfloat16, device="cuda")
    host = HostChunkBuffer.for_kv_cache(buf, "LBNHC", capacity_bytes=10**6)
    assert host.tensor.is_pinned()
    worker = OffloadingWorker(buf, "LBNHC", host)
    want = [block(views, b) for b in (1, 2, 3)]
    worker.submit_store(1, GPULoadStoreSpec((1, 2, 3)), CPULoadStoreSpec((5, 0, 2)))
    worker.submit_load(2, CPULoadStoreSpec((5, 0, 2)), GPULoadStoreSpec((10, 11, 12)))
    worker.wait([1, 2])
    done = []
    deadline = time.monotonic() + 10
    while len(done) < 2 and time.monotonic() < deadline:
        done += worker.get_finished()
    assert [r.job_id for r in done] == [1, 2] and all(r.success for r in done)
    torch.cuda.synchronize()
    for w, b in zip(want, (10, 11, 12)):
        assert all(torch.equal(x, y) for x, y in zip(w, block(views, b)))
