"""Ahead-of-time compile of the Triton kernels for a CUDA target, without a GPU.

Runs Triton's whole pipeline (TTIR → TTGIR → LLVM → PTX → cubin with the bundled ``ptxas``) for
representative variants of every kernel: type errors, layout problems and shared-memory
overflows that the interpreter cannot see show up on a CPU-only machine. Needs
``TRITON_INTERPRET`` unset (or 0).

Run: ``python -m pagedkv.ops.triton.compile_check [--arch 90 80]``; exit 1 on any failure.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedkv.ops.triton.copy_blocks import _copy_blocks
from pagedkv.ops.triton.reshape_and_cache import _reshape_and_cache
from pagedkv.ops.triton.unified_attention import _reduce_segments, _unified_attention, tiling

_DOT = {"fp32": (tl.float32, "ieee"), "bf16": (tl.bfloat16, "tf32"), "fp16": (tl.float16, "tf32")}


def _source(fn: Any, types: dict[str, str], consts: dict[str, Any]) -> ASTSource:
    """``fn`` with pointer/float types from ``types`` (others ``i32``) and ``consts`` bound."""
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    return ASTSource(
        fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}
    )


def variants(dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16")) -> list[tuple[str, ASTSource]]:
    """(name, source) of the variants to compile: 2D and split-KV attention with and without
    window/softcap, GQA groups 1, 5 (not a power of two) and 4; the reduction; the cache ops."""
    out = []
    for dt in dtypes:
        dot, prec = _DOT[dt]
        types = {n: f"*{dt}" for n in ("out_ptr", "q_ptr", "k_ptr", "v_ptr")}
        types.update(
            block_table_ptr="*i32",
            seq_lens_ptr="*i32",
            query_start_loc_ptr="*i32",
            segm_out_ptr="*fp32",
            segm_max_ptr="*fp32",
            segm_expsum_ptr="*fp32",
            scale="fp32",
            softcap="fp32",
        )
        # (segments, window, softcap, group, max query len): prefill tiling, decode split-KV,
        # a group that is not a power of two.
        for segs, window, cap, group, qlen in [
            (1, 0, False, 1, 512),
            (16, 64, True, 4, 1),
            (4, 0, False, 5, 4),
        ]:
            block_m, tile = tiling(group, qlen, 128 * (4 if dt == "fp32" else 2))
            consts = dict(
                NUM_Q_HEADS=8 * group,
                GROUP=group,
                HEAD_SIZE=128,
                HEAD_SIZE_V=128,
                HEAD_PAD=128,
                HEAD_PAD_V=128,
                BLOCK_SIZE=16,
                TILE_SIZE=tile,
                BLOCK_Q=block_m // group,
                BLOCK_M=block_m,
                SLIDING_WINDOW=window,
                USE_SOFTCAP=cap,
                NUM_SEGMENTS=segs,
                DOT_DTYPE=dot,
                DOT_PREC=prec,
            )
            out.append(
                (
                    f"attention {dt} segments={segs} window={window} softcap={cap} G={group}",
                    _source(_unified_attention, types, consts),
                )
            )
    out.append(
        (
            "reduce_segments",
            _source(
                _reduce_segments,
                dict(
                    out_ptr="*bf16",
                    segm_out_ptr="*fp32",
                    segm_max_ptr="*fp32",
                    segm_expsum_ptr="*fp32",
                    seq_lens_ptr="*i32",
                    query_start_loc_ptr="*i32",
                ),
                dict(
                    NUM_Q_HEADS=32, HEAD_SIZE_V=128, HEAD_PAD_V=128, TILE_SIZE=16, NUM_SEGMENTS=16
                ),
            ),
        )
    )
    out.append(
        (
            "reshape_and_cache fp32->bf16",
            _source(
                _reshape_and_cache,
                dict(
                    key_ptr="*fp32",
                    value_ptr="*fp32",
                    key_cache_ptr="*bf16",
                    value_cache_ptr="*bf16",
                    slot_mapping_ptr="*i64",
                ),
                dict(BLOCK_SIZE=16, HEAD_SIZE=128, HEAD_SIZE_V=128, HEAD_PAD=128, HEAD_PAD_V=128),
            ),
        )
    )
    out.append(
        (
            "copy_blocks",
            _source(
                _copy_blocks,
                dict(cache_ptr="*bf16", src_ptr="*i64", dst_ptr="*i64"),
                dict(Y=8, Z=256, Y_PAD=8, Z_PAD=256),
            ),
        )
    )
    return out


# Shared memory per block on the smallest sm_80+ parts (sm_86/sm_89: 99 KiB usable).
MAX_SHARED_BYTES = 101376


def compile_all(arch: int, dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16")) -> list[str]:
    """Compile every variant for ``sm_{arch}``; returns the failures' messages (a compile
    error, or more shared memory than :data:`MAX_SHARED_BYTES`: a launch error on such GPUs)."""
    target = GPUTarget("cuda", arch, 32)
    failures = []
    for name, src in variants(dtypes):
        try:
            shared = triton.compile(src, target=target).metadata.shared
        except Exception as e:  # noqa: BLE001 - report every variant, not just the first
            failures.append(f"sm_{arch} {name}: {e!r}"[:2000])
            continue
        if shared > MAX_SHARED_BYTES:
            failures.append(f"sm_{arch} {name}: {shared} bytes of shared memory")
    return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[90])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16", "fp16"], choices=list(_DOT))
    args = ap.parse_args(argv)
    failures = [f for arch in args.arch for f in compile_all(arch, tuple(args.dtypes))]
    for f in failures:
        print("FAIL", f)
    print(f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
