"""Building and switching off the native kernels: a missing compiler or PAGEDKV_NATIVE=0 falls
back to the torch path (with a warning); PAGEDKV_NATIVE=1 makes a failed build an error."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedkv.ops import native


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """An empty build cache and an uncached ``lib()``; restored afterwards."""
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
    native.lib.cache_clear()
    yield
    native.lib.cache_clear()


def test_off_switch_gives_the_torch_path(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_NATIVE", "0")
    assert native.lib() is None and not native.available()


def test_missing_compiler_warns_and_falls_back(
    fresh: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PAGEDKV_NATIVE", "auto")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger="pagedkv.ops.native"):
        assert native.lib() is None
    assert "native CPU kernels unavailable" in caplog.text


def test_required_build_that_fails_is_an_error(
    fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDKV_NATIVE", "1")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(RuntimeError, match="PAGEDKV_NATIVE=1"):
        native.lib()


@pytest.mark.skipif(native.lib() is None, reason="no C compiler")
@pytest.mark.slow
def test_build_lands_in_the_cache_dir_once(
    fresh: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CC", raising=False)
    assert native.lib() is not None
    built = list((tmp_path / "native").glob("cpu_kernels-*.so"))
    assert len(built) == 1 and not list((tmp_path / "native").glob("tmp*"))
    mtime = built[0].stat().st_mtime_ns
    native.lib.cache_clear()
    assert native.lib() is not None  # reuses the cached library, no rebuild
    assert built[0].stat().st_mtime_ns == mtime


def _cpu_flags() -> set[str]:
    line = native._cpu_flags()
    return set(line.split(":", 1)[1].split()) if ":" in line else set()


@pytest.mark.skipif(native.lib() is None, reason="no C compiler")
@pytest.mark.slow
def test_native_build_runs_the_widest_simd_path_this_cpu_has() -> None:
    """An AVX2 machine without AVX-512 (AMD Zen 2/3, Intel before Sapphire Rapids) must get the
    AVX2 kernels, not the portable C loops: on such a 2-core EPYC the portable path decoded the
    default model at 18 tok/s, a quarter of llama.cpp's speed (bench_latency.py)."""
    flags = _cpu_flags()
    has_avx2 = {"avx2", "fma", "f16c"} <= flags
    want = (
        "avx512"
        if {"avx512f", "avx512bw", "avx512vl"} <= flags
        else "avx2"
        if has_avx2
        else "portable"
    )
    assert native.isa() == want
    for (
        name,
        extra,
    ) in native.BUILD_FLAGS.items():  # the smaller paths the tests build (tests/test_native.py)
        assert native.isa(native.build(extra)) == (name if has_avx2 else "portable")


@pytest.mark.skipif(native.lib() is None, reason="no C compiler")
@pytest.mark.parametrize("name", [*native.BUILD_FLAGS, "bogus"])
def test_native_isa_env_picks_a_narrower_build(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """PAGEDKV_NATIVE_ISA=avx2 / portable loads that path (on a CPU that has AVX2); an unknown
    name is an error that names the choices, never a silent fallback."""
    has_avx2 = {"avx2", "fma", "f16c"} <= _cpu_flags()
    monkeypatch.setenv("PAGEDKV_NATIVE_ISA", name)
    native.lib.cache_clear()
    try:
        if name == "bogus":
            with pytest.raises(ValueError, match="expected one of native, avx2, portable"):
                native.lib()
        else:
            assert native.isa() == (name if has_avx2 else "portable")
    finally:
        monkeypatch.delenv("PAGEDKV_NATIVE_ISA")
        native.lib.cache_clear()


def test_half_matmul_support_is_read_from_the_cpu_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16/fp16 matmuls count as native where /proc/cpuinfo's x86 or Arm feature line says so;
    float32 always is, and an unreadable feature line assumes so (nothing to work around)."""
    import torch

    bf16, fp16 = torch.bfloat16, torch.float16
    for line, want in [
        ("flags\t: fpu avx2 fma f16c", (False, False)),
        ("flags\t: avx512f avx512_bf16", (True, False)),
        ("flags\t: avx2 amx_bf16 amx_fp16 amx_tile", (True, True)),
        ("flags\t: avx512_bf16 avx512_fp16", (True, True)),
        ("Features\t: fp asimd bf16", (True, False)),
        ("Features\t: fp asimd asimdhp", (False, True)),
        ("", (True, True)),
    ]:
        monkeypatch.setattr(native, "_cpu_flags", lambda line=line: line)
        assert (native.cpu_has_half_matmul(bf16), native.cpu_has_half_matmul(fp16)) == want, line
        assert native.cpu_has_half_matmul(torch.float32)


@pytest.mark.parametrize("emulated", [False, True])
def test_half_linear_computes_in_float32_where_the_cpu_lacks_the_matmul(
    emulated: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 linear on a CPU without bf16 matmuls is the float32 product of the same values,
    rounded once (1.4-5.6x faster than torch's emulated bf16 matmul); elsewhere torch's."""
    import torch
    import torch.nn.functional as F

    from pagedkv.models import layers

    monkeypatch.setattr(
        layers, "_emulated_half_dtypes", lambda: frozenset({torch.bfloat16} if emulated else ())
    )
    lin = layers.Linear(64, 48, bias=True)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=gen))
        lin.bias.copy_(torch.randn(48, generator=gen))
    lin = lin.to(torch.bfloat16)
    x = torch.randn(40, 64, generator=gen).bfloat16()
    y = lin(x)
    assert y.dtype == torch.bfloat16
    fp32 = F.linear(x.float(), lin.weight.float(), lin.bias.float()).bfloat16()
    assert torch.equal(y, fp32 if emulated else F.linear(x, lin.weight, lin.bias))


@pytest.mark.parametrize("has_bf16", [False, True])
def test_bf16_engine_on_a_cpu_without_bf16_matmuls_warns(
    has_bf16: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from pagedkv import LLM

    monkeypatch.setattr(native, "cpu_has_half_matmul", lambda dtype: has_bf16)
    with caplog.at_level(logging.WARNING, logger="pagedkv.engine.llm_engine"):
        LLM(dtype="bfloat16", max_model_len=64, num_kv_blocks=8)
    assert ("dtype='float32' is as fast and exact" in caplog.text) is not has_bf16
