"""The native CPU kernels (``ops/csrc/``): built at first use, called via ctypes.

``csrc/`` holds one file per idea (ISA header, ggml blocks, quantized GEMV, KV formats, decode
attention, the layer step); ``cpu_kernels.c`` #includes them all, and it alone is compiled: one
translation unit (a unity build), so the parts inline each other's static helpers exactly as
when they were one file, and the build stays one ``cc`` call. No Python or torch headers, so
``cc -O3 -march=native -fopenmp`` builds it in seconds. The library lands in
``$PAGEDKV_CACHE_DIR/native`` (default ``~/.cache/pagedkv/native``) under a name hashing every
source and header, the flags and this CPU's flags, so an edit (to any part) or another machine
gets a fresh build and concurrent builders never see a partial file (write to a temp name, then
``os.replace``).

No compiler, a failed build, or ``PAGEDKV_NATIVE=0`` → :func:`lib` returns ``None`` (one
warning) and callers keep their pure-torch path: the kernels make things faster, never
different in kind. ``PAGEDKV_NATIVE=1`` makes a failed build an error (CI uses it so a broken
kernel cannot hide behind the fallback).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pagedkv import envs
from pagedkv.core.specs import KVQuantMode, kivi_residual_blocks
from pagedkv.ops.kv_quant import KVQuant

log = logging.getLogger(__name__)

# The unity file: it #includes every other part of csrc/ (see its header), the only one compiled.
SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC", "-std=c11"]
# ggml tensor type ids the GEMV kernel reads (gguf.GGMLQuantizationType values): the simple
# 32-weight types and the K-quants of llama.cpp's popular Q4_K_M files (256-weight blocks).
GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, GGML_Q4_K, GGML_Q6_K = 2, 3, 8, 12, 14
SUPPORTED_QTYPES = frozenset({GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, GGML_Q4_K, GGML_Q6_K})
# The types the integer-dot GEMV over 8-bit activations reads (csrc/gemv_q8.c): the 32-weight
# ones. K-quant rows keep float32 math in the q8 mode.
Q8_ACT_QTYPES = frozenset({GGML_Q4_0, GGML_Q4_1, GGML_Q8_0})

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
# Extra flags that build each SIMD path of the kernels on a machine that has more (tests).
BUILD_FLAGS = {"avx2": ("-mno-avx512f",), "portable": ("-mno-avx512f", "-mno-avx2")}


def cache_dir() -> Path:
    return envs.PAGEDKV_CACHE_DIR / "native"


def _cpu_flags() -> str:
    """The CPU feature line of /proc/cpuinfo (x86 ``flags``, Arm ``Features``), or ""."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


# CPU feature flags (x86 /proc/cpuinfo ``flags``, Arm ``Features``) of native 16-bit matmuls.
_HALF_MATMUL_FLAGS = {
    torch.bfloat16: {"avx512_bf16", "amx_bf16", "bf16"},
    torch.float16: {"avx512_fp16", "amx_fp16", "asimdhp"},
}


def cpu_has_half_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` (bfloat16 / float16) natively: x86 AVX512_BF16 /
    AMX-BF16 or AVX512_FP16 / AMX-FP16, Arm's BF16 / FP16 arithmetic. Without it torch emulates
    the matmul: on an AVX2 EPYC a 576x1536 bf16 linear of 512 rows took 61 ms, against 11 ms
    for the same product in float32 including both casts. True for other dtypes, and where the
    flags cannot be read (nothing to work around)."""
    flags = _HALF_MATMUL_FLAGS.get(dtype)
    words = set(_cpu_flags().split(":", 1)[-1].split())
    return flags is None or not words or bool(words & flags)


def sources() -> list[Path]:
    """Every file the build reads: :data:`SOURCE` and the parts and headers it includes (all of
    ``csrc/*.c`` and ``csrc/*.h``), in name order."""
    return sorted(p for p in SOURCE.parent.iterdir() if p.suffix in (".c", ".h"))


def _sources_digest() -> bytes:
    """The build's source text for the cache key: each file's name and bytes (a rename, an
    edit or a new header all give a new key)."""
    return b"".join(p.name.encode() + b"\0" + p.read_bytes() + b"\0" for p in sources())


def _build(cc: str, flags: list[str]) -> Path:
    key = hashlib.sha256(
        _sources_digest() + " ".join([cc, *flags]).encode() + _cpu_flags().encode()
    )
    out = cache_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run(
            [cc, *flags, str(SOURCE), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _bind(so: ctypes.CDLL) -> ctypes.CDLL:
    so.pkv_gemv_q.argtypes = [ctypes.c_int, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64]
    so.pkv_gemv_q.restype = ctypes.c_int
    so.pkv_gemv_q8.argtypes = [ctypes.c_int, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64]
    so.pkv_gemv_q8.restype = ctypes.c_int
    so.pkv_quantize_q8.argtypes = [_ptr, _i64, _i64, _ptr, _ptr]
    so.pkv_quantize_q8.restype = ctypes.c_int
    so.pkv_gemv_dense.argtypes = [
        ctypes.c_int,
        _ptr,
        _i64,
        _i64,
        _ptr,
        _i64,
        _i64,
        _ptr,
        _ptr,
        _i64,
    ]
    so.pkv_gemv_dense.restype = ctypes.c_int
    so.pkv_dequant.argtypes = [ctypes.c_int, _ptr, _i64, _i64, _i64, _ptr]
    so.pkv_dequant.restype = ctypes.c_int
    for f in (so.pkv_block_bytes, so.pkv_block_weights):
        f.argtypes = [ctypes.c_int]
        f.restype = ctypes.c_int
    so.pkv_paged_decode.argtypes = [
        _ptr,
        _i64,
        _i64,
        _i64,
        _i64,
        _i64,
        _i64,
        _ptr,
        _i64,
        _i64,
        _i64,
        _ptr,
        _i64,
        _i64,
        _i64,
        _i64,
        _ptr,
        _i64,
        _ptr,
        _i64,
        _f32,
        _ptr,
        _i64,
        _ptr,
        ctypes.c_int,
        _f32,
        _f32,
        _i64,
        _i64,
    ]
    so.pkv_paged_decode.restype = ctypes.c_int
    # KIVI decode: q, rows, Hq, Hkv, D, Dv, k + 3 strides, v + 3 strides, block size, table +
    # stride, lens, residual K + 2 strides, residual V + 2 strides, res_rows, starts, sink_lo,
    # sink, window, blocks, bits, v_group, scale, out.
    so.pkv_kivi_decode.argtypes = [
        _ptr, *[_i64] * 5, _ptr, *[_i64] * 3, _ptr, *[_i64] * 4, _ptr, _i64, _ptr,
        _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, ctypes.c_int, _i64,
        ctypes.c_float, _ptr, ctypes.c_int,
    ]  # fmt: skip
    so.pkv_kivi_decode.restype = ctypes.c_int
    so.pkv_kivi_int_dot.argtypes = []
    so.pkv_kivi_int_dot.restype = ctypes.c_int
    # The whole-layer decode step (ops/native_step.py builds its pkv_model tables).
    so.pkv_decode_layers.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr]
    so.pkv_decode_layers.restype = ctypes.c_int
    so.pkv_step_struct_size.argtypes = [ctypes.c_int]
    so.pkv_step_struct_size.restype = _i64
    so.pkv_isa.argtypes = []
    so.pkv_isa.restype = ctypes.c_int
    so.pkv_argmax_rows.argtypes = [_ptr, _i64, _i64, _i64, _ptr]
    so.pkv_argmax_rows.restype = None
    so.pkv_apply_token_bitmask.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _i64]
    so.pkv_apply_token_bitmask.restype = None
    return so


def build(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Compile (or reuse the cached build) and load the library; raises ``OSError`` /
    ``subprocess.SubprocessError`` on failure. ``extra_flags`` append to :data:`FLAGS` (tests
    build the AVX2 path with ``-mno-avx512f`` and the portable C one with ``-mno-avx512f
    -mno-avx2``, see :data:`BUILD_FLAGS`, to check them on machines that have more)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise FileNotFoundError("no C compiler (cc/gcc) on PATH")
    return _bind(ctypes.CDLL(str(_build(cc, [*FLAGS, *extra_flags]))))


@functools.cache
def lib() -> ctypes.CDLL | None:
    """The loaded kernel library, or ``None`` when native kernels are off or cannot be built.
    ``PAGEDKV_NATIVE_ISA=avx2`` / ``portable`` builds a narrower SIMD path than the CPU has (to
    compare paths, or to sidestep one); the default ``native`` takes the widest."""
    mode = envs.PAGEDKV_NATIVE  # "off", "on" or "auto"
    if mode == "off":
        return None
    isa_env = envs.PAGEDKV_NATIVE_ISA
    if isa_env and isa_env not in (*BUILD_FLAGS, "native"):
        raise ValueError(
            f"PAGEDKV_NATIVE_ISA={isa_env!r}: expected one of native, {', '.join(BUILD_FLAGS)}"
        )
    try:
        return build(BUILD_FLAGS.get(isa_env, ()))
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        detail = getattr(e, "stderr", "") or e
        if mode == "on":
            raise RuntimeError(
                f"PAGEDKV_NATIVE=1 but the native kernels failed to build: {detail}"
            ) from e
        log.warning("native CPU kernels unavailable (%s); using the torch path", detail)
        return None


def available() -> bool:
    return lib() is not None


ISA_NAMES = {2: "avx512", 1: "avx2", 0: "portable"}


def isa(so: ctypes.CDLL | None = None) -> str | None:
    """Which SIMD build of the kernels ``so`` (default: :func:`lib`) holds: ``"avx512"``,
    ``"avx2"`` (AVX2 + FMA + F16C without AVX-512) or ``"portable"``; None without kernels."""
    so = so or lib()
    return None if so is None else ISA_NAMES[so.pkv_isa()]


def _addr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _require() -> ctypes.CDLL:
    so = lib()
    if so is None:
        raise RuntimeError("native kernels are not available")
    return so


@functools.cache
def _block(qtype: int) -> tuple[int, int]:
    """``(weights, bytes)`` of one ggml block of ``qtype`` as the kernel reads it; ``(0, 0)``
    for a type it lacks. Cached: the GEMV checks shapes on every call of a decode step."""
    so = _require()
    size = so.pkv_block_bytes(qtype)
    return (so.pkv_block_weights(qtype), size) if size else (0, 0)


def block_weights(qtype: int) -> int:
    """Weights per ggml block of ``qtype`` (32, or 256 for K-quants; 0 if the kernel lacks it)."""
    return _block(qtype)[0]


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of ``k`` weights in ggml type ``qtype`` (0 if the kernel lacks it or
    ``k`` is not a whole number of its blocks)."""
    bw, size = _block(qtype)
    return k // bw * size if bw and k % bw == 0 else 0


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (float32, ``K % 32 == 0``) as the q8 mode's activations: int8 quants
    ``[M, K]``, block scales ``d`` and ``s = d * sum(q)`` ``[M, K/32]`` (csrc/gemv_q8.c's
    arithmetic; exposed for its tests). Raises ``ValueError`` on a bad shape or dtype."""
    so = _require()
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] % 32 or x.device.type != "cpu":
        raise ValueError("quantize_q8 takes a 2-D float32 CPU tensor of 32-value blocks")
    x = x.contiguous()
    m, k = x.shape
    nb = k // 32
    q = torch.empty(m, k, dtype=torch.int8)
    ds = torch.empty(m, -(-nb // 8) * 8, 2)  # (d, s) pairs, the rows padded to 8 blocks
    so.pkv_quantize_q8(x.data_ptr(), m, k, q.data_ptr(), ds.data_ptr())
    return q, ds[:, :nb, 0].contiguous(), ds[:, :nb, 1].contiguous()


def gemv_q(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qtype: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    q8_activations: bool = False,
) -> torch.Tensor:
    """``x [M, K] @ W.T (+ bias)`` with ``W [N, K]`` held as ggml blocks ``qweight [N, bytes]``
    (uint8, contiguous rows). float32 in and out; the weights are exactly the values the GGUF
    dequantizer gives (see the C file). ``out`` may be a column slice ``[M, N]`` of a wider
    float32 tensor with unit column stride (a fused layer's rows of one type).
    ``q8_activations``: for the types in :data:`Q8_ACT_QTYPES`, quantize ``x`` to 8-bit blocks
    and take integer dot products (llama.cpp's arithmetic, csrc/gemv_q8.c); other types ignore
    it. Raises ``ValueError`` on a bad shape or type."""
    so = _require()
    if x.dtype != torch.float32 or x.dim() != 2 or x.device.type != "cpu":
        raise ValueError("gemv_q takes a 2-D float32 CPU tensor")
    x = x.contiguous()
    m, k = x.shape
    n = qweight.shape[0]
    if not block_weights(qtype):
        raise ValueError(f"ggml type {qtype} has no native kernel")
    expect = row_bytes(qtype, k)
    if expect == 0:
        raise ValueError(f"K={k} is not a whole number of type-{qtype} blocks")
    if qweight.shape[1] != expect or not qweight.is_contiguous():
        raise ValueError(
            f"qweight {tuple(qweight.shape)} does not hold {n} rows of {k} type-{qtype} weights"
        )
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    elif out.shape != (m, n) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be float32 [{m}, {n}] with unit column stride")
    fn = so.pkv_gemv_q8 if q8_activations and qtype in Q8_ACT_QTYPES else so.pkv_gemv_q
    fn(
        qtype,
        x.data_ptr(),
        m,
        k,
        qweight.data_ptr(),
        n,
        expect,
        _addr(bias),
        out.data_ptr(),
        out.stride(0),
    )
    return out


_DENSE_WTYPES = {torch.float32: 0, torch.bfloat16: 30}  # STEP_F32, STEP_BF16 (layer_step.h)


def gemv_dense(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [M, K] @ weight.T (+ bias)`` for a dense float32 or bfloat16 ``weight [N, K]`` (unit
    column stride), float32 in and out, float32 math: the layer step's own small-batch kernel
    (bf16 read in place, widened in registers), for the linears outside the step (the LM head).
    Meant for a few rows (a decode step's): it reads the weights once per 16 rows. Raises
    ``ValueError`` on a bad shape or dtype."""
    so = _require()
    wtype = _DENSE_WTYPES.get(weight.dtype)
    if x.dtype != torch.float32 or x.dim() != 2 or x.device.type != "cpu":
        raise ValueError("gemv_dense takes a 2-D float32 CPU tensor")
    if wtype is None or weight.dim() != 2 or weight.stride(1) != 1 or weight.device.type != "cpu":
        raise ValueError(
            "gemv_dense takes a 2-D float32/bfloat16 CPU weight with unit column stride"
        )
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} columns, weight {tuple(weight.shape)}")
    if bias is not None and (
        bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()
    ):
        raise ValueError(f"bias must be a contiguous float32 [{n}]")
    out = torch.empty(m, n, dtype=torch.float32)
    so.pkv_gemv_dense(
        wtype,
        x.data_ptr(),
        m,
        k,
        weight.data_ptr(),
        weight.stride(0),
        n,
        _addr(bias),
        out.data_ptr(),
        n,
    )
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D float32 CPU tensor with unit column stride (int64, one per
    row; the first maximum, a NaN counting as the largest, as torch): ~10x faster than torch's
    on a vocabulary-wide row."""
    so = _require()
    if x.dtype != torch.float32 or x.dim() != 2 or x.device.type != "cpu" or x.stride(1) != 1:
        raise ValueError("argmax_rows takes a 2-D float32 CPU tensor with unit column stride")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    so.pkv_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out


def apply_token_bitmask(x: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: every token of row ``r`` of ``x`` (2-D float32 CPU, unit column stride) whose
    bit is clear in ``bitmask[r]`` (int32 ``[rows, words]``, bit ``b`` of word ``w`` = token
    ``32 w + b``: xgrammar's and llguidance's layout) becomes ``-inf``."""
    so = _require()
    if x.dtype != torch.float32 or x.dim() != 2 or x.device.type != "cpu" or x.stride(1) != 1:
        raise ValueError(
            "apply_token_bitmask takes a 2-D float32 CPU tensor with unit column stride"
        )
    bm = bitmask.contiguous()
    if bm.dtype != torch.int32 or bm.dim() != 2 or bm.shape[0] != x.shape[0]:
        raise ValueError("the bitmask must be int32 [rows, words] with one row per logits row")
    so.pkv_apply_token_bitmask(
        x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), bm.data_ptr(), bm.shape[1]
    )


def dequant(qweight: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """float32 ``[N, k]`` from ggml rows, computed by the kernel's own dequantizer."""
    so = _require()
    out = torch.empty(qweight.shape[0], k, dtype=torch.float32)
    if so.pkv_dequant(
        qtype, qweight.data_ptr(), qweight.shape[0], k, qweight.shape[1], out.data_ptr()
    ):
        raise ValueError(f"unsupported ggml type {qtype} or K={k} not a whole number of its blocks")
    return out


# KV cache dtypes the decode kernel reads (converted exactly to float32 in registers).
KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Quantized cache formats it reads in place (csrc enum KV_I8_TH ...); fp8 per-tensor by fp8 dtype.
KV_QUANT_TYPES = {
    KVQuantMode.INT8_PER_TOKEN_HEAD: 3,
    KVQuantMode.FP8_PER_TOKEN_HEAD: 4,
    KVQuantMode.INT4_PER_TOKEN_HEAD: 7,
    KVQuantMode.INT4_PER_TOKEN_GROUP: 8,
    KVQuantMode.INT8_PER_TOKEN_HEAD_F16: 9,
    KVQuantMode.FP8_PER_TOKEN_HEAD_F16: 10,
    KVQuantMode.INT3_PER_TOKEN_GROUP: 12,
    KVQuantMode.INT2_PER_TOKEN_GROUP: 13,
}
KV_FP8_TYPES = {torch.float8_e4m3fn: 5, torch.float8_e5m2: 6}


def _quant_type(kv_quant: KVQuant) -> int | None:
    """The kernel's kv_type code for a quantized format, or None if it has none."""
    fmt = kv_quant.fmt
    if fmt.mode is KVQuantMode.FP8_PER_TENSOR:
        return KV_FP8_TYPES.get(fmt.fp8_dtype)  # type: ignore[arg-type]
    return KV_QUANT_TYPES.get(fmt.mode)


def paged_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    return_lse: bool = False,
    kv_quant: KVQuant | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Decode attention read straight from the paged cache, float32 math.

    ``q [R, Hq, D]`` (one query per row, at position ``seq_lens[r] - 1``; any float dtype),
    ``key_cache [NB, BS, Hkv, D]`` / ``value_cache [NB, BS, Hkv, Dv]`` in float32, bfloat16 or
    float16 (the same for both) with unit stride on the last dim, ``block_table [R,
    max_blocks]`` int32, ``seq_lens [R]`` int32 (>= 1). Returns ``(out [R, Hq, Dv] float32,
    lse [R, Hq] or None)``, or ``None`` when the kernel does not cover the case (no library,
    another KV dtype, group or head size past its limits): the caller then uses its torch path.

    ``kv_quant`` (a quantized format): the caches are its ``uint8`` parts ``[NB, BS, Hkv,
    k_bytes]`` / ``[..., v_bytes]`` (:mod:`pagedkv.ops.kv_quant`'s byte format), read and
    converted in registers with its per-tensor ``k_scale``/``v_scale``; ``D``/``Dv`` are the
    format's head sizes. The kernel neither rotates nor adds biases: ``q`` must already be
    rotated like the keys (``paged_attention`` does both around it).
    """
    so = lib()
    if (
        so is None
        or q.device.type != "cpu"
        or key_cache.stride(-1) != 1
        or value_cache.stride(-1) != 1
    ):
        return None
    k_scale = v_scale = 1.0
    if kv_quant is not None and kv_quant.fmt.quantized:
        fmt = kv_quant.fmt
        kvt = _quant_type(kv_quant)
        if (
            kvt is None
            or key_cache.dtype != torch.uint8
            or value_cache.dtype != torch.uint8
            or key_cache.shape[3] != fmt.k_bytes
            or value_cache.shape[3] != fmt.v_bytes
        ):
            return None
        d, dv = fmt.head_size, fmt.head_size_v
        k_group, v_group = fmt.k_group, fmt.v_group
        k_scale, v_scale = float(kv_quant.k_scale), float(kv_quant.v_scale)
    else:
        kvt = KV_TYPES.get(key_cache.dtype)
        if kvt is None or value_cache.dtype != key_cache.dtype:
            return None
        d, dv = key_cache.shape[3], value_cache.shape[3]
        k_group, v_group = d, dv
    if q.shape[-1] != d:
        return None
    q = q.float().contiguous()
    rows, hq, _ = q.shape
    hkv = key_cache.shape[2]
    table = block_table.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty(rows, hq, dv, dtype=torch.float32)
    lse = torch.empty(rows, hq, dtype=torch.float32) if return_lse else None
    ks, vs = key_cache.stride(), value_cache.stride()
    rc = so.pkv_paged_decode(
        q.data_ptr(),
        hq * d,
        rows,
        hq,
        hkv,
        d,
        dv,
        key_cache.data_ptr(),
        ks[0],
        ks[1],
        ks[2],
        value_cache.data_ptr(),
        vs[0],
        vs[1],
        vs[2],
        key_cache.shape[1],
        table.data_ptr(),
        table.stride(0),
        lens.data_ptr(),
        sliding_window or 0,
        scale,
        out.data_ptr(),
        hq * dv,
        _addr(lse),
        kvt,
        k_scale,
        v_scale,
        k_group,
        v_group,
    )
    return None if rc else (out, lse)


def kivi_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_quant: KVQuant,
    rows: torch.Tensor,
    starts: torch.Tensor,
    sink_lo: torch.Tensor | None = None,
    int_dot: bool = True,
) -> torch.Tensor | None:
    """Decode attention over a KIVI cache (``ops/csrc/kivi_decode.c``): what
    :func:`pagedkv.ops.kivi.kivi_attention` computes for one query a row, read in place.

    ``q [R, Hq, D]`` at positions ``seq_lens - 1``; the caches are the format's ``uint8`` K/V
    parts ``[NB, BS, Hkv, k_bytes]`` / ``[..., v_bytes]`` with the step's K/V already written
    (codes of every full block, the residual holding the new token); ``rows [R]``: each row's
    residual row in ``kv_quant.residual``, ``starts [R]``: the first position it computed
    itself, ``sink_lo [R]``: the first sink position its row holds (0 for sinks restored to
    a hit; default ``min(starts, sink)``: only what it computed). ``int_dot``: where the
    build has AVX512-VNNI and VBMI (:func:`kivi_int_dot`), take the integer dot products
    (codes against the query or the probabilities scaled to 15-bit integers: outputs within
    ~1e-4 relative of the float kernels'); False: the float kernels.
    Returns ``out [R, Hq, Dv]`` float32, or ``None`` where the kernel does not apply (no
    library, not CPU, shapes it does not cover): the caller then uses the torch path."""
    so, res, fmt = lib(), kv_quant.residual, kv_quant.fmt
    if (
        so is None
        or res is None
        or q.device.type != "cpu"
        or key_cache.stride(-1) != 1
        or value_cache.stride(-1) != 1
        or not res.k.is_contiguous()
        or not res.v.is_contiguous()
    ):
        return None
    q = q.float().contiguous()
    r, hq, d = q.shape
    hkv, bs, dv = key_cache.shape[2], key_cache.shape[1], fmt.head_size_v
    table = block_table.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    rows32, starts32 = rows.to(torch.int32).contiguous(), starts.to(torch.int32).contiguous()
    if sink_lo is None:
        sink_lo = starts.clamp(max=res.sink)
    sink_lo32 = sink_lo.to(torch.int32).contiguous()
    out = torch.empty(r, hq, dv, dtype=torch.float32)
    ks, vs, rks, rvs = key_cache.stride(), value_cache.stride(), res.k.stride(), res.v.stride()
    rc = so.pkv_kivi_decode(
        q.data_ptr(), r, hq, hkv, d, dv,
        key_cache.data_ptr(), ks[0], ks[1], ks[2],
        value_cache.data_ptr(), vs[0], vs[1], vs[2],
        bs, table.data_ptr(), table.stride(0), lens.data_ptr(),
        res.k.data_ptr(), rks[0], rks[1], res.v.data_ptr(), rvs[0], rvs[1],
        rows32.data_ptr(), starts32.data_ptr(), sink_lo32.data_ptr(), res.sink, res.window,
        kivi_residual_blocks(bs),
        fmt.mode.code_bits, fmt.v_group, scale, out.data_ptr(), int(int_dot),
    )  # fmt: skip
    return None if rc else out


def kivi_int_dot(so: ctypes.CDLL | None = None) -> bool:
    """Whether the build's KIVI decode has the integer dot products (AVX512-VNNI and VBMI)."""
    so = so or lib()
    return bool(so is not None and so.pkv_kivi_int_dot())


def decode_layers(
    so: ctypes.CDLL,
    model_addr: int,
    input_ids: torch.Tensor,
    out: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    profile_addr: int | None = None,
) -> int:
    """One call of ``pkv_decode_layers`` (see the C file) on the ``pkv_model`` at ``model_addr``:
    ``input_ids``/``positions``/``slot_mapping [M]`` int64, ``out [M, hidden]`` float32 (the
    final-normed hidden states), ``block_table [M, max_blocks]`` int32 with unit column stride,
    ``seq_lens [M]`` int32, all contiguous CPU tensors (the caller checks); ``profile_addr``:
    None or the address of the kernel's per-section seconds (6 doubles, added to). Returns the
    kernel's code: 0, or -1/-2 (nothing done: shape not covered / argument out of range)."""
    return so.pkv_decode_layers(
        model_addr,
        out.shape[0],
        input_ids.data_ptr(),
        out.data_ptr(),
        positions.data_ptr(),
        slot_mapping.data_ptr(),
        block_table.data_ptr(),
        block_table.stride(0),
        seq_lens.data_ptr(),
        profile_addr,
    )
