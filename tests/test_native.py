"""The native CPU kernels (ops/csrc/): quantized GEMV and paged decode attention.

The dequantizer must give bit-identical weights to gguf.quants (so the GEMV multiplies by the
very float32 weights the dense model holds); the GEMV and the decode kernel are checked
against float64 references; the model must choose them only where they apply.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as np_dequantize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ref_attention import make_paged_batch

from pagedkv.ops import native
from pagedkv.ops.attention import paged_attention

pytestmark = pytest.mark.skipif(
    not native.available(), reason="no C compiler: native kernels unavailable"
)


def use_build(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``native.lib()`` this machine's build (``"native"``) or the one of its SIMD paths
    that a smaller machine runs: ``"avx2"`` (AVX2 + FMA + F16C, no AVX-512: Zen 2/3, Haswell ..
    Alder Lake) or ``"portable"`` (plain C). Skips a build this machine cannot make, or one that
    is this machine's own (the native case already covers it)."""
    if name == "native":
        return
    so = native.build(native.BUILD_FLAGS[name])
    got = native.isa(so)
    if name == "avx2" and got != "avx2":
        pytest.skip(f"this CPU cannot build the AVX2 path (it gets {got})")
    assert got == name
    monkeypatch.setattr(native, "lib", lambda: so)


# This machine's build, then each smaller path it is not already (an AVX2 machine's native build
# is the avx2 path: testing it twice would add nothing).
BUILDS = ["native"] + [b for b in native.BUILD_FLAGS if native.available() and native.isa() != b]


@pytest.fixture(params=BUILDS)
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test against this machine's build and against each smaller SIMD path (see
    :func:`use_build`)."""
    use_build(request.param, monkeypatch)
    return request.param


QTYPES = [
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q6_K,
]
K_QUANTS = {GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K}


def random_rows(qtype: GGMLQuantizationType, n: int, k: int, seed: int) -> torch.Tensor:
    """``n`` rows of ``k`` weights as random ggml blocks: random quants (and K-quant sub-block
    scales), random finite float16 super-scales (including subnormal and negative ones)."""
    rng = np.random.default_rng(seed)
    block, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n * k // block, type_size), dtype=np.uint8)
    # Byte offset and count of the float16 scales: d (and m / dmin) lead, Q6_K's d trails.
    at, num_scales = {
        GGMLQuantizationType.Q4_1: (0, 2),
        GGMLQuantizationType.Q4_K: (0, 2),
        GGMLQuantizationType.Q6_K: (208, 1),
    }.get(qtype, (0, 1))
    scales = (rng.standard_normal((raw.shape[0], num_scales)) * 0.05).astype(np.float16)
    scales[::7, 0] = np.float16(3e-6)  # subnormal float16
    raw[:, at : at + 2 * num_scales] = scales.view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1).copy())


def block_weights(qtype: GGMLQuantizationType) -> int:
    return GGML_QUANT_SIZES[qtype][0]


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.slow
def test_dequant_is_bit_identical_to_gguf(qtype: GGMLQuantizationType, kernels: str) -> None:
    k = 3 * block_weights(qtype)
    rows = random_rows(qtype, 24, k, seed=int(qtype))
    ref = torch.from_numpy(np_dequantize(rows.numpy(), qtype))
    assert torch.equal(native.dequant(rows, int(qtype), k), ref)


# The `kernels` fixture holds for every example of a test (one build per parametrization).
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    qtype=st.sampled_from(QTYPES),
    m=st.integers(1, 19),
    n=st.integers(1, 70),
    kb=st.integers(1, 9),
    bias=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_gemv_matches_float64_reference(
    qtype: GGMLQuantizationType, m: int, n: int, kb: int, bias: bool, seed: int, kernels: str
) -> None:
    k = block_weights(qtype) * (kb if qtype not in K_QUANTS else 1 + kb % 3)
    rows = random_rows(qtype, n, k, seed)
    w = torch.from_numpy(np_dequantize(rows.numpy(), qtype)).double()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    y = native.gemv_q(x, rows, int(qtype), b)
    ref = x.double() @ w.T + (b.double() if bias else 0)
    assert y.shape == (m, n) and y.dtype == torch.float32
    # float32 summation error scales with the sum of |products| (K-quant weights reach ~1e2).
    bound = 1e-5 * (x.double().abs() @ w.abs().T) + 1e-6
    assert ((y.double() - ref).abs() <= bound).all()


def test_gemv_rejects_bad_shapes_and_types() -> None:
    rows = random_rows(GGMLQuantizationType.Q8_0, 4, 64, seed=1)
    with pytest.raises(ValueError, match="does not hold"):
        native.gemv_q(torch.randn(2, 96), rows, int(GGMLQuantizationType.Q8_0))
    with pytest.raises(ValueError, match="float32"):
        native.gemv_q(torch.randn(2, 64, dtype=torch.float64), rows, int(GGMLQuantizationType.Q8_0))
    with pytest.raises(ValueError):
        native.gemv_q(torch.randn(2, 64), rows, 13)  # Q5_K: not a kernel type


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    lens=st.lists(st.integers(1, 300), min_size=1, max_size=6),
    bs=st.sampled_from([1, 16, 32]),
    hkv=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 3, 4]),
    d=st.sampled_from([8, 64, 70]),
    dv=st.sampled_from([None, 16]),
    layout=st.sampled_from([None, "LBNHC", "LBHNC", "BLNHC"]),
    window=st.one_of(st.none(), st.integers(1, 100)),
    seed=st.integers(0, 2**31),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
@pytest.mark.slow
def test_paged_decode_matches_dense_reference(
    lens: list[int],
    bs: int,
    hkv: int,
    group: int,
    d: int,
    dv: int | None,
    layout: str | None,
    window: int | None,
    seed: int,
    dtype: torch.dtype,
    kernels: str,
) -> None:
    """float32 math over a float32/bf16/fp16 cache: the reference sees the same stored values,
    so the tolerance is float32's whatever the cache dtype."""
    batch = make_paged_batch(
        lens,
        [1] * len(lens),
        block_size=bs,
        num_kv_heads=hkv,
        group=group,
        head_size=d,
        dtype=dtype,
        layout=layout,
        shared_prefix=seed % 2 == 0,
        seed=seed,
        head_size_v=dv,
    )
    scale = d**-0.5
    md = batch.md
    out, lse = native.paged_decode(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        md.block_table,
        md.seq_lens,
        scale,
        window,
        return_lse=True,
    )
    torch.testing.assert_close(out.double(), batch.reference(scale, window), atol=1e-5, rtol=1e-5)
    # lse of row r, head h: logsumexp of its visible scaled logits.
    for r, n in enumerate(lens):
        lo = 0 if window is None else max(0, n - window)
        k = batch.keys[r][lo:n].double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        s = torch.einsum("hd,lhd->hl", batch.query[r].double(), k) * scale
        torch.testing.assert_close(
            lse[r].double(), torch.logsumexp(s, dim=-1), atol=1e-5, rtol=1e-5
        )


def test_paged_decode_declines_what_it_does_not_cover() -> None:
    batch = make_paged_batch(
        [20],
        [1],
        block_size=16,
        num_kv_heads=1,
        group=2,
        head_size=8,
        dtype=torch.float32,
        layout=None,
        shared_prefix=False,
        seed=0,
    )
    md = batch.md
    assert (
        native.paged_decode(
            batch.query,
            batch.key_cache.double(),
            batch.value_cache.double(),
            md.block_table,
            md.seq_lens,
            1.0,
        )
        is None
    )  # float64: the torch path's job
    assert (
        native.paged_decode(
            batch.query, batch.key_cache, batch.value_cache.half(), md.block_table, md.seq_lens, 1.0
        )
        is None
    )  # K and V of different dtypes
    big = make_paged_batch(
        [20],
        [1],
        block_size=16,
        num_kv_heads=1,
        group=2,
        head_size=8,
        dtype=torch.float32,
        layout="LBNHC",
        shared_prefix=False,
        seed=0,
        head_size_v=8200,
    )
    assert (
        native.paged_decode(
            big.query, big.key_cache, big.value_cache, big.md.block_table, big.md.seq_lens, 1.0
        )
        is None
    )  # group x Dv > the accumulators
    # ...and paged_attention still answers through the torch path.
    out = paged_attention(big.query, big.key_cache, big.value_cache, big.md, 0.3)
    torch.testing.assert_close(out.double(), big.reference(0.3), atol=1e-5, rtol=1e-5)


def test_paged_attention_native_and_torch_paths_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixed step (decodes + prefill chunks): the decode rows take the native kernel unless it
    is off; both give the reference."""
    batch = make_paged_batch(
        [130, 7, 64, 300, 33],
        [1, 7, 1, 20, 1],
        block_size=16,
        num_kv_heads=3,
        group=3,
        head_size=64,
        dtype=torch.float32,
        layout="LBNHC",
        shared_prefix=True,
        seed=4,
    )
    args = (batch.query, batch.key_cache, batch.value_cache, batch.md, 0.125)
    calls = []
    real = native.paged_decode
    monkeypatch.setattr(native, "paged_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    with_native = paged_attention(*args, sliding_window=50)
    assert calls, "decode rows did not take the native kernel"
    monkeypatch.setattr(native, "lib", lambda: None)
    with_torch = paged_attention(*args, sliding_window=50)
    ref = batch.reference(0.125, 50)
    torch.testing.assert_close(with_native.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(with_torch.double(), ref, atol=1e-5, rtol=1e-5)


def test_default_model_gets_quantized_rows_and_uses_them_for_small_batches(pagedkv_model) -> None:
    """SmolLM2's GGUF is Q4_1 (+ a Q8_0 embedding): every projection and the tied LM head carry
    ggml rows; a 1-row projection equals BLAS on the float32 weight up to summation order, and
    a large batch takes BLAS (bit-equal to F.linear)."""
    from pagedkv.models.layers import NATIVE_GEMV_MAX_ROWS, Linear

    net = pagedkv_model.model
    linears = [m for m in net.modules() if isinstance(m, Linear)]
    assert linears and all(m.qsegments is not None for m in linears)
    ((_, _, head_type, _),) = net.lm_head.qsegments
    assert head_type == int(GGMLQuantizationType.Q8_0)
    layer = net.model.layers[0].self_attn.qkv_proj
    x = torch.randn(1, layer.weight.shape[1])
    dense = torch.nn.functional.linear(x, layer.weight)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), dense, atol=1e-5, rtol=1e-5)
        big = torch.randn(NATIVE_GEMV_MAX_ROWS + 1, layer.weight.shape[1])
        assert torch.equal(layer(big), torch.nn.functional.linear(big, layer.weight))
    # The fused q/k/v rows (one Q4_1 segment) dequantize exactly to the q/k-unpermuted weight.
    ((start, stop, qtype, rows),) = layer.qsegments
    assert (start, stop) == (0, layer.weight.shape[0])
    assert torch.equal(native.dequant(rows, qtype, layer.weight.shape[1]), layer.weight)


def test_fused_layer_with_rows_in_several_types() -> None:
    """llama.cpp's Q4_K_M files store some shards in another type (e.g. attn_v as Q6_K): each
    run of one type is a segment writing its own output columns; a shard in a type the kernel
    lacks leaves the layer on BLAS."""
    from pagedkv.models.layers import Linear
    from pagedkv.models.llama import LlamaForCausalLM

    q4k, q6k, q8 = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q8_0
    shards = [(q4k, 64), (q6k, 32), (q4k, 32), (q8, 16)]  # rows per shard, in output order
    k = 512
    rows = [random_rows(t, n, k, seed=i) for i, (t, n) in enumerate(shards)]
    weight = torch.cat(
        [torch.from_numpy(np_dequantize(r.numpy(), t)) for r, (t, _) in zip(rows, shards)]
    )
    layer = Linear(k, weight.shape[0], bias=True)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.normal_()

    class Fake:  # the bits of LlamaForCausalLM.load_quantized needs: one layer, no fusing
        _STACKED = ()

        def named_modules(self):
            return [("model.layers.0.mlp.proj", layer)]

        def _target(self, name: str, n: int) -> tuple[str, int]:
            return name.split("#")[0], int(name.split("#")[1])

    starts = [0, 64, 96, 128]
    items = [
        (f"model.layers.0.mlp.proj.weight#{s0}", int(t), r)
        for s0, (t, _), r in zip(starts, shards, rows)
    ]
    assert LlamaForCausalLM.load_quantized(Fake(), items[::-1]) == 1
    assert [(a, b, t) for a, b, t, _ in layer.qsegments] == [
        (0, 64, 12),
        (64, 96, 14),
        (96, 128, 12),
        (128, 144, 8),
    ]
    x = torch.randn(3, k)
    with torch.inference_mode():
        torch.testing.assert_close(
            layer(x), torch.nn.functional.linear(x, weight, layer.bias), atol=1e-3, rtol=1e-5
        )
    assert layer.qkquant
    layer.set_qsegments(None)
    missing = [
        it for it in items if not it[0].endswith("#96")
    ]  # the third shard's type had no kernel
    assert LlamaForCausalLM.load_quantized(Fake(), missing) == 0 and layer.qsegments is None


@pytest.mark.parametrize("emulated", [False, True])
def test_bf16_model_uses_the_file_blocks_in_float32(
    pagedkv_model_bf16, pagedkv_model, emulated: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bfloat16 model carries the same ggml rows; a small-batch projection computes from the
    exact file weights in float32 and rounds once, so it is closer to the float32 model than
    the dense bf16 product is. Above the row limit the dense path runs: torch's bf16 matmul on a
    CPU that has one, the float32 product of the same bf16 values rounded once where torch
    would emulate it (both branches run on every CPU)."""
    from pagedkv.models import layers
    from pagedkv.models.layers import NATIVE_GEMV_MAX_ROWS

    monkeypatch.setattr(
        layers, "_emulated_half_dtypes", lambda: frozenset({torch.bfloat16} if emulated else ())
    )

    layer16 = pagedkv_model_bf16.model.model.layers[3].mlp.gate_up_proj
    layer32 = pagedkv_model.model.model.layers[3].mlp.gate_up_proj
    assert layer16.qsegments is not None
    assert all(
        torch.equal(a[3], b[3]) for a, b in zip(layer16.qsegments, layer32.qsegments, strict=True)
    )
    x = torch.randn(4, layer16.weight.shape[1]).to(torch.bfloat16)
    with torch.inference_mode():
        ref = torch.nn.functional.linear(x.float(), layer32.weight)
        native_out = layer16(x)
        dense = torch.nn.functional.linear(x, layer16.weight)
        assert native_out.dtype == torch.bfloat16
        # Both end with one bf16 rounding of the output (the same worst case); on average the
        # exact weights are closer.
        assert (native_out.float() - ref).abs().mean() < (dense.float() - ref).abs().mean()
        big = x.repeat(NATIVE_GEMV_MAX_ROWS, 1)  # above the row limit: the dense path
        if emulated:
            want = torch.nn.functional.linear(big.float(), layer16.weight.float()).to(
                torch.bfloat16
            )
        else:
            want = torch.nn.functional.linear(big, layer16.weight)
        assert torch.equal(layer16(big), want)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 49152])
def test_argmax_rows_equals_torch_argmax(n: int, kernels: str) -> None:
    """The greedy sampler's argmax: the first maximum, ties, -inf rows, a NaN counting as the
    largest (the first NaN wins), rows of a wider tensor."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(6, n + 5, generator=gen)[:, :n]  # row stride n + 5
    x[1] = torch.randint(0, 3, (n,), generator=gen).float()  # many ties
    x[2] = float("-inf")
    if n > 2:
        x[3, n // 2] = x[3, n - 1] = float("nan")
        x[4, n - 1] = x[4].max() + 1  # the last lane
    x[5] = 0.0
    x[5, n - 1] = -0.0
    got = native.argmax_rows(x)
    assert torch.equal(got, x.argmax(dim=-1)), (got, x.argmax(dim=-1))
    with pytest.raises(ValueError, match="float32"):
        native.argmax_rows(x.double())
