/* pagedkv CPU kernels: fused GGUF dequant + GEMV, and paged decode attention (float32 math
 * over a float32, bfloat16 or float16 KV cache, or a quantized one read in place: int8, fp8,
 * int4 with per-token-head or per-group scales).
 *
 * Built at first use by pagedkv/ops/native.py with
 *   cc -O3 -march=native -fopenmp -ffp-contract=off -shared -fPIC
 * and called through ctypes (no Python or torch headers: it compiles in about a second).
 * OpenMP resolves to the libgomp torch already loaded, so these loops share torch's threads.
 *
 * Exactness contract. A weight is rebuilt exactly as gguf.quants (and pagedkv's torch
 * dequantizer) does it: Q4_0 w = d*(q-8), Q4_1 w = d*q + m (product rounded, then the sum:
 * hence -ffp-contract=off), Q8_0 w = d*q, Q4_K w = (d*sc)*q - dmin*m, Q6_K w = (d*sc)*(q-32),
 * with d and m converted exactly from float16. So the
 * kernel multiplies x by the very float32 weights the dense model holds; only the order of the
 * dot product's additions differs from BLAS (as BLAS's differs between shapes).
 *
 * Why: at small batch a decode step streams every weight once. Q4_1 is 0.625 bytes a weight
 * against 4 for float32, and this machine class is bound by memory bandwidth there.
 *
 * Layout: one idea a file, one translation unit. This file #includes the parts in dependency
 * order, and ops/native.py compiles only it (a unity build): the parts call each other's
 * static helpers (the layer step inlines the GEMV and attention loops), so one unit keeps
 * GCC's inlining, and the code, what it was as a single file, and the build one cc call.
 *   isa.h                     the build's ISA (AVX-512 / AVX2 / portable), vector width, fp16
 *   ggml_blocks.c             ggml block sizes and dequantizers
 *   gemv_quant.c              quantized GEMV (pkv_gemv_q, pkv_dequant)
 *   gemv_q8.c                 ... over activations quantized to 8 bits (pkv_gemv_q8, opt-in)
 *   argmax.c                  sampling: argmax (pkv_argmax_rows), token bitmask (structured outputs)
 *   kv_formats.h              KV cache formats (float and quantized) and their readers
 *   decode_attention.h/.c     paged decode attention over a float KV cache
 *   decode_attention_quant.c  ... over a quantized KV cache, read in place
 *   paged_decode.c            pkv_paged_decode, the attention's entry point
 *   kivi_decode.c             pkv_kivi_decode: ... over a KIVI cache (codes and residual)
 *   layer_step.h              the whole-layer step's tables (mirrored in ops/native_step.py)
 *   step_linear.c             the step's linears (float32 rows / ggml segments)
 *   norm_rope.c               RMSNorm, SiLU*mul, K/V rounding, RoPE
 *   layer_step.c              pkv_decode_layers
 */
#include "isa.h"

/* 2: AVX-512, 1: AVX2, 0: portable C (the GEMV paths; the attention's AVX-512 path also needs
 * BW/VL, which every AVX-512 CPU this runs on has). */
int pkv_isa(void) {
#if defined(__AVX512F__)
    return 2;
#elif PKV_AVX2
    return 1;
#else
    return 0;
#endif
}

#include "ggml_blocks.c"
#include "gemv_quant.c"
#include "gemv_q8.c"
#include "argmax.c"
#include "kv_formats.h"
#include "decode_attention.h"
#include "decode_attention.c"
#include "decode_attention_quant.c"
#include "paged_decode.c"
#include "kivi_decode.c"
#include "layer_step.h"
#include "step_linear.c"
#include "norm_rope.c"
#include "layer_step.c"
