"""The KV-format study (`pagedkv.bench.kv_formats`): its emulation agrees with the engine's
codecs, its residual window means what it says, and its byte model is the engine's page size."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from pagedkv.bench import kv_formats as kf
from pagedkv.core.specs import FullAttentionSpec
from pagedkv.ops.kv_quant import KVQuant

FORMATS = {f.name: f for f in kf.FORMATS}


def engine_spec(dtype: str, mode: str, bs: int = 16, rotation: str | None = None):
    return FullAttentionSpec(
        block_size=bs,
        num_kv_heads=3,
        head_size=64,
        dtype=dtype,
        kv_quant_mode=mode,
        kv_rotation=rotation,
    )


def keys(*shape: int, seed: int = 0) -> torch.Tensor:
    """[B, H, T, D] activations with an outlier channel, as real keys have."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    x[..., 5] = x[..., 5] * 6.0 + 4.0
    return x


@pytest.mark.parametrize(("name", "dtype"), [("token-int3", "int3"), ("token-int2", "int2")])
def test_token_rows_emulate_the_engines_codec(name: str, dtype: str) -> None:
    """The shipped formats' rows give back what the engine's codec gives back (rotation
    included), up to the engine rounding scales up to fp16 (zero point in the mantissa)."""
    k, v = keys(1, 3, 40, 64), keys(1, 3, 40, 64, seed=1)
    ek, ev = kf.stored(FORMATS[name], k, v)
    q = KVQuant.for_spec(engine_spec(dtype, f"{dtype}_per_token_group", rotation="hadamard"))
    rows = lambda t: t[0].transpose(0, 1)  # noqa: E731  [T, H, D]
    dk, dv = q.dequantize(*q.quantize(rows(k), rows(v)))
    gk, gv = q.unrotate(dk), q.unrotate(dv)
    for emulated, engine, exact in ((ek, gk, k), (ev, gv, v)):
        err_emu = (rows(emulated) - rows(exact)).norm()
        err_eng = (engine - rows(exact)).norm()
        assert err_emu > 0.01 * rows(exact).norm()  # really lossy at these widths
        assert abs(err_emu - err_eng) < 0.15 * err_eng
        assert (rows(emulated) - engine).norm() < 0.5 * err_eng


@pytest.mark.parametrize(
    ("name", "mode", "bs"),
    [
        ("token-int4", "int4_per_token_group", 16),
        ("token-int3", "int3_per_token_group", 16),
        ("token-int2", "int2_per_token_group", 16),
        ("kivi-int3-b16-sink4-r2", "int3_kivi", 16),
        ("kivi-int3-b32-sink4-int8", "int3_kivi", 32),
        ("kivi-int2-b32-sink4-int8", "int2_kivi", 32),
    ],
)
def test_byte_model_is_the_engines_page(name: str, mode: str, bs: int) -> None:
    """The study's bytes are the engine's page (and, for the rows laid out as the engine's
    KIVI modes, its residual: 4 sinks and 32 tokens of blocks as int8)."""
    spec = engine_spec(mode[:4], mode, bs)
    f = FORMATS[name]
    assert f.token_head_bytes(64) == spec.k_part_bytes + spec.v_part_bytes
    if f.residual == "int8":
        assert f.request_overhead_bytes(64) * 3 == spec.kivi_residual_bytes


def test_per_channel_scales_span_a_block() -> None:
    """A channel constant over a block is stored exactly whatever the other channels hold, and
    a block's error depends only on its own tokens."""
    x = keys(1, 1, 32, 64)
    x[..., :16, 7] = 2.5
    y = kf.per_channel(x, 3, 16)
    assert torch.equal(y[..., :16, 7], x[..., :16, 7])
    x2 = x.clone()
    x2[..., 16:, :] *= 100.0  # the second block only
    assert torch.equal(kf.per_channel(x2, 3, 16)[..., :16, :], y[..., :16, :])
    err = (y - x).abs()
    span = x.reshape(1, 1, 2, 16, 64).amax(3) - x.reshape(1, 1, 2, 16, 64).amin(3)
    assert bool((err.reshape(1, 1, 2, 16, 64) <= span[:, :, :, None] / 7 / 2 + 1e-5).all())


def test_residual_window_counts_blocks_and_sinks() -> None:
    f = kf.Format("t", 3, "channel", block_size=16, sink=4, residual_blocks=2)
    m = kf.residual_mask(f, 64)
    assert bool(m[40, 16]) and bool(m[40, 31]) and bool(m[40, 40])  # its block and the one before
    assert not bool(m[40, 15]) and bool(m[40, 3]) and not bool(m[40, 4])  # sinks only
    assert bool(m[5, 0]) and bool(m[5, 5])


def test_a_residual_covering_everything_is_exact_attention() -> None:
    q, k, v = keys(1, 6, 20, 64, seed=2), keys(1, 3, 20, 64), keys(1, 3, 20, 64, seed=3)
    exact = kf.emulated_attention(None, q, k, v, 0.125)
    whole = kf.Format("w", 3, "channel", block_size=32, residual_blocks=1)
    assert torch.allclose(kf.emulated_attention(whole, q, k, v, 0.125), exact, atol=1e-5)
    lossy = kf.Format("l", 3, "channel", block_size=4, residual_blocks=1)
    assert not torch.allclose(kf.emulated_attention(lossy, q, k, v, 0.125), exact, atol=1e-3)


def test_formats_refuse_what_cannot_be_built() -> None:
    with pytest.raises(kf.BenchOptionError, match="filling block"):
        kf.Format("x", 3, "channel", residual_blocks=0).check(64)
    with pytest.raises(kf.BenchOptionError, match="does not divide"):
        kf.Format("x", 3, k_group=48).check(64)
    assert kf.main(["--formats", "no-such-format", "--json-only"]) == 2


def test_capacity_counts_the_residual() -> None:
    f = FORMATS["kivi-int3-b32-sink4-int8"]
    assert f.token_head_bytes(64) == 54.0  # 24 + 24 code bytes, 4 + 2 scale bytes
    assert f.request_overhead_bytes(64) == 36 * 132
    assert f.capacity_vs_bf16(64, 2048) == pytest.approx(2048 * 256 / (2048 * 54 + 36 * 132))
    assert f.capacity_vs_bf16(64, 256) < f.capacity_vs_bf16(64, 8192)


def test_an_int4_residual_is_read_at_int4() -> None:
    """The int4 residual: 36 bytes a 64-value part (codes + 2 fp16 scales), and what the
    residual tokens read is the int4 group codec's value, between exact and the 2-bit codes."""
    f = FORMATS["kivi-int2-b32-sink4-r2-int4"]
    assert f.request_overhead_bytes(64) == (4 + 64) * 2 * 36
    assert f.capacity_vs_bf16(64, 2048) > FORMATS["kivi-int2-b32-sink4-r2-int8"].capacity_vs_bf16(
        64, 2048
    )
    q, k, v = keys(1, 6, 40, 64, seed=2), keys(1, 3, 40, 64), keys(1, 3, 40, 64, seed=3)
    exact = kf.emulated_attention(None, q, k, v, 0.125)
    err = {
        r: (
            kf.emulated_attention(dataclasses.replace(f, residual=r), q, k, v, 0.125) - exact
        ).norm()
        for r in ("exact", "int8", "int4")
    }
    assert err["exact"] < err["int8"] < err["int4"]
    # within the residual window (all 40 tokens at block 32 with 2 blocks) int4 is what it reads
    k4, v4 = kf.per_token(k, 4, 32), kf.per_token(v, 4, 32)
    assert torch.allclose(
        kf.emulated_attention(f, q, k, v, 0.125), kf.emulated_attention(None, q, k4, v4, 0.125),
        atol=1e-5,
    )  # fmt: skip


@pytest.mark.slow
def test_tiny_run_reports_every_format(capsys: pytest.CaptureFixture[str]) -> None:
    rc = kf.main(
        [
            "--tokens",
            "160",
            "--window",
            "80",
            "--formats",
            "token-int3,kivi-int3-b16-sink4",
            "--json-only",
        ]
    )
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["formats"]
    assert set(rows) == {"token-int3", "kivi-int3-b16-sink4"}
    for row in rows.values():
        assert row["positions"] == report["corpus"]["tokens"] - report["corpus"]["windows"]
        assert 0 < row["top1_agreement"] <= 1 and row["mean_kl"] > 0
        assert row["meets_target"] in (True, False)
