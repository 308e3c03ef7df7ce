"""KIVI caches (``int3_kivi`` / ``int2_kivi``, `ops.kivi`): the block codec, the page format,
the engine against an emulation built from the same codec, chunking, decode, the prefix cache,
preemption, the residual's memory, and what the engine refuses."""

from __future__ import annotations

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.bench import kv_formats as kf
from pagedkv.core.planning import kivi_residual_bytes, kivi_sink_store_bytes
from pagedkv.core.specs import FullAttentionSpec, KVQuantMode
from pagedkv.ops.kivi import KiviResidual, dequantize_k_blocks, hot_mask, quantize_k_blocks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def spec(mode: str = "int3_kivi", bs: int = 16, **kw) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=bs, num_kv_heads=3, head_size=64, dtype=mode[:4], kv_quant_mode=mode, **kw
    )


# ---------------------------------------------------------------- format


@pytest.mark.parametrize(
    ("mode", "bs", "k", "v"),
    [("int3_kivi", 16, 24 + 8, 24 + 2), ("int3_kivi", 32, 24 + 4, 24 + 2),
     ("int2_kivi", 16, 16 + 8, 16 + 4)],
)  # fmt: skip
def test_page_bytes(mode: str, bs: int, k: int, v: int) -> None:
    s = spec(mode, bs)
    assert (s.k_part_bytes, s.v_part_bytes) == (k, v)
    # sink + residual tokens (32 of room), K and V as int8 + fp16 scale, 3 heads
    assert s.kivi_residual_bytes == (4 + 32) * 3 * (64 + 2 + 64 + 2)


def test_spec_refuses_what_the_layout_cannot_hold() -> None:
    with pytest.raises(ValueError, match="must divide"):
        spec(bs=48)
    with pytest.raises(ValueError, match="rotation"):
        spec(kv_rotation="hadamard")
    assert KVQuantMode.parse("int3_kivi").is_kivi and not KVQuantMode.INT3_PER_TOKEN_GROUP.is_kivi


@pytest.mark.parametrize("bits", [3, 2])
def test_block_codec_is_per_channel(bits: int) -> None:
    g = torch.Generator().manual_seed(0)
    k = torch.randn(5, 16, 3, 64, generator=g)
    k[..., 7] = k[..., 7] * 10 + 30  # an outlier channel with an offset
    k[1, :, 2, 9] = 1.5  # a constant channel of one block and head
    part = spec("int3_kivi" if bits == 3 else "int2_kivi").k_part_bytes
    raw = quantize_k_blocks(k, bits, part)
    assert raw.shape == (5, 16, 3, part)
    back = dequantize_k_blocks(raw, 64, bits)
    span = k.amax(1, keepdim=True).clamp(min=0) - k.amin(1, keepdim=True).clamp(max=0)
    step = span / ((1 << bits) - 1)
    assert bool(((back - k).abs() <= step * 0.51 + 1e-4).all())  # half a step (scale rounded up)
    # a channel constant over its block: its own narrow range, not the outlier channel's
    assert torch.allclose(back[1, :, 2, 9], k[1, :, 2, 9], atol=0.01)
    # Token i of a block carries the fp16 scales of channels [4i, 4i + 4) (64 / 16 = 4).
    nv = 64 * bits // 8
    s9 = raw[1, 9 // 4, 2, nv + 2 * (9 % 4) : nv + 2 * (9 % 4) + 2].contiguous().view(torch.float16)
    low = (1 << bits) - 1
    assert float((s9.view(torch.int16) & ~low).view(torch.float16)) >= 1.5 / low


def test_hot_mask_counts_whole_blocks_and_sinks() -> None:
    have = torch.ones(80, dtype=torch.bool)
    m = hot_mask(torch.tensor([40]), torch.arange(80), have, 4, 16, 2)[0]
    assert m[16:41].all() and not m[4:16].any() and m[:4].all()
    have[:20] = False  # held only from position 20 (a prefix-cache hit)
    m = hot_mask(torch.tensor([40]), torch.arange(80), have, 4, 16, 2)[0]
    assert not m[:20].any() and m[20:41].all()


def test_residual_ring_keeps_sinks_and_whole_blocks() -> None:
    r = KiviResidual.allocate(spec(), 2, "cpu")
    assert r.k.shape == (2, 36, 3, 66)
    idx = r.index(torch.tensor([0, 3, 4, 35, 36, 67]))
    assert idx.tolist() == [0, 3, 4 + 4, 4 + 3, 4 + 4, 4 + 3]


# ---------------------------------------------------------------- engine


def engine(kv: str = "int3_kivi", **kw) -> LLM:
    from pagedkv.models.config import default_model_path

    args = dict(
        model=str(default_model_path()), dtype="float32", kv_cache_dtype=kv, num_kv_blocks=160,
        max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=512,
        enable_prefix_caching=False,
    )  # fmt: skip
    return LLM(**{**args, **kw})


@pytest.fixture(scope="module")
def window() -> list[int]:
    from pagedkv.bench.kv_quant import make_corpus

    return make_corpus(engine("float32"), 420, 0.0, 0)[:400]


def _engine_codec(bits: int, bs: int):
    """The emulation's ``stored`` with the engine's own codec (ops.kivi, ops.kv_quant)."""
    from pagedkv.ops.kv_quant import KVQuant

    s = spec(f"int{bits}_kivi", bs)
    q = KVQuant.for_spec(s)
    res = KiviResidual.allocate(s, 1, "cpu")

    def stored(fmt, key, value):
        b, h, t, d = key.shape
        pad = -t % bs
        kb = torch.nn.functional.pad(key[0].transpose(0, 1), (0, 0, 0, 0, 0, pad))
        k = dequantize_k_blocks(
            quantize_k_blocks(res.decode(*res.encode(kb, kb))[0].reshape(-1, bs, h, d), bits,
                              s.k_part_bytes), d, bits,
        ).reshape(-1, h, d)[:t]  # fmt: skip
        from pagedkv.ops.kv_quant import dequantize_part, quantize_part

        vt = value[0].transpose(0, 1)
        v = dequantize_part(quantize_part(vt, q.fmt, 1.0, s.v_part_bytes), q.fmt, d, 1.0)
        return k.transpose(0, 1)[None], v.transpose(0, 1)[None]

    def int8(x):
        rows = x[0].transpose(0, 1)
        return res.decode(*res.encode(rows, rows))[0].transpose(0, 1)[None]

    return stored, int8


@pytest.mark.slow
def test_engine_reads_what_the_emulation_reads(window, monkeypatch) -> None:
    """One prefill of 400 tokens through a KIVI cache equals the emulation that reads each key
    from the residual or from codes made by the same codec: the residual ring, the block coding
    and the hot mask do what the study measured."""
    from pagedkv.bench.kv_quant import score_window

    eng = score_window(engine(), window)
    ref = score_window(engine("float32"), window)
    stored, int8 = _engine_codec(3, 16)
    monkeypatch.setattr(kf, "stored", stored)
    monkeypatch.setattr(kf, "int8", int8)
    fmt = kf.Format("e", 3, "channel", v_group=64, sink=4, residual_blocks=2, residual="int8")
    emu = kf._logprobs(kf._hf_model(), window, fmt)
    assert (eng.argmax(-1) == emu.argmax(-1)).float().mean() >= 0.995
    assert (eng - emu).exp().sub(1).abs().mul(emu.exp()).sum(-1).max() < 0.02  # prob. mass moved
    assert (eng.argmax(-1) == ref.argmax(-1)).float().mean() < 1.0  # and it is lossy


def _greedy(llm: LLM, prompts: list[list[int]], n: int = 40) -> list[list[int]]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outs]


# ---- the ops, on fixed K/V (a model's own float noise would flip codes between runs) ---------


def _run(chunks: list[int], start: int = 0, pages: tuple | None = None, seed: int = 0,
         zero_sinks: bool = False, restore_sinks: bool = False):  # fmt: skip
    """Write and attend one sequence of ``sum(chunks)`` tokens chunk by chunk (a chunk of 1 is
    a decode step) through `paged_attention`; positions before ``start`` are taken as cached
    (their pages from ``pages``, the residual empty, or holding the int8 sinks a cold run
    stored with ``restore_sinks``: the engine's `KiviSinkStore`). Returns (outputs of the new
    positions, the caches)."""
    from pagedkv.ops.attention import paged_attention
    from pagedkv.ops.cache import reshape_and_cache
    from pagedkv.ops.kivi import KiviStep
    from pagedkv.ops.kv_quant import KVQuant
    from pagedkv.ops.metadata import AttentionMetadata

    s = spec()
    n = start + sum(chunks)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(160, h, 64, generator=g)[:n] for h in (9, 3, 3))
    k[:, :, 5] += 6.0
    if zero_sinks:  # zeros are exact in codes and int8 alike
        k[:4], v[:4] = 0.0, 0.0
    kq = KVQuant.for_spec(s)
    kq.residual = KiviResidual.allocate(s, 2, "cpu")
    if restore_sinks:
        kq.residual.k[1, :4], kq.residual.v[1, :4] = kq.residual.encode(k[:4], v[:4])
    kc = torch.zeros(12, 16, 3, s.k_part_bytes, dtype=torch.uint8)
    vc = torch.zeros(12, 16, 3, s.v_part_bytes, dtype=torch.uint8)
    if pages is not None:
        kc[:], vc[:] = pages
    table = torch.arange(2, 12, dtype=torch.int32)[None]  # blocks 2.. (0 is the null block)
    outs, pos = [], start
    for c in chunks:
        end = pos + c
        slots = table[0, torch.arange(pos, end) // 16].long() * 16 + torch.arange(pos, end) % 16
        md = AttentionMetadata(
            slot_mapping=slots, query_start_loc=torch.tensor([0, c], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32), block_table=table, block_size=16,
            max_query_len=c, max_seq_len=end, query_start_loc_cpu=[0, c], seq_lens_cpu=[end],
            kivi=KiviStep([1], [start], [restore_sinks]),
        )  # fmt: skip
        reshape_and_cache(k[pos:end], v[pos:end], kc, vc, slots, kq)
        outs.append(paged_attention(q[pos:end], kc, vc, md, 0.125, kv_quant=kq))
        pos = end
    return torch.cat(outs), (kc, vc)


@pytest.fixture
def float_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps through the native kernel's float dot products (its integer ones, where
    the CPU has them, agree to ~1e-4 relative: tests/test_kivi_native.py), so the steps can be
    held to the prefill's torch path at 1e-5."""
    from pagedkv.ops import native

    real = native.kivi_decode
    monkeypatch.setattr(native, "kivi_decode", lambda *a, **k: real(*a, **k, int_dot=False))


def test_chunks_and_decode_steps_read_what_one_prefill_reads(float_kernels) -> None:
    """What a query reads depends on positions only: 150 tokens in one chunk, in chunks of 7
    and 33, or a prefill followed by 60 decode steps (the ring wraps twice) attend alike."""
    whole, (kc, vc) = _run([150])
    for chunks in ([7] * 21 + [3], [33, 33, 33, 33, 18], [90] + [1] * 60):
        out, (kc2, vc2) = _run(chunks)
        assert torch.allclose(out, whole, atol=1e-5), chunks
        assert torch.equal(kc2[2:11], kc[2:11]) and torch.equal(vc2, vc)  # same codes
    assert not torch.allclose(whole, _run([150], seed=1)[0], atol=1e-2)


def test_a_cached_prefix_is_read_from_its_codes(float_kernels) -> None:
    """A request whose first 64 positions are cached (a prefix hit) reads them from their
    codes, sinks and recent blocks included, and its own positions from its residual."""
    whole, pages = _run([150], zero_sinks=True)
    hit, _ = _run([86], start=64, pages=pages, zero_sinks=True)
    # From block 6 on, both read positions < 64 as codes (the sinks are zeros either way).
    assert torch.allclose(hit[96 - 64 :], whole[96:], atol=1e-5)
    # Blocks 4 and 5 read block 3 from the residual in the first request, from codes here.
    assert not torch.allclose(hit[: 96 - 64], whole[64:96], atol=1e-3)
    hit_one = _run([1] * 10, start=64, pages=pages, zero_sinks=True)[0]  # through decode steps
    assert torch.allclose(hit_one, hit[:10], atol=1e-5)


def test_a_hit_with_restored_sinks_reads_them_as_the_cold_run(float_kernels) -> None:
    """The sink store's case: a hit whose row holds the int8 sinks a cold run computed reads
    them as that run did (from block 6 on, where both read the rest from codes, the outputs
    agree); without them it reads the sinks from codes, and the outputs differ everywhere."""
    whole, pages = _run([150])
    hit, _ = _run([86], start=64, pages=pages, restore_sinks=True)
    assert torch.allclose(hit[96 - 64 :], whole[96:], atol=1e-5)
    bare, _ = _run([86], start=64, pages=pages)
    assert not torch.allclose(bare[96 - 64 :], whole[96:], atol=1e-3)
    steps = _run([1] * 40, start=64, pages=pages, restore_sinks=True)[0]  # the decode kernel
    assert torch.allclose(steps, hit[:40], atol=1e-5)


@pytest.mark.slow
def test_preempted_requests_start_a_new_residual(window) -> None:
    """A pool too small for both requests preempts one; it is recomputed with a fresh
    residual row, and every row is free once both finish."""
    prompts = [window[:40], window[150:190]]  # 3 blocks each, 9 once 100 tokens are out
    llm = engine(num_kv_blocks=13, max_model_len=160)
    out = _greedy(llm, prompts, 100)
    assert [len(o) for o in out] == [100, 100]
    assert llm.llm_engine.scheduler.num_preemptions >= 1
    _greedy(llm, [window[:5]], 1)  # finished requests give their rows back at the next step
    rows = llm.llm_engine.runner.kivi_rows
    assert rows is not None and set(rows.by_request) <= {"2"} and len(rows.free) >= 3


@pytest.mark.slow
def test_prefix_cache_hits_read_their_codes(window) -> None:
    """A hit serves from the codes and writes no byte of a cached block."""
    llm = engine(enable_prefix_caching=True)
    caches, pool = llm.llm_engine.runner.kv_caches, llm.llm_engine.kv_cache_manager.block_pool
    for prompt in (window[:160], window[:200]):
        _greedy(llm, [prompt], 8)
        shared = sorted({b.block_id for _, b in pool.cached_block_hash_to_block.items()})
        before = [(k[shared].clone(), v[shared].clone()) for k, v in (caches[0], caches[29])]
        again = llm.generate(
            [{"prompt_token_ids": prompt}],
            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
            use_tqdm=False,
        )[0]  # fmt: skip
        assert again.num_cached_tokens >= 144
        assert len(again.outputs[0].token_ids) == 8
        for (k0, v0), (k1, v1) in zip(before, (caches[0], caches[29])):
            assert torch.equal(k0, k1[shared]) and torch.equal(v0, v1[shared])


@pytest.mark.slow
def test_a_hit_restores_the_sinks_its_first_block_computed(window, monkeypatch) -> None:
    """The runner keeps the int8 sinks of a request's first block (`KiviSinkStore`) and
    restores them into the row of a later hit on that block, which then generates what the
    cold run generates on this prompt (before the store it read its sinks from codes and
    generated other tokens)."""
    from pagedkv.ops.kivi import KiviSinkStore

    prompt = window[:160]
    cold = _greedy(engine(), [prompt], 8)[0]
    llm = engine(enable_prefix_caching=True)
    runner = llm.llm_engine.runner
    assert _greedy(llm, [prompt], 8)[0] == cold
    ((key, saved),) = runner.kivi_sinks.entries.items()
    assert isinstance(key, bytes)
    residuals = KiviSinkStore.residuals(runner.kv_quants)
    assert len(saved) == len(residuals) == 30 and saved[0][0].shape == (4, 3, 66)
    restored: list[bool] = []
    real = KiviSinkStore.restore
    monkeypatch.setattr(
        KiviSinkStore, "restore", lambda *a: restored.append(real(*a)) or restored[-1]
    )
    again = llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert again.num_cached_tokens == 144 and restored == [True]
    assert list(again.outputs[0].token_ids) == cold
    row = runner.kivi_rows.by_request.get(again.request_id)  # released at the next step
    assert row is None or torch.equal(residuals[0].k[row, :4], saved[0][0])


def test_engine_reserves_the_residual_outside_the_pool() -> None:
    budget = 12 << 20
    a = engine(num_kv_blocks=None, kv_cache_memory=budget, max_num_seqs=4, max_model_len=256)
    b = engine(num_kv_blocks=None, kv_cache_memory=budget, max_num_seqs=12, max_model_len=256)
    cfg = a.llm_engine.kv_cache_config
    per = kivi_residual_bytes(cfg.kv_cache_groups)
    assert per == 30 * spec().kivi_residual_bytes  # 30 layers
    assert cfg.kivi_rows == 4 and b.llm_engine.kv_cache_config.kivi_rows == 12
    # and the sink store once: 64 first blocks' 4 int8 sink tokens
    sinks = kivi_sink_store_bytes(cfg.kv_cache_groups)
    assert sinks == 64 * 30 * 4 * 3 * (64 + 2 + 64 + 2)
    assert cfg.num_blocks == (budget - 4 * per - sinks) // cfg.bytes_per_block
    assert (
        b.llm_engine.kv_cache_config.num_blocks
        == (budget - 12 * per - sinks) // cfg.bytes_per_block
    )


def test_engine_refuses_what_kivi_cannot_do() -> None:
    llm = engine()
    with pytest.raises(ValueError, match="KIVI"):
        llm.generate(["hi"], SamplingParams(max_tokens=2, kv_eviction={"policy": "streaming",
                                                                        "budget_tokens": 64}))  # fmt: skip
    with pytest.raises(ValueError, match="rotation"):
        engine(kv_rotation="hadamard")
    assert llm.generate(["still serving"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_plan_refuses_kivi_where_attention_is_not_plain() -> None:
    from pagedkv.core.planning import kivi_unsupported
    from pagedkv.core.specs import KVCacheGroupSpec, SlidingWindowSpec

    sliding = SlidingWindowSpec(
        block_size=16, num_kv_heads=3, head_size=64, dtype="int3", kv_quant_mode="int3_kivi",
        sliding_window=128,
    )  # fmt: skip
    assert kivi_unsupported([KVCacheGroupSpec(["a"], sliding)]) is not None
    assert kivi_unsupported([KVCacheGroupSpec(["a"], spec())]) is None
