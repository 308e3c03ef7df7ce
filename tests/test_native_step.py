"""The native decode step (ops/native_step.py + ``pkv_decode_layers``) against the torch path.

Tiny Llama-family models with random weights (float32 rows, or random ggml rows of every GEMV
type, one type per projection or several in one fused projection), random paged caches in
every KV dtype and two layouts, random block tables, decode rows whose lengths cross blocks:
one native call must give the hidden states of ``LlamaModel.forward``'s torch path (within
1e-4) and write exactly this step's K/V slots, with the values the torch path writes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from test_native import BUILDS, use_build

from pagedkv.models import layers
from pagedkv.models.config import ModelConfig
from pagedkv.models.llama import LlamaForCausalLM
from pagedkv.ops import forward_context, native, native_step
from pagedkv.ops.kv_cache import allocate_kv_cache
from pagedkv.ops.metadata import AttentionMetadata

pytestmark = pytest.mark.skipif(
    not native.available(), reason="no C compiler: native kernels unavailable"
)

F32, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K = 0, 2, 3, 8, 12, 14
# fp16 scale magnitude per type: keeps random weights O(0.1-1) (K-quants multiply sub-scales up to 63/127).
SCALE = {Q4_0: 0.02, Q4_1: 0.02, Q8_0: 0.002, Q4_K: 4e-4, Q6_K: 4e-4}
LIMITS = (layers.NATIVE_GEMV_MAX_ROWS, layers.NATIVE_GEMV_MAX_ROWS_KQUANT)  # what LlamaModel passes
SCALE_AT = {Q4_1: (0, 2), Q4_K: (0, 2), Q6_K: (208, 1)}  # byte offset and count of the fp16 scales


def random_rows(qtype: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` rows of ``k`` weights as random ggml blocks with small finite float16 scales."""
    bw = native.block_weights(qtype)
    bb = native.row_bytes(qtype, k) // (k // bw)
    raw = torch.randint(0, 256, (n * k // bw, bb), dtype=torch.uint8, generator=gen)
    at, count = SCALE_AT.get(qtype, (0, 1))
    scales = (torch.randn(raw.shape[0], count, generator=gen) * SCALE[qtype]).half()
    raw[:, at : at + 2 * count] = scales.view(torch.uint8)
    return raw.reshape(n, -1).contiguous()


@dataclass
class Case:
    fmt: int | str = F32  # weight format: a ggml type for every projection, F32, or "mixed"
    rows: int = 1
    hq: int = 4
    hkv: int = 2
    d: int = 64
    block_size: int = 16
    kv_dtype: torch.dtype = torch.float32
    layout: str = "LBNHC"
    window: int | None = None
    bias: bool = False
    hidden: int = 256
    inter: int = 512
    seed: int = 0
    q8: bool = False  # the GGUF q8 mode (activations quantized to 8-bit blocks)


def make_model(c: Case) -> LlamaForCausalLM:
    cfg = ModelConfig.from_dict(
        dict(
            architecture="llama",
            num_layers=2,
            hidden_size=c.hidden,
            num_attention_heads=c.hq,
            num_kv_heads=c.hkv,
            head_dim=c.d,
            intermediate_size=c.inter,
            vocab_size=96,
            max_position_embeddings=1024,
            rms_norm_eps=1e-5,
            attention_bias=c.bias,
            sliding_window=c.window,
        )
    )
    model = LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(c.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(
                    torch.randn(p.shape, generator=gen)
                    * (0.5 if "bias" in name or "embed" in name else 0.05)
                )
        for layer in model.model.layers:
            projs = [
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            ]
            for i, lin in enumerate(projs):
                if c.fmt == F32:
                    continue
                n, k = lin.weight.shape
                # "mixed": qkv as Q4_K q/k rows + Q6_K v rows (llama.cpp's Q4_K_M), the rest Q8_0/Q4_1.
                types = (
                    [(Q4_K, n - c.hkv * c.d), (Q6_K, c.hkv * c.d)]
                    if c.fmt == "mixed" and i == 0
                    else [((Q8_0, Q4_1)[i % 2] if c.fmt == "mixed" else c.fmt, n)]
                )
                segs, start = [], 0
                for qtype, count in types:
                    rows = random_rows(qtype, count, k, gen)
                    lin.weight[start : start + count] = native.dequant(rows, qtype, k)
                    segs.append((start, start + count, qtype, rows))
                    start += count
                lin.set_qsegments(segs)
    if c.q8:
        model.set_q8_activations(True)
    return model


@dataclass
class Step:
    ids: torch.Tensor
    positions: torch.Tensor
    md: AttentionMetadata
    buffer: torch.Tensor
    caches: list[tuple[torch.Tensor, torch.Tensor]]


def make_step(c: Case, lens: list[int]) -> Step:
    """Decode rows of lengths ``lens`` (the new token at ``len - 1``) over random distinct
    blocks of a cache full of random history."""
    rng = random.Random(c.seed)
    need = [-(-n // c.block_size) for n in lens]
    free = list(range(1, sum(need) + 3))
    rng.shuffle(free)
    tables = []
    for k in need:
        tables.append(free[:k])
        free = free[k:]
    num_blocks = sum(need) + 3
    buffer, caches = allocate_kv_cache(
        c.layout, 2, num_blocks, c.block_size, c.hkv, c.d, c.kv_dtype
    )
    buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(c.seed + 1)))
    width = max(need)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    pos = [n - 1 for n in lens]
    slots = [
        tables[i][p // c.block_size] * c.block_size + p % c.block_size for i, p in enumerate(pos)
    ]
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_table=table,
        block_size=c.block_size,
        max_query_len=1,
        max_seq_len=max(lens),
        query_start_loc_cpu=list(range(len(lens) + 1)),
        seq_lens_cpu=list(lens),
    )
    ids = torch.randint(0, 96, (len(lens),), generator=torch.Generator().manual_seed(c.seed + 2))
    return Step(ids, torch.tensor(pos, dtype=torch.int64), md, buffer, caches)


def clone_caches(s: Step, c: Case) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    buffer, caches = allocate_kv_cache(
        c.layout, 2, s.caches[0][0].shape[0], c.block_size, c.hkv, c.d, c.kv_dtype
    )
    buffer.copy_(s.buffer)
    return buffer, caches


def run_both(c: Case, lens: list[int], monkeypatch: pytest.MonkeyPatch, calls: int = 1) -> None:
    model = make_model(c)
    s = make_step(c, lens)
    ref_buffer, ref_caches = clone_caches(s, c)
    before = s.buffer.clone()
    codes: list[int] = []
    real = native.decode_layers
    monkeypatch.setattr(native, "decode_layers", lambda *a: codes.append(real(*a)) or codes[-1])
    with torch.inference_mode():
        monkeypatch.setenv("PAGEDKV_NATIVE_STEP", "0")
        ref = model(s.ids, s.positions, ref_caches, s.md)
        assert not codes, "PAGEDKV_NATIVE_STEP=0 must keep the torch path"
        monkeypatch.setenv("PAGEDKV_NATIVE_STEP", "1")
        out = model(s.ids, s.positions, s.caches, s.md)
    assert codes == [0] * calls, "the step did not take the native kernel"
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # Exactly this step's slots changed, in both; there they hold the torch path's values
    # (up to the last ulp of the cache dtype: the inputs differ by float32 rounding).
    changed, ref_changed = s.buffer != before, ref_buffer != before
    assert torch.equal(s.buffer[~ref_changed], before[~ref_changed])
    for (k, v), (rk, rv) in zip(s.caches, ref_caches):
        blocks, offs = s.md.slot_mapping // c.block_size, s.md.slot_mapping % c.block_size
        tol = {torch.float32: 1e-4, torch.bfloat16: 2**-7, torch.float16: 2**-10}[c.kv_dtype]
        torch.testing.assert_close(
            k[blocks, offs].float(), rk[blocks, offs].float(), rtol=tol, atol=tol
        )
        torch.testing.assert_close(
            v[blocks, offs].float(), rv[blocks, offs].float(), rtol=tol, atol=tol
        )
    assert changed.any()


CASES = {
    "f32-m1": Case(),
    "f32-m16-gqa4-bs1": Case(rows=16, hq=8, hkv=2, block_size=1),
    "f32-m5-d128-mha-bias-window": Case(rows=5, hq=2, hkv=2, d=128, bias=True, window=20),
    "q4_0-m1-bf16": Case(fmt=Q4_0, kv_dtype=torch.bfloat16),
    "q4_1-m1": Case(fmt=Q4_1, hq=4, hkv=1),
    "q4_1-m3-f16-lbhnc": Case(fmt=Q4_1, rows=3, kv_dtype=torch.float16, layout="LBHNC"),
    "q8_0-m16-bs1-bf16": Case(fmt=Q8_0, rows=16, block_size=1, kv_dtype=torch.bfloat16),
    "q4_k-m1": Case(fmt=Q4_K, hq=2, hkv=1, d=128),
    "q6_k-m4-f16": Case(fmt=Q6_K, rows=4, kv_dtype=torch.float16),
    "q4_k-m12-dense-rows": Case(fmt=Q4_K, rows=12),  # above the K-quant row limit: float32 rows
    "mixed-m2-bias": Case(fmt="mixed", rows=2, bias=True),
    "mixed-m1-window-bs1": Case(fmt="mixed", block_size=1, window=7),
    # The q8 mode: the native step quantizes each linear's input itself, as the per-op path's
    # gemv_q8 does (K-quant rows of "mixed" stay float32 in both).
    "q8-q4_1-m1": Case(fmt=Q4_1, q8=True),
    "q8-q4_0-m5-bf16": Case(fmt=Q4_0, rows=5, kv_dtype=torch.bfloat16, q8=True),
    "q8-q8_0-m16": Case(fmt=Q8_0, rows=16, q8=True),
    "q8-mixed-m3-bias": Case(fmt="mixed", rows=3, bias=True, q8=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_native_step_matches_torch_path(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    c = CASES[name]
    lens = [1, 17, 33, 40, 16, 2, 31, 48, 9, 64, 3, 15, 50, 18, 5, 32][: c.rows]
    run_both(c, lens, monkeypatch)


@pytest.mark.parametrize(
    "rows,calls,case",
    [
        (40, 3, Case(rows=40)),  # 13 + 13 + 14 rows
        (17, 2, Case(rows=17, fmt=Q8_0, kv_dtype=torch.bfloat16)),
        (64, 4, Case(rows=64, fmt="mixed", bias=True)),
    ],
)
def test_native_step_runs_larger_steps_in_chunks(
    rows: int, calls: int, case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step of 17..CHUNKED_ROWS rows runs as equal chunks of at most 16 rows, one call
    each, and equals the torch path (outputs and every row's cache slot)."""
    assert rows <= native_step.CHUNKED_ROWS
    lens = [1 + (7 * i) % 70 for i in range(rows)]
    run_both(case, lens, monkeypatch, calls=calls)


def test_native_step_leaves_steps_above_the_chunked_limit_and_kquant_half_models(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past CHUNKED_ROWS rows, or above a K-quant half model's 8-row cap, the per-op path runs."""
    called: list[int] = []
    monkeypatch.setattr(native, "decode_layers", lambda *a: called.append(1) or 0)
    rows = native_step.CHUNKED_ROWS + 1
    c = Case(rows=rows)
    s = make_step(c, [3] * rows)
    with torch.inference_mode():
        assert make_model(c)(s.ids, s.positions, s.caches, s.md).shape == (rows, c.hidden)
        ck = Case(fmt=Q4_K, rows=12, kv_dtype=torch.bfloat16)
        sk = make_step(ck, [5] * 12)
        make_model(ck).to(torch.bfloat16)(sk.ids, sk.positions, sk.caches, sk.md)
    assert not called


SPLIT_CASES = {  # (case, row lengths): odd (row, KV head) item counts on 2 threads, rows >= 256 keys
    "m1-hkv1": (Case(fmt=Q4_1, hq=4, hkv=1), [600]),
    "m1-hkv3-bf16": (Case(hq=6, hkv=3, kv_dtype=torch.bfloat16), [257]),
    "m3-hkv1-window-bs1": (
        Case(fmt=Q8_0, rows=3, hq=2, hkv=1, window=300, block_size=1),
        [700, 301, 420],
    ),
}


@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_native_step_splits_long_rows_across_threads(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch 1 of an odd number of KV heads on 2 threads: each row's keys are cut into splits
    (flash-decoding) and merged by log-sum-exp, still matching the torch path."""
    c, lens = SPLIT_CASES[name]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run_both(c, lens, monkeypatch)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("build", [b for b in BUILDS if b != "native"])
@pytest.mark.parametrize(
    "name",
    [
        "f32-m1",
        "q4_1-m3-f16-lbhnc",
        "q4_k-m1",
        "mixed-m2-bias",
        "q8_0-m16-bs1-bf16",
        "q8-q4_0-m5-bf16",
        "q8-mixed-m3-bias",
    ],
)
def test_native_step_smaller_builds(name: str, build: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C paths of machines with less SIMD than this one (AVX2 without AVX-512, plain C)."""
    use_build(build, monkeypatch)
    c = CASES[name]
    run_both(c, [3, 40, 17][: c.rows] + [20] * max(0, c.rows - 3), monkeypatch)


def test_native_step_declines_what_it_does_not_cover(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every case the kernel does not run returns None having written nothing: the model then
    takes its torch path."""
    c = Case(rows=2)
    model = make_model(c)
    s = make_step(c, [5, 20])
    net = model.model
    before = s.buffer.clone()

    def step(**kw: object) -> torch.Tensor | None:
        args = dict(input_ids=s.ids, positions=s.positions, kv_caches=s.caches, md=s.md) | kw
        with torch.inference_mode():
            return native_step.decode_step(net, **args)  # type: ignore[arg-type]

    prefill = AttentionMetadata(
        s.md.slot_mapping,
        torch.tensor([0, 2], dtype=torch.int32),
        s.md.seq_lens[:1],
        s.md.block_table[:1],
        c.block_size,
        2,
        5,
        [0, 2],
        [5],
    )
    assert step(md=prefill) is None  # a prefill chunk
    assert step(md=[s.md, make_step(c, [5, 20]).md]) is None  # per-layer metadata that differs
    assert step(max_rows=1) is None  # more rows than allowed
    bad_pos = s.positions.clone()
    bad_pos[0] = 10_000  # past the rope table: the torch path raises its own error
    assert step(positions=bad_pos) is None
    monkeypatch.setenv("PAGEDKV_NATIVE_STEP", "0")
    assert step() is None
    monkeypatch.delenv("PAGEDKV_NATIVE_STEP")
    monkeypatch.setattr(forward_context, "_kv_connector", object())
    assert step() is None  # a KV connector's per-layer hooks need the torch path
    monkeypatch.setattr(forward_context, "_kv_connector", None)
    net.layers[
        1
    ].self_attn.kv_quant = object()  # a quantized / rotated cache (read with a new cache list)
    assert step(kv_caches=list(s.caches)) is None
    net.layers[1].self_attn.kv_quant = None
    bad_ids = s.ids.clone()
    bad_ids[1] = 96  # past the vocabulary
    assert step(input_ids=bad_ids) is None
    i8 = [(k.view(torch.int8)[..., : c.d], v.view(torch.int8)[..., : c.d]) for k, v in s.caches]
    assert step(kv_caches=i8) is None  # a KV dtype the kernel lacks
    assert torch.equal(s.buffer, before)
    assert step() is not None and not torch.equal(s.buffer, before)
    fp16 = make_model(c).to(torch.float16)  # dense float16 rows: not read in place (bf16 are)
    with torch.inference_mode():
        assert native_step.decode_step(fp16.model, s.ids, s.positions, s.caches, s.md) is None


def test_native_step_profile_times_its_sections(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a StepProfile installed every section accumulates time; without one nothing does."""
    c = Case(rows=2, fmt=Q4_1)
    model = make_model(c)
    s = make_step(c, [5, 20])
    prof = native_step.StepProfile()
    monkeypatch.setattr(native_step, "profile", prof)
    with torch.inference_mode():
        model(s.ids, s.positions, s.caches, s.md)
        model(s.ids, s.positions, s.caches, s.md)
        monkeypatch.setattr(native_step, "profile", None)
        model(s.ids, s.positions, s.caches, s.md)
    times = prof.as_dict()
    assert prof.steps == 2 and list(times) == list(native_step.SECTIONS)
    assert all(t > 0 for t in times.values()), times


def test_native_step_follows_a_new_kv_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pointer tables are built once per model, and re-pointed when another cache arrives."""
    c = Case(rows=2, kv_dtype=torch.bfloat16)
    model = make_model(c)
    a, b = make_step(c, [5, 20]), make_step(c, [5, 20])
    b.buffer.copy_(torch.randn(b.buffer.shape))
    with torch.inference_mode():
        out_a = model(a.ids, a.positions, a.caches, a.md)
        plan = native_step.plan_for(model.model, a.caches, *LIMITS)
        out_b = model(b.ids, b.positions, b.caches, b.md)
        assert (
            native_step.plan_for(model.model, b.caches, *LIMITS) is plan
        )  # same tables, new cache pointers
        monkeypatch.setenv("PAGEDKV_NATIVE_STEP", "0")
        ref_b = model(b.ids, b.positions, clone_caches(b, c)[1], b.md)
    assert not torch.allclose(out_a, out_b)  # b's history differs: b's cache was read
    torch.testing.assert_close(out_b, ref_b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_native_step_cache_writes_round_like_torch(
    kv_dtype: torch.dtype, build: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layer 0's new K/V do not depend on the cache, so a bf16/fp16 cache must receive exactly
    ``.to(kv_dtype)`` of what a float32 cache receives (round to nearest even), bit for bit."""
    use_build(build, monkeypatch)
    c16, c32 = Case(rows=3, fmt=Q4_1, kv_dtype=kv_dtype), Case(rows=3, fmt=Q4_1)
    model = make_model(c32)
    s16, s32 = make_step(c16, [4, 21, 40]), make_step(c32, [4, 21, 40])
    with torch.inference_mode():
        assert (
            native_step.decode_step(model.model, s32.ids, s32.positions, s32.caches, s32.md)
            is not None
        )
        assert (
            native_step.decode_step(model.model, s16.ids, s16.positions, s16.caches, s16.md)
            is not None
        )
    blocks, offs = s32.md.slot_mapping // c32.block_size, s32.md.slot_mapping % c32.block_size
    for got, want in zip(s16.caches[0], s32.caches[0]):
        assert torch.equal(got[blocks, offs], want[blocks, offs].to(kv_dtype))


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize(
    "fmt,rows,hidden",
    [
        (Q4_1, 1, 256),
        (Q8_0, 5, 256),
        ("mixed", 2, 256),
        (F32, 1, 256),
        (F32, 5, 256),
        (F32, 3, 200),
    ],
)
def test_native_step_half_model_computes_in_float32(
    fmt: int | str, rows: int, hidden: int, build: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bfloat16 model whose projections are all ggml rows (a GGUF loaded with dtype=bfloat16),
    or dense bf16 rows (an HF model in bfloat16, F32 here: read in place, widened in registers;
    hidden 200 leaves a tail after the vector loop), takes the native step: float32 math on the
    same weights, the hidden states rounded once to bf16. It equals the float32 model holding the
    bf16-rounded weights (up to that final rounding), so it is closer to float32 than the per-op
    bf16 path, which rounds after every op."""
    use_build(build, monkeypatch)
    c = Case(fmt=fmt, rows=rows, kv_dtype=torch.bfloat16, seed=3, hidden=hidden)
    model16 = make_model(c).to(torch.bfloat16)
    model32 = make_model(c).to(torch.bfloat16).float()  # same weights, widened back exactly
    s = make_step(c, [9 + 7 * i for i in range(rows)])
    codes: list[int] = []
    real = native.decode_layers
    monkeypatch.setattr(native, "decode_layers", lambda *a: codes.append(real(*a)) or codes[-1])
    with torch.inference_mode():
        monkeypatch.setenv("PAGEDKV_NATIVE_STEP", "0")
        per_op16 = model16(s.ids, s.positions, clone_caches(s, c)[1], s.md)
        ref32 = model32(s.ids, s.positions, clone_caches(s, c)[1], s.md)
        monkeypatch.setenv("PAGEDKV_NATIVE_STEP", "1")
        out = model16(s.ids, s.positions, s.caches, s.md)
    assert codes == [0] and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref32, rtol=2**-7, atol=2**-7)
    assert per_op16.dtype == torch.bfloat16 and per_op16.shape == out.shape
    assert (out.float() - ref32).abs().max() <= (per_op16.float() - ref32).abs().max()


def test_native_step_half_model_declines_above_a_kquant_row_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without float32 rows, a step above the K-quant row limit is left to the per-op path."""
    c = Case(fmt=Q4_K, rows=12, kv_dtype=torch.bfloat16)
    model = make_model(c).to(torch.bfloat16)
    s = make_step(c, [5 + i for i in range(12)])
    called: list[int] = []
    monkeypatch.setattr(native, "decode_layers", lambda *a: called.append(1) or 0)
    with torch.inference_mode():
        out = model(s.ids, s.positions, s.caches, s.md)
    assert not called and out.dtype == torch.bfloat16 and out.shape == (12, c.hidden)
