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
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* Three builds of every hot loop, chosen by what -march=native offers: AVX-512 (F, and BW/VL
 * for the attention), AVX2 + FMA + F16C without AVX-512 (AMD Zen 2/3, Intel Haswell to Alder
 * Lake: PKV_AVX2, the same loops 8 lanes wide), and portable C. All three compute the same
 * float32 products of the same values; only the order of additions differs. pkv_isa() says
 * which one this library holds. */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PKV_AVX2 1
#else
#define PKV_AVX2 0
#endif
#define ALWAYS_INLINE static inline __attribute__((always_inline))

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

enum { QK = 32, QK_K = 256, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };  /* ggml type ids */
enum { MAX_M = 16 };                            /* rows of x per pass over the weights */

static inline float fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t load_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

int pkv_block_bytes(int qtype) {
    switch (qtype) {
        case Q4_0: return 18;
        case Q4_1: return 20;
        case Q8_0: return 34;
        case Q4_K: return 144;
        case Q6_K: return 210;
        default: return 0;
    }
}

/* Weights per block: 32 for the simple types, 256 for the K-quants' super-blocks. */
int pkv_block_weights(int qtype) { return (qtype == Q4_K || qtype == Q6_K) ? QK_K : QK; }

/* Q4_K: 6-bit scale and min of sub-block j (gguf.quants Q4_K.get_scale_min). */
static inline void q4k_scale_min(const uint8_t *sc, int j, int *scale, int *min) {
    if (j < 4) {
        *scale = sc[j] & 0x3F;
        *min = sc[j + 4] & 0x3F;
    } else {
        *scale = (sc[j + 4] & 0x0F) | ((sc[j - 4] >> 2) & 0x30);
        *min = (sc[j + 4] >> 4) | ((sc[j] >> 2) & 0x30);
    }
}

#if defined(__AVX512F__) || PKV_AVX2
/* dequant_superblock's vector loops, written once for both widths: VW float lanes a register,
 * each from one byte (a 16-byte load for AVX-512, 8 bytes for AVX2). */
#if defined(__AVX512F__)
enum { VW = 16 };
typedef __m512 vfloat;
#define V_SET1 _mm512_set1_ps
#define V_STORE _mm512_storeu_ps
#define V_MUL _mm512_mul_ps
#define V_SUB _mm512_sub_ps
#define V_LOAD_BYTES(p) _mm_loadu_si128((const __m128i *)(p))
/* VW bytes (the low ones of x) as float lanes, each less `off`. */
#define V_BYTES_F(x, off) _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(x), _mm512_set1_epi32(off)))
#else
enum { VW = 8 };
typedef __m256 vfloat;
#define V_SET1 _mm256_set1_ps
#define V_STORE _mm256_storeu_ps
#define V_MUL _mm256_mul_ps
#define V_SUB _mm256_sub_ps
#define V_LOAD_BYTES(p) _mm_loadl_epi64((const __m128i *)(p))
#define V_BYTES_F(x, off) _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(x), _mm256_set1_epi32(off)))
#endif

/* Bytes [VW*i, VW*i + VW) of q, at the bottom of a register. */
static inline __m128i bytes_chunk(__m256i q, int i) {
    __m128i half = (VW * i) & 16 ? _mm256_extracti128_si256(q, 1) : _mm256_castsi256_si128(q);
    return (VW * i) & 8 ? _mm_unpackhi_epi64(half, half) : half;
}
#endif

/* Dequantize one K-quant super-block into w[256], with gguf.quants' float32 operations:
 * Q4_K w = (d*sc)*q - dmin*m per 32-weight sub-block; Q6_K w = (d*scale)*(q-32) per 16. */
static void dequant_superblock(int qtype, const uint8_t *b, float *w) {
#if defined(__AVX512F__) || PKV_AVX2
    if (qtype == Q4_K) {
        float d = fp16_to_fp32(load_u16(b)), dmin = fp16_to_fp32(load_u16(b + 2));
        const uint8_t *scales = b + 4, *qs = b + 16;
        const __m128i low = _mm_set1_epi8(0x0F);
        for (int j = 0; j < 8; j++) {
            int sc, m;
            q4k_scale_min(scales, j, &sc, &m);
            vfloat ds = V_SET1(d * (float)sc), dm = V_SET1(dmin * (float)m);
            const uint8_t *q = qs + (j / 2) * 32;
            for (int h = 0; h < 32 / VW; h++) {
                __m128i v = V_LOAD_BYTES(q + VW * h);
                if (j % 2) v = _mm_srli_epi16(v, 4);
                V_STORE(w + j * 32 + VW * h, V_SUB(V_MUL(ds, V_BYTES_F(_mm_and_si128(v, low), 0)), dm));
            }
        }
        return;
    }
    if (qtype == Q6_K) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *scales = (const int8_t *)(b + 192);
        float d = fp16_to_fp32(load_u16(b + 208));
        const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
        for (int c = 0; c < 8; c++) {
            int h = c / 4, r = c % 4;
            __m256i l = _mm256_loadu_si256((const __m256i *)(ql + h * 64 + (r % 2) * 32));
            __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + h * 32));
            l = _mm256_and_si256(_mm256_srl_epi16(l, _mm_cvtsi32_si128((r / 2) * 4)), m4);
            hb = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * r)), m2), 4);
            __m256i q = _mm256_or_si256(l, hb);
            for (int p = 0; p < 32 / VW; p++) {  /* 16 weights share a scale */
                vfloat dj = V_SET1(d * (float)scales[c * 2 + VW * p / 16]);
                V_STORE(w + c * 32 + VW * p, V_MUL(dj, V_BYTES_F(bytes_chunk(q, p), 32)));
            }
        }
        return;
    }
#endif
    if (qtype == Q4_K) {
        float d = fp16_to_fp32(load_u16(b)), dmin = fp16_to_fp32(load_u16(b + 2));
        const uint8_t *scales = b + 4, *qs = b + 16;
        for (int j = 0; j < 8; j++) {
            int sc, m;
            q4k_scale_min(scales, j, &sc, &m);
            float ds = d * (float)sc, dm = dmin * (float)m;
            const uint8_t *q = qs + (j / 2) * 32;
            int shift = (j % 2) * 4;
            for (int i = 0; i < 32; i++) w[j * 32 + i] = ds * (float)((q[i] >> shift) & 0xF) - dm;
        }
    } else {  /* Q6_K: ql[128] qh[64] scales[16] d */
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *scales = (const int8_t *)(b + 192);
        float d = fp16_to_fp32(load_u16(b + 208));
        for (int c = 0; c < 8; c++) {  /* 32-weight chunks */
            int h = c / 4, r = c % 4;
            const uint8_t *l = ql + h * 64 + (r % 2) * 32, *hb = qh + h * 32;
            int lshift = (r / 2) * 4, hshift = 2 * r;
            for (int i = 0; i < 32; i++) {
                int e = c * 32 + i;
                int q = (((l[i] >> lshift) & 0xF) | (((hb[i] >> hshift) & 3) << 4)) - 32;
                w[e] = (d * (float)scales[e / 16]) * (float)q;
            }
        }
    }
}

/* Dequantize one 32-weight block into w[32] (scalar reference path). */
static inline void dequant_block(int qtype, const uint8_t *b, float *w) {
    float d = fp16_to_fp32(load_u16(b));
    if (qtype == Q8_0) {
        const int8_t *q = (const int8_t *)(b + 2);
        for (int i = 0; i < QK; i++) w[i] = d * (float)q[i];
    } else if (qtype == Q4_0) {
        const uint8_t *q = b + 2;
        for (int i = 0; i < 16; i++) {
            w[i] = d * (float)((int)(q[i] & 0xF) - 8);
            w[i + 16] = d * (float)((int)(q[i] >> 4) - 8);
        }
    } else {
        float m = fp16_to_fp32(load_u16(b + 2));
        const uint8_t *q = b + 4;
        for (int i = 0; i < 16; i++) {
            w[i] = d * (float)(q[i] & 0xF) + m;
            w[i + 16] = d * (float)(q[i] >> 4) + m;
        }
    }
}

/* float16 -> float32, exact (F16C where the build has it: one instruction, same value). */
static inline float half_at(const uint8_t *p) {
#if defined(__F16C__)
    return _cvtsh_ss(load_u16(p));
#else
    return fp16_to_fp32(load_u16(p));
#endif
}

#if defined(__AVX512F__)

/* One 32-weight block (Q4_0, Q4_1 or Q8_0) as two registers of float32 weights, bit-identical
 * to dequant_block, given its scale d (and Q4_1's m) already in float32. The 4-bit types build
 * the block's 16 possible weights once (d*j + m, or d*(j-8): the same rounded product and sum as
 * the scalar path) and look each nibble up with vpermps, which reads only an index's low 4 bits:
 * so the zero-extended bytes index the low nibbles as they are and, shifted right by 4, the
 * high ones. */
ALWAYS_INLINE void dequant32_dm(int qtype, const uint8_t *b, __m512 d, __m512 m, __m512 *w0, __m512 *w1) {
    if (qtype == Q8_0) {
        __m128i q0 = _mm_loadu_si128((const __m128i *)(b + 2));
        __m128i q1 = _mm_loadu_si128((const __m128i *)(b + 18));
        *w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)));
        *w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)));
        return;
    }
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 table;
    if (qtype == Q4_0)
        table = _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(8.0f)));
    else
        table = _mm512_add_ps(_mm512_mul_ps(d, iota), m);
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + (qtype == Q4_0 ? 2 : 4))));
    *w0 = _mm512_permutexvar_ps(q, table);
    *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
}

ALWAYS_INLINE void dequant32(int qtype, const uint8_t *b, __m512 *w0, __m512 *w1) {
    __m512 d = _mm512_set1_ps(half_at(b)), m = qtype == Q4_1 ? _mm512_set1_ps(half_at(b + 2)) : d;
    dequant32_dm(qtype, b, d, m, w0, w1);
}

/* float32 scales of up to n <= 16 consecutive blocks at `b`, in one gather of the 4 bytes that
 * open each block (d, then Q4_1's m or the first quants) and two conversions of 16 halves:
 * dm[2j] = d of block j, dm[2j+1] = m (meaningless for the other types). Lanes past n are
 * masked off, so nothing past the last block is read. */
ALWAYS_INLINE void block_scales16(const uint8_t *b, int bb, int64_t n, float *dm /* [32] */) {
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(bb));
    __mmask16 k = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
    __m512i h = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k, idx, b, 1);
    _mm512_storeu_ps(dm, _mm512_cvtph_ps(_mm512_castsi512_si256(h)));
    _mm512_storeu_ps(dm + 16, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)));
}

/* M = 1: R consecutive output columns (weight rows `stride` bytes apart) against one x, two
 * accumulators a row, so the x loads are shared and R*2 FMA chains hide the FMA latency. The
 * blocks go 16 at a time: their float16 scales first (one gather and conversion for 16), then
 * the FMAs. Each row prefetches 4 KB ahead (the next row groups: at batch 1 the weights stream
 * from memory, and the hardware prefetcher alone left the loop waiting on it ~40% of the time). */
ALWAYS_INLINE void gemv_rows_m1(int qtype, int R, const float *x, int64_t nblocks, const uint8_t *row,
                                int64_t stride, int bb, float *out /* [R] */) {
    __m512 a0[4], a1[4];
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < nblocks; k0 += 16) {
        int64_t kn = nblocks - k0 < 16 ? nblocks - k0 : 16;
        float dm[4][32];
        for (int r = 0; r < R; r++) block_scales16(row + r * stride + k0 * bb, bb, kn, dm[r]);
        for (int64_t j = 0; j < kn; j++) {
            int64_t k = k0 + j;
            __m512 x0 = _mm512_loadu_ps(x + k * QK), x1 = _mm512_loadu_ps(x + k * QK + 16);
            for (int r = 0; r < R; r++) {
                const uint8_t *b = row + r * stride + k * bb;
                _mm_prefetch((const char *)b + 4096, _MM_HINT_T0);
                __m512 w0, w1, d = _mm512_set1_ps(dm[r][2 * j]);
                dequant32_dm(qtype, b, d, qtype == Q4_1 ? _mm512_set1_ps(dm[r][2 * j + 1]) : d, &w0, &w1);
                a0[r] = _mm512_fmadd_ps(w0, x0, a0[r]);
                a1[r] = _mm512_fmadd_ps(w1, x1, a1[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
}

static void gemv4_m1(int qtype, const float *x, int64_t nblocks, const uint8_t *row, int64_t stride, int bb,
                     float *out) {
    switch (qtype) {  /* constant qtype: each case compiles to its own branch-free loop */
        case Q4_0: gemv_rows_m1(Q4_0, 4, x, nblocks, row, stride, bb, out); break;
        case Q4_1: gemv_rows_m1(Q4_1, 4, x, nblocks, row, stride, bb, out); break;
        default: gemv_rows_m1(Q8_0, 4, x, nblocks, row, stride, bb, out); break;
    }
}

static void gemv1_m1(int qtype, const float *x, int64_t nblocks, const uint8_t *row, int bb, float *out) {
    switch (qtype) {
        case Q4_0: gemv_rows_m1(Q4_0, 1, x, nblocks, row, 0, bb, out); break;
        case Q4_1: gemv_rows_m1(Q4_1, 1, x, nblocks, row, 0, bb, out); break;
        default: gemv_rows_m1(Q8_0, 1, x, nblocks, row, 0, bb, out); break;
    }
}
#elif PKV_AVX2
/* Sum of the 8 lanes. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* One 32-weight block (Q4_0, Q4_1 or Q8_0) as four registers of 8 float32 weights (elements
 * 8i..8i+7), bit-identical to dequant_block given its d (and Q4_1's m) in float32. Q4_1 takes
 * one FMA, d*q + m: d has 11 significant bits and q 4, so the product is exact in float32 and
 * the FMA's single rounding is the reference's rounding of the sum. Q4_0 d*(q-8), Q8_0 d*q
 * (both exact products). A 4-bit block's 16 bytes zero-extend to two registers of 8 lanes:
 * masked, they are the low nibbles (elements 0-15); shifted right by 4, the high ones. */
ALWAYS_INLINE void dequant32_avx2(int qtype, const uint8_t *b, __m256 d, __m256 m, __m256 *w) {
    if (qtype == Q8_0) {
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * i)))));
        return;
    }
    const uint8_t *q = b + (qtype == Q4_0 ? 2 : 4);
    const __m256i low = _mm256_set1_epi32(15);
    __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
    __m256i n[4] = {_mm256_and_si256(b0, low), _mm256_and_si256(b1, low), _mm256_srli_epi32(b0, 4),
                    _mm256_srli_epi32(b1, 4)};
    for (int i = 0; i < 4; i++) {
        if (qtype == Q4_0)
            w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(n[i], _mm256_set1_epi32(8))));
        else
            w[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(n[i]), m);
    }
}

/* dm[2j] = d, dm[2j+1] = m (Q4_1; else the first quants, unused) of the n <= 8 blocks at b,
 * bb bytes apart: eight 4-byte loads into one register (not through memory: eight narrow
 * stores read back as one wide load would stall store forwarding) and two float16
 * conversions, instead of two conversions and broadcasts per block in the FMA loop. */
static inline uint32_t load_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
ALWAYS_INLINE void block_scales8(const uint8_t *b, int bb, int64_t n, float *dm /* [16] */) {
    uint32_t h[8];
    for (int64_t j = 0; j < 8; j++) h[j] = j < n ? load_u32(b + j * bb) : 0u;
    __m256i v = _mm256_setr_epi32((int)h[0], (int)h[1], (int)h[2], (int)h[3], (int)h[4], (int)h[5], (int)h[6], (int)h[7]);
    _mm256_storeu_ps(dm, _mm256_cvtph_ps(_mm256_castsi256_si128(v)));
    _mm256_storeu_ps(dm + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(v, 1)));
}

/* M = 1: R (<= 2) consecutive output columns (weight rows `stride` bytes apart) against one x,
 * two accumulators a row. Two rows, not four: with four, the eight accumulators, a block's
 * four weight registers and its scales overflow the 16 registers (measured: no faster). The
 * blocks go 8 at a time: their scales first, then the FMAs. Each row prefetches the lines of
 * its next blocks 4 KB ahead, once a line (one prefetch per block cost ~30% in cache). */
ALWAYS_INLINE void gemv_rows_m1(int qtype, int R, const float *x, int64_t nblocks, const uint8_t *row,
                                int64_t stride, int bb, float *out /* [R] */) {
    __m256 a0[2], a1[2];
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < nblocks; k0 += 8) {
        int64_t kn = nblocks - k0 < 8 ? nblocks - k0 : 8;
        float dm[2][16];
        for (int r = 0; r < R; r++) {
            const uint8_t *b = row + r * stride + k0 * bb;
            block_scales8(b, bb, kn, dm[r]);
            for (int64_t l = 0; l < kn * bb; l += 64) _mm_prefetch((const char *)b + 4096 + l, _MM_HINT_T0);
        }
        for (int64_t j = 0; j < kn; j++) {
            const float *xk = x + (k0 + j) * QK;
            for (int r = 0; r < R; r++) {
                const uint8_t *b = row + r * stride + (k0 + j) * bb;
                __m256 d = _mm256_broadcast_ss(&dm[r][2 * j]), w[4];
                dequant32_avx2(qtype, b, d, qtype == Q4_1 ? _mm256_broadcast_ss(&dm[r][2 * j + 1]) : d, w);
                a0[r] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xk), a0[r]);
                a1[r] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xk + 8), a1[r]);
                a0[r] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xk + 16), a0[r]);
                a1[r] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xk + 24), a1[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(_mm256_add_ps(a0[r], a1[r]));
}

static void gemv4_m1(int qtype, const float *x, int64_t nblocks, const uint8_t *row, int64_t stride, int bb,
                     float *out) {
    for (int h = 0; h < 4; h += 2) {
        const uint8_t *rh = row + h * stride;
        switch (qtype) {
            case Q4_0: gemv_rows_m1(Q4_0, 2, x, nblocks, rh, stride, bb, out + h); break;
            case Q4_1: gemv_rows_m1(Q4_1, 2, x, nblocks, rh, stride, bb, out + h); break;
            default: gemv_rows_m1(Q8_0, 2, x, nblocks, rh, stride, bb, out + h); break;
        }
    }
}

static void gemv1_m1(int qtype, const float *x, int64_t nblocks, const uint8_t *row, int bb, float *out) {
    switch (qtype) {
        case Q4_0: gemv_rows_m1(Q4_0, 1, x, nblocks, row, 0, bb, out); break;
        case Q4_1: gemv_rows_m1(Q4_1, 1, x, nblocks, row, 0, bb, out); break;
        default: gemv_rows_m1(Q8_0, 1, x, nblocks, row, 0, bb, out); break;
    }
}

/* dot_rows_avx2 for R (constant once inlined: the accumulators then stay in registers) rows. */
ALWAYS_INLINE void dot_rows_r(const int R, const float *w, int64_t n, const float *x, int64_t ldx, __m256 *acc) {
    __m256 a[4][2];
    for (int r = 0; r < R; r++) a[r][0] = acc[2 * r], a[r][1] = acc[2 * r + 1];
    for (int64_t c = 0; c < n; c += 16) {
        __m256 w0 = _mm256_loadu_ps(w + c), w1 = _mm256_loadu_ps(w + c + 8);
        for (int r = 0; r < R; r++) {
            const float *xr = x + r * ldx + c;
            a[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), a[r][0]);
            a[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), a[r][1]);
        }
    }
    for (int r = 0; r < R; r++) acc[2 * r] = a[r][0], acc[2 * r + 1] = a[r][1];
}

/* acc[2i], acc[2i+1] += w[0:n) * x_i[0:n) for m_rows rows x_i (ldx floats apart), n a multiple
 * of 16: w is dequantized weights in L1, loaded once per four rows; two chains a row. */
static void dot_rows_avx2(const float *w, int64_t n, const float *x, int64_t m_rows, int64_t ldx, __m256 *acc) {
    int64_t m0 = 0;
    for (; m0 + 4 <= m_rows; m0 += 4) dot_rows_r(4, w, n, x + m0 * ldx, ldx, acc + 2 * m0);
    switch (m_rows - m0) {
        case 3: dot_rows_r(3, w, n, x + m0 * ldx, ldx, acc + 2 * m0); break;
        case 2: dot_rows_r(2, w, n, x + m0 * ldx, ldx, acc + 2 * m0); break;
        case 1: dot_rows_r(1, w, n, x + m0 * ldx, ldx, acc + 2 * m0); break;
        default: break;
    }
}
#endif

#if defined(__AVX512F__)
/* gemv_row's loop for one (constant, once inlined) qtype. */
ALWAYS_INLINE void gemv_row_q(int qtype, const float *x, int64_t m_rows, int64_t ldx, int64_t nblocks,
                              const uint8_t *row, int bb, float *out) {
    __m512 acc[MAX_M];
    for (int i = 0; i < m_rows; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < nblocks; k++) {
        __m512 w0, w1;
        dequant32(qtype, row + k * bb, &w0, &w1);
        const float *xk = x + k * QK;
        for (int i = 0; i < m_rows; i++) {
            acc[i] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xk + i * ldx), acc[i]);
            acc[i] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xk + i * ldx + 16), acc[i]);
        }
    }
    for (int i = 0; i < m_rows; i++) out[i] = _mm512_reduce_add_ps(acc[i]);
}
#endif

/* One output column n of y = x @ W^T for up to MAX_M rows of x. */
static void gemv_row(int qtype, const float *x, int64_t m_rows, int64_t ldx, int64_t nblocks,
                     const uint8_t *row, int bb, float *out /* [m_rows] */) {
#if defined(__AVX512F__)
    switch (qtype) {  /* one loop per type: no type tests inside it */
        case Q4_0: gemv_row_q(Q4_0, x, m_rows, ldx, nblocks, row, bb, out); break;
        case Q4_1: gemv_row_q(Q4_1, x, m_rows, ldx, nblocks, row, bb, out); break;
        default: gemv_row_q(Q8_0, x, m_rows, ldx, nblocks, row, bb, out); break;
    }
#else
    float acc[MAX_M][QK], w[QK];
    memset(acc, 0, sizeof(acc));
    for (int64_t k = 0; k < nblocks; k++) {
        dequant_block(qtype, row + k * bb, w);
        for (int i = 0; i < m_rows; i++)
            for (int j = 0; j < QK; j++) acc[i][j] += w[j] * x[i * ldx + k * QK + j];
    }
    for (int i = 0; i < m_rows; i++) {
        float s = 0.0f;
        for (int j = 0; j < QK; j++) s += acc[i][j];
        out[i] = s;
    }
#endif
}

/* K-quant rows: each super-block is dequantized into a 256-float buffer (L1), then FMA'd. */
static void gemv_row_k(int qtype, const float *x, int64_t m_rows, int64_t ldx, int64_t nblocks,
                       const uint8_t *row, int bb, float *out) {
    float w[QK_K];
#if defined(__AVX512F__)
    if (m_rows == 1 && qtype == Q4_K) {
        /* Q4_K at batch 1 in registers: per 32-weight sub-block the 16 possible weights
         * (d*sc)*j - dmin*m (gguf.quants' rounded product, then the difference) are built once
         * and the nibbles looked up with vpermps, as for Q4_1; four FMA chains. */
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512 a[4];
        for (int i = 0; i < 4; i++) a[i] = _mm512_setzero_ps();
        for (int64_t k = 0; k < nblocks; k++) {
            const uint8_t *b = row + k * bb;
            _mm_prefetch((const char *)b + 1024, _MM_HINT_T0);
            _mm_prefetch((const char *)b + 1024 + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)b + 1024 + 128, _MM_HINT_T0);
            float d = half_at(b), dmin = half_at(b + 2);
            const float *xk = x + k * QK_K;
            for (int c = 0; c < 4; c++) {  /* 32 quant bytes: sub-block 2c low nibbles, 2c+1 high */
                __m512i ia = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 16 + 32 * c)));
                __m512i ib = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 32 + 32 * c)));
                for (int h = 0; h < 2; h++) {
                    int j = 2 * c + h, sc, m;
                    q4k_scale_min(b + 4, j, &sc, &m);
                    __m512 table = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(d * (float)sc), iota),
                                                 _mm512_set1_ps(dmin * (float)m));
                    __m512i i0 = h ? _mm512_srli_epi32(ia, 4) : ia, i1 = h ? _mm512_srli_epi32(ib, 4) : ib;
                    a[2 * h] = _mm512_fmadd_ps(_mm512_permutexvar_ps(i0, table), _mm512_loadu_ps(xk + 32 * j),
                                               a[2 * h]);
                    a[2 * h + 1] = _mm512_fmadd_ps(_mm512_permutexvar_ps(i1, table), _mm512_loadu_ps(xk + 32 * j + 16),
                                                   a[2 * h + 1]);
                }
            }
        }
        for (int i = 1; i < 4; i++) a[0] = _mm512_add_ps(a[0], a[i]);
        out[0] = _mm512_reduce_add_ps(a[0]);
        return;
    }
    if (m_rows == 1) {  /* four accumulators: one chain would wait on the FMA latency */
        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t k = 0; k < nblocks; k++) {
            _mm_prefetch((const char *)row + (k + 1) * bb, _MM_HINT_T0);
            _mm_prefetch((const char *)row + (k + 1) * bb + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)row + (k + 1) * bb + 128, _MM_HINT_T0);
            dequant_superblock(qtype, row + k * bb, w);
            for (int v = 0; v < QK_K; v += 16) {
                __m512 *acc = &a[(v / 16) % 4];
                *acc = _mm512_fmadd_ps(_mm512_loadu_ps(w + v), _mm512_loadu_ps(x + k * QK_K + v), *acc);
            }
        }
        out[0] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
        return;
    }
    __m512 acc[MAX_M];
    for (int i = 0; i < m_rows; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < nblocks; k++) {
        dequant_superblock(qtype, row + k * bb, w);
        const float *xk = x + k * QK_K;
        for (int v = 0; v < QK_K; v += 16) {
            __m512 wv = _mm512_loadu_ps(w + v);
            for (int i = 0; i < m_rows; i++) acc[i] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xk + i * ldx + v), acc[i]);
        }
    }
    for (int i = 0; i < m_rows; i++) out[i] = _mm512_reduce_add_ps(acc[i]);
#elif PKV_AVX2
    __m256 acc[2 * MAX_M];
    for (int64_t i = 0; i < 2 * m_rows; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < nblocks; k++) {
        if (m_rows == 1)  /* one pass: the next super-block streams in while this one computes */
            for (int l = 0; l < bb; l += 64) _mm_prefetch((const char *)row + (k + 1) * bb + l, _MM_HINT_T0);
        dequant_superblock(qtype, row + k * bb, w);
        dot_rows_avx2(w, QK_K, x + k * QK_K, m_rows, ldx, acc);
    }
    for (int64_t i = 0; i < m_rows; i++) out[i] = hsum8(_mm256_add_ps(acc[2 * i], acc[2 * i + 1]));
#else
    float acc[MAX_M][16];
    memset(acc, 0, sizeof(acc));
    for (int64_t k = 0; k < nblocks; k++) {
        dequant_superblock(qtype, row + k * bb, w);
        for (int i = 0; i < m_rows; i++)
            for (int j = 0; j < QK_K; j++) acc[i][j % 16] += w[j] * x[i * ldx + k * QK_K + j];
    }
    for (int i = 0; i < m_rows; i++) {
        float s = 0.0f;
        for (int j = 0; j < 16; j++) s += acc[i][j];
        out[i] = s;
    }
#endif
}

#if PKV_AVX2
enum { GEMV_COLS = 2 };  /* output columns a many-row pass computes (see gemv_cols2) */

/* gemv_cols2's FMAs for R rows of x and NC columns (constants once inlined, so the R*NC
 * accumulators stay in registers): acc[r][c] += w[c][0:n) * x_r[0:n). */
ALWAYS_INLINE void dot_cols_r(const int R, const int NC, float (*w)[8 * QK], int64_t n, const float *x, int64_t ldx,
                              __m256 (*acc)[2]) {
    __m256 a[4][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) a[r][c] = acc[r][c];
    for (int64_t k = 0; k < n; k += 8) {
        __m256 w0 = _mm256_loadu_ps(w[0] + k), w1 = NC == 2 ? _mm256_loadu_ps(w[1] + k) : w0;
        for (int r = 0; r < R; r++) {
            __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
            a[r][0] = _mm256_fmadd_ps(w0, xv, a[r][0]);
            if (NC == 2) a[r][1] = _mm256_fmadd_ps(w1, xv, a[r][1]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = a[r][c];
}

/* out[i*2 + c] = x_i . row_c for nc (1 or 2) weight rows `stride` bytes apart and m_rows
 * (2..MAX_M) rows of x: both rows' weights are dequantized a chunk at a time (8 blocks, or one
 * K-quant super-block) into L1 once for all rows of x, then every load of x feeds both
 * columns (four rows of x a pass: 8 FMA chains in registers; one column a pass would load x
 * once per FMA and run at half the speed). */
static void gemv_cols2(int qtype, const float *x, int64_t m_rows, int64_t ldx, int64_t nblocks, const uint8_t *row,
                       int64_t stride, int bb, int nc, float *out) {
    const int kq = qtype == Q4_K || qtype == Q6_K;
    const int64_t per = kq ? 1 : 8, wpb = kq ? QK_K : QK;  /* blocks a chunk, weights a block */
    float w[2][8 * QK];
    __m256 acc[MAX_M][2];
    for (int64_t i = 0; i < m_rows; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < nblocks; k0 += per) {
        int64_t kn = nblocks - k0 < per ? nblocks - k0 : per;
        for (int c = 0; c < nc; c++) {
            const uint8_t *b = row + c * stride + k0 * bb;
            if (kq) {
                dequant_superblock(qtype, b, w[c]);
                continue;
            }
            for (int64_t j = 0; j < kn; j++) {
                const uint8_t *bj = b + j * bb;
                __m256 d = _mm256_set1_ps(half_at(bj)), m = qtype == Q4_1 ? _mm256_set1_ps(half_at(bj + 2)) : d, v[4];
                dequant32_avx2(qtype, bj, d, m, v);
                for (int i = 0; i < 4; i++) _mm256_storeu_ps(w[c] + j * QK + 8 * i, v[i]);
            }
        }
        const float *xk = x + k0 * wpb;
        const int64_t nw = kn * wpb;
        for (int64_t m0 = 0; m0 < m_rows; m0 += 4) {
            const float *xm = xk + m0 * ldx;
            switch ((m_rows - m0 >= 4 ? 4 : (int)(m_rows - m0)) * 2 + (nc == 2)) {
                case 9: dot_cols_r(4, 2, w, nw, xm, ldx, acc + m0); break;
                case 8: dot_cols_r(4, 1, w, nw, xm, ldx, acc + m0); break;
                case 7: dot_cols_r(3, 2, w, nw, xm, ldx, acc + m0); break;
                case 6: dot_cols_r(3, 1, w, nw, xm, ldx, acc + m0); break;
                case 5: dot_cols_r(2, 2, w, nw, xm, ldx, acc + m0); break;
                case 4: dot_cols_r(2, 1, w, nw, xm, ldx, acc + m0); break;
                case 3: dot_cols_r(1, 2, w, nw, xm, ldx, acc + m0); break;
                default: dot_cols_r(1, 1, w, nw, xm, ldx, acc + m0); break;
            }
        }
    }
    for (int64_t i = 0; i < m_rows; i++)
        for (int c = 0; c < nc; c++) out[i * 2 + c] = hsum8(acc[i][c]);
}
#else
enum { GEMV_COLS = 1 };
#endif

/* out[i*GEMV_COLS + c] = x_i . row_c for nc (<= GEMV_COLS) weight rows `stride` bytes apart and
 * m_rows (<= MAX_M) rows of x (ldx floats apart). */
static void gemv_block(int qtype, const float *x, int64_t m_rows, int64_t ldx, int64_t nblocks, const uint8_t *row,
                       int64_t stride, int bb, int nc, float *out) {
#if PKV_AVX2
    if (m_rows > 1) {
        gemv_cols2(qtype, x, m_rows, ldx, nblocks, row, stride, bb, nc, out);
        return;
    }
#endif
    float col[MAX_M];
    for (int c = 0; c < nc; c++) {
        if (pkv_block_weights(qtype) == QK_K)
            gemv_row_k(qtype, x, m_rows, ldx, nblocks, row + c * stride, bb, col);
        else
            gemv_row(qtype, x, m_rows, ldx, nblocks, row + c * stride, bb, col);
        for (int64_t i = 0; i < m_rows; i++) out[i * GEMV_COLS + c] = col[i];
    }
}

/* y[m, n] (at y + m*ldy + n) = x[M, K] @ W^T (+ bias[N]), W given as N rows of ggml blocks of
 * `qtype`, `row_stride` bytes apart; x is row-major and contiguous. `ldy` lets a fused layer
 * whose row ranges come in different types write each range into its columns of one output.
 * Returns 0, or -1 for an unsupported type or a K that is not a multiple of the block. */
int pkv_gemv_q(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
               int64_t row_stride, const float *bias, float *y, int64_t ldy) {
    int bb = pkv_block_bytes(qtype), bw = pkv_block_weights(qtype);
    if (bb == 0 || K % bw) return -1;
    int64_t nblocks = K / bw;
#if defined(__AVX512F__) || PKV_AVX2
    if (M == 1 && bw == QK) {
        /* Batch 1: four weight rows per step; static scheduling gives each thread one contiguous
         * range of row groups (one forward stream through the weights). */
        int64_t groups = N / 4;
#pragma omp parallel for schedule(static)
        for (int64_t g = 0; g <= groups; g++) {
            float out[4];
            int64_t n0 = g * 4, nr = g < groups ? 4 : N - n0;
            if (nr == 4)
                gemv4_m1(qtype, x, nblocks, w + n0 * row_stride, row_stride, bb, out);
            else
                for (int64_t r = 0; r < nr; r++) gemv1_m1(qtype, x, nblocks, w + (n0 + r) * row_stride, bb, out + r);
            for (int64_t r = 0; r < nr; r++) y[n0 + r] = out[r] + (bias ? bias[n0 + r] : 0.0f);
        }
        return 0;
    }
#endif
    int64_t groups = (N + GEMV_COLS - 1) / GEMV_COLS;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        int64_t n0 = g * GEMV_COLS;
        int nc = N - n0 < GEMV_COLS ? (int)(N - n0) : GEMV_COLS;
        float out[MAX_M * GEMV_COLS];
        for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
            int64_t mr = M - m0 < MAX_M ? M - m0 : MAX_M;
            gemv_block(qtype, x + m0 * K, mr, K, nblocks, w + n0 * row_stride, row_stride, bb, nc, out);
            for (int64_t i = 0; i < mr; i++)
                for (int c = 0; c < nc; c++)
                    y[(m0 + i) * ldy + n0 + c] = out[i * GEMV_COLS + c] + (bias ? bias[n0 + c] : 0.0f);
        }
    }
    return 0;
}

/* Dequantize rows into float32 (same values as the kernel uses): w [N rows] -> out [N, K]. */
int pkv_dequant(int qtype, const uint8_t *w, int64_t N, int64_t K, int64_t row_stride, float *out) {
    int bb = pkv_block_bytes(qtype), bw = pkv_block_weights(qtype);
    if (bb == 0 || K % bw) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K / bw; k++) {
            const uint8_t *b = w + n * row_stride + k * bb;
            if (bw == QK_K)
                dequant_superblock(qtype, b, out + n * K + k * bw);
            else
                dequant_block(qtype, b, out + n * K + k * bw);
        }
    return 0;
}

/* ------------------------------------------------------------------ greedy sampling */

/* Index of the first largest of x[0:n), NaN counting as the largest (torch.argmax's rule: the
 * first NaN wins). Two passes over data in cache: the maximum (and whether a NaN is there),
 * then the first position equal to it. torch's argmax took ~125 us on a 49,152-logit row of an
 * AVX2 EPYC, this ~10 us: the batch-1 greedy sampler's whole cost. */
static int64_t argmax_row(const float *x, int64_t n) {
    int64_t i = 0;
    float m = -INFINITY;
    int nan = 0;
#if defined(__AVX2__)
    __m256 vm = _mm256_set1_ps(-INFINITY), vn = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        vn = _mm256_or_ps(vn, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vm = _mm256_max_ps(vm, v);
    }
    nan = _mm256_movemask_ps(vn) != 0;
    float lanes8[8];
    _mm256_storeu_ps(lanes8, vm);
    for (int l = 0; l < 8; l++) m = lanes8[l] > m ? lanes8[l] : m;
#endif
    for (; i < n; i++) {
        nan |= x[i] != x[i];
        m = x[i] > m ? x[i] : m;
    }
    if (nan) {
        for (i = 0; i < n; i++)
            if (x[i] != x[i]) return i;
    }
    i = 0;
#if defined(__AVX2__)
    const __m256 vmax = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) {
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vmax, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
#endif
    for (; i < n; i++)
        if (x[i] == m) return i;
    return 0;  /* n == 0, or every value -inf below m's start: unreachable for n > 0 */
}

/* out[r] = argmax of row r (M rows of N float32s, ld apart). */
void pkv_argmax_rows(const float *x, int64_t M, int64_t N, int64_t ld, int64_t *out) {
    for (int64_t r = 0; r < M; r++) out[r] = argmax_row(x + r * ld, N);
}

/* ------------------------------------------------------------------ paged decode attention */

/* The attention kernel reads K/V stored as float32, bfloat16 or float16 (converted exactly to
 * float32 in registers); 16-bit masked loads need AVX-512 BW/VL besides F. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PKV_ATTN_AVX512 1
#else
#define PKV_ATTN_AVX512 0
#endif
enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };

static inline float kv_scalar(const char *p, int64_t i, int kvt) {
    if (kvt == KV_F32) { float f; memcpy(&f, p + 4 * i, 4); return f; }
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    if (kvt == KV_F16) return fp16_to_fp32(h);
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}


#if PKV_ATTN_AVX512
/* exp on 16 lanes: n = round(x/ln2), r = x - n*ln2 (two-part ln2), degree-6 polynomial.
 * Max relative error ~2 ulp over the range softmax uses (x <= 0); x < -87 gives 0. */
static inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512 e = _mm512_scalef_ps(p, n);
    return _mm512_mask_mov_ps(e, tiny, _mm512_setzero_ps());
}

/* Mask of the first n (clamped to 0..16) lanes. */
static inline __mmask16 lanes(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
}

static inline __m512 kv_load16(const char *p, int kvt) {
    if (kvt == KV_F32) return _mm512_loadu_ps((const float *)p);
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (kvt == KV_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 kv_maskz_load16(__mmask16 m, const char *p, int kvt) {
    if (kvt == KV_F32) return _mm512_maskz_loadu_ps(m, (const float *)p);
    __m256i h = _mm256_maskz_loadu_epi16(m, p);
    if (kvt == KV_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline void exp_inplace(float *s, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(s + i, exp16(_mm512_loadu_ps(s + i)));
    if (i < n) {
        __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(s + i, k, exp16(_mm512_maskz_loadu_ps(k, s + i)));
    }
}
#elif PKV_AVX2
/* exp16's method on 8 lanes: the same reduction and polynomial; 2^n is built in the exponent
 * bits (x is clamped to [-87, 88], where n stays a normal exponent; x < -87 gives 0, x > 88
 * gives +inf, as expf would just above 88.72). */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f), hi = _mm256_set1_ps(88.0f);
    __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ), big = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 v = _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
    return _mm256_blendv_ps(v, _mm256_set1_ps(INFINITY), big);
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* 8 K/V elements at p as float32 (bfloat16: the bits shifted up; float16: F16C, exact). */
static inline __m256 kv_load8(const char *p, int kvt) {
    if (kvt == KV_F32) return _mm256_loadu_ps((const float *)p);
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (kvt == KV_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#else
static inline void exp_inplace(float *s, int64_t n) {
    for (int64_t i = 0; i < n; i++) s[i] = expf(s[i]);
}
#endif

enum { TILE = 64, MAX_ACC = 16384 };  /* keys per tile; floats of per-item accumulators */

typedef struct {
    const float *q;
    const char *k, *v;  /* K/V of kvt, esz bytes an element; strides below count elements */
    int64_t q_stride, Hq, Hkv, G, D, Dv, kb, kt, kh, vb, vt, vh, block_size, bt_stride, window;
    const int32_t *block_table, *seq_lens;
    float scale, *out, *lse;
    int64_t out_stride;
    int kvt, esz;
    /* Quantized caches only (esz = 1: strides count bytes). kmul/vmul: constant factors of
     * every K/V value (per-tensor scales, x256 for e4m3 codes read as fp16); kgroup/vgroup:
     * values per int4 scale group; kvals/vvals: bytes of a part's values (its inline scales
     * follow); kpart/vpart: bytes of a whole part. */
    float kmul, vmul;
    int64_t kgroup, vgroup, kvals, vvals, kpart, vpart;
    int s16; /* per-token-head scales stored as fp16 (the *_per_token_head_f16 formats) */
} decode_args;

#if PKV_ATTN_AVX512
/* acc[0:n) += sum_j p[j] * x_j[0:n) over a tile, accumulating in registers 16 lanes at a time. */
static inline void accumulate_tile(float *acc, const float *p, const char *const *xs, int64_t off,
                                   int64_t ntok, int64_t n, int kvt, int esz) {
    int64_t c = 0;
    for (; c + 32 <= n; c += 32) {
        __m512 a0 = _mm512_loadu_ps(acc + c), a1 = _mm512_loadu_ps(acc + c + 16);
        for (int64_t j = 0; j < ntok; j++) {
            __m512 pj = _mm512_set1_ps(p[j]);
            a0 = _mm512_fmadd_ps(pj, kv_load16(xs[j] + off + c * esz, kvt), a0);
            a1 = _mm512_fmadd_ps(pj, kv_load16(xs[j] + off + (c + 16) * esz, kvt), a1);
        }
        _mm512_storeu_ps(acc + c, a0);
        _mm512_storeu_ps(acc + c + 16, a1);
    }
    for (; c < n; c += 16) {
        __mmask16 m = n - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - c)) - 1);
        __m512 a = _mm512_maskz_loadu_ps(m, acc + c);
        for (int64_t j = 0; j < ntok; j++)
            a = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), kv_maskz_load16(m, xs[j] + off + c * esz, kvt), a);
        _mm512_mask_storeu_ps(acc + c, m, a);
    }
}
/* r[j] = sum of the 16 lanes of v[j] (a transposing reduction tree: 45 shuffles/adds for 16
 * sums, against ~8 instructions per sum for _mm512_reduce_add_ps one by one). */
static inline __m512 hsum16(const __m512 *v) {
    __m512 w[8], x[4];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
    __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}

/* out[0:16) = q . k_j for the 16 keys at ks[j] + off bytes (D elements each). */
static inline void scores16(const float *q, const char *const *ks, int64_t off, int64_t D, int kvt, int esz,
                            float *out) {
    __m512 t[16];
    for (int j = 0; j < 16; j++) t[j] = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        __m512 qd = _mm512_loadu_ps(q + d);
        for (int j = 0; j < 16; j++) t[j] = _mm512_fmadd_ps(qd, kv_load16(ks[j] + off + d * esz, kvt), t[j]);
    }
    if (d < D) {
        __mmask16 m = (__mmask16)((1u << (D - d)) - 1);
        __m512 qd = _mm512_maskz_loadu_ps(m, q + d);
        for (int j = 0; j < 16; j++) t[j] = _mm512_fmadd_ps(qd, kv_maskz_load16(m, ks[j] + off + d * esz, kvt), t[j]);
    }
    _mm512_storeu_ps(out, hsum16(t));
}
#elif PKV_AVX2
/* acc[0:n) += sum_j p[j] * x_j[0:n): 64 columns a pass in 8 accumulators (8 FMA chains), then
 * 8 at a time, then the scalar tail of an n that is not a multiple of 8. */
static inline void accumulate_tile(float *acc, const float *p, const char *const *xs, int64_t off,
                                   int64_t ntok, int64_t n, int kvt, int esz) {
    int64_t c = 0;
    for (; c + 64 <= n; c += 64) {
        __m256 a[8];
        for (int i = 0; i < 8; i++) a[i] = _mm256_loadu_ps(acc + c + 8 * i);
        for (int64_t j = 0; j < ntok; j++) {
            __m256 pj = _mm256_set1_ps(p[j]);
            for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(pj, kv_load8(xs[j] + off + (c + 8 * i) * esz, kvt), a[i]);
        }
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(acc + c + 8 * i, a[i]);
    }
    for (; c + 8 <= n; c += 8) {
        __m256 a = _mm256_loadu_ps(acc + c);
        for (int64_t j = 0; j < ntok; j++) a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), kv_load8(xs[j] + off + c * esz, kvt), a);
        _mm256_storeu_ps(acc + c, a);
    }
    for (; c < n; c++)
        for (int64_t j = 0; j < ntok; j++) acc[c] += p[j] * kv_scalar(xs[j] + off, c, kvt);
}

/* r[j] = sum of the 8 lanes of v[j] (a transposing reduction: 6 horizontal adds, 2 lane swaps). */
static inline __m256 hsum8x8(const __m256 *v) {
    __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
    __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
    __m256 a = _mm256_hadd_ps(s01, s23), b = _mm256_hadd_ps(s45, s67);  /* per half: 4 sums each */
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* out[0:16) = q . k_j for the 16 keys at ks[j] + off bytes (D elements each): 8 keys a pass, so
 * their 8 accumulators and q fit the 16 registers. */
static inline void scores16(const float *q, const char *const *ks, int64_t off, int64_t D, int kvt, int esz,
                            float *out) {
    for (int h = 0; h < 16; h += 8) {
        const char *const *kk = ks + h;
        __m256 t[8];
        for (int j = 0; j < 8; j++) t[j] = _mm256_setzero_ps();
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) {
            __m256 qd = _mm256_loadu_ps(q + d);
            for (int j = 0; j < 8; j++) t[j] = _mm256_fmadd_ps(qd, kv_load8(kk[j] + off + d * esz, kvt), t[j]);
        }
        _mm256_storeu_ps(out + h, hsum8x8(t));
        for (; d < D; d++)
            for (int j = 0; j < 8; j++) out[h + j] += q[d] * kv_scalar(kk[j] + off, d, kvt);
    }
}
#else
static inline void scores16(const float *q, const char *const *ks, int64_t off, int64_t D, int kvt, int esz,
                            float *out) {
    (void)esz;
    for (int j = 0; j < 16; j++) {
        float s = 0.0f;
        for (int64_t d = 0; d < D; d++) s += q[d] * kv_scalar(ks[j] + off, d, kvt);
        out[j] = s;
    }
}

static inline void accumulate_tile(float *acc, const float *p, const char *const *xs, int64_t off,
                                   int64_t ntok, int64_t n, int kvt, int esz) {
    (void)esz;
    for (int64_t j = 0; j < ntok; j++)
        for (int64_t c = 0; c < n; c++) acc[c] += p[j] * kv_scalar(xs[j] + off, c, kvt);
}
#endif

/* Online-softmax step over one tile: logits s[i][0:n) of query heads i < nq become their
 * probabilities relative to the new running max; running sums and accumulators are rescaled. */
static void softmax_tile(float (*s)[TILE], int64_t nq, int64_t n, float *mx, float *sum, float *acc, int64_t Dv) {
    for (int64_t i = 0; i < nq; i++) {
#if PKV_ATTN_AVX512
        /* Vector max and sum: 16 lanes wide instead of one serial chain of n adds. */
        __m512 vm = _mm512_set1_ps(mx[i]), vs = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j += 16) {
            __mmask16 m = lanes(n - j);
            vm = _mm512_mask_max_ps(vm, m, vm, _mm512_maskz_loadu_ps(m, s[i] + j));
        }
        float m_new = _mm512_reduce_max_ps(vm);
        __m512 mn = _mm512_set1_ps(m_new);
        for (int64_t j = 0; j < n; j += 16) {
            __mmask16 m = lanes(n - j);
            __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s[i] + j), mn));
            _mm512_mask_storeu_ps(s[i] + j, m, e);
            vs = _mm512_mask_add_ps(vs, m, vs, e);
        }
        float ps = _mm512_reduce_add_ps(vs);
#elif PKV_AVX2
        __m256 vm = _mm256_set1_ps(mx[i]), vs = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s[i] + j));
        float m_new = hmax8(vm);
        for (int64_t t = j; t < n; t++) m_new = s[i][t] > m_new ? s[i][t] : m_new;
        __m256 mn = _mm256_set1_ps(m_new);
        for (j = 0; j + 8 <= n; j += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s[i] + j), mn));
            _mm256_storeu_ps(s[i] + j, e);
            vs = _mm256_add_ps(vs, e);
        }
        float ps = hsum8(vs);
        for (; j < n; j++) ps += s[i][j] = expf(s[i][j] - m_new);
#else
        float m_new = mx[i];
        for (int64_t j = 0; j < n; j++) m_new = s[i][j] > m_new ? s[i][j] : m_new;
        for (int64_t j = 0; j < n; j++) s[i][j] -= m_new;
        exp_inplace(s[i], n);
        float ps = 0.0f;
        for (int64_t j = 0; j < n; j++) ps += s[i][j];
#endif
        float corr = expf(mx[i] - m_new);  /* 0 on the first tile (mx = -inf) */
        sum[i] = sum[i] * corr + ps;
        mx[i] = m_new;
        if (corr != 1.0f)
            for (int64_t c = 0; c < Dv; c++) acc[i * Dv + c] *= corr;
    }
}

/* KV heads [h0, h1) of row r: every tile of keys is read once for all of them (a token's heads
 * share cache lines in the usual layouts), then one online-softmax update per query head.
 * kvt is a constant once inlined (decode_item below): the loads in the dot products then carry
 * no test of the cache type (measured on AVX2: a runtime kvt kept those loops ~2x slower). */
ALWAYS_INLINE void decode_item_t(const int kvt, const decode_args *a, int64_t r, int64_t h0, int64_t h1) {
    float acc[MAX_ACC], s[256][TILE], mx[256], sum[256];
    const char *kp[TILE], *vp[TILE];
    const int64_t esz = kvt == KV_F32 ? 4 : 2;
    int64_t nq = (h1 - h0) * a->G, Dv = a->Dv, D = a->D, bs = a->block_size;
    int64_t len = a->seq_lens[r], first = (a->window > 0 && len > a->window) ? len - a->window : 0;
    const int32_t *table = a->block_table + r * a->bt_stride;
    const float *qr = a->q + r * a->q_stride + h0 * a->G * D;
    for (int64_t i = 0; i < nq; i++) {
        mx[i] = -INFINITY;
        sum[i] = 0.0f;
    }
    memset(acc, 0, nq * Dv * sizeof(float));
    for (int64_t t0 = first; t0 < len; t0 += TILE) {
        int64_t n = len - t0 < TILE ? len - t0 : TILE;
        for (int64_t j = 0, bi = t0 / bs, tok = t0 % bs; j < n; j++) {
            const int64_t blk = table[bi];
            kp[j] = a->k + (blk * a->kb + tok * a->kt) * esz;
            vp[j] = a->v + (blk * a->vb + tok * a->vt) * esz;
            if (++tok == bs) { tok = 0; bi++; }
        }
        for (int64_t j = n; j < TILE; j++) kp[j] = kp[0];  /* padding keys: computed, never used */
        /* Prefetch the next tile's K/V while this one computes: a tile's rows sit in blocks
         * scattered over the cache, which the hardware prefetcher cannot anticipate. */
        int64_t n2 = len - (t0 + TILE) < TILE ? len - (t0 + TILE) : TILE;
        for (int64_t j = 0; j < n2; j++) {
            int64_t pos = t0 + TILE + j, blk = table[pos / bs], tok = pos % bs;
            const char *kn = a->k + (blk * a->kb + tok * a->kt) * esz;
            const char *vn = a->v + (blk * a->vb + tok * a->vt) * esz;
            for (int64_t hk = h0; hk < h1; hk++) {
                for (int64_t b = 0; b < D * esz; b += 64) __builtin_prefetch(kn + hk * a->kh * esz + b);
                for (int64_t b = 0; b < Dv * esz; b += 64) __builtin_prefetch(vn + hk * a->vh * esz + b);
            }
        }
        for (int64_t hk = h0; hk < h1; hk++)
            for (int64_t g = 0; g < a->G; g++) {
                int64_t i = (hk - h0) * a->G + g;
                for (int64_t j = 0; j < n; j += 16) scores16(qr + i * D, kp + j, hk * a->kh * esz, D, kvt, (int)esz, s[i] + j);
                for (int64_t j = 0; j < n; j++) s[i][j] *= a->scale;
            }
        softmax_tile(s, nq, n, mx, sum, acc, Dv);
        for (int64_t hk = h0; hk < h1; hk++)
            for (int64_t g = 0; g < a->G; g++) {
                int64_t i = (hk - h0) * a->G + g;
                accumulate_tile(acc + i * Dv, s[i], vp, hk * a->vh * esz, n, Dv, kvt, (int)esz);
            }
    }
    for (int64_t i = 0; i < nq; i++) {
        int64_t h = h0 * a->G + i;
        float *o = a->out + r * a->out_stride + h * Dv, inv = 1.0f / sum[i];
        for (int64_t c = 0; c < Dv; c++) o[c] = acc[i * Dv + c] * inv;
        if (a->lse) a->lse[r * a->Hq + h] = mx[i] + logf(sum[i]);
    }
}

static void decode_item(const decode_args *a, int64_t r, int64_t h0, int64_t h1) {
    switch (a->kvt) {
        case KV_F32: decode_item_t(KV_F32, a, r, h0, h1); break;
        case KV_BF16: decode_item_t(KV_BF16, a, r, h0, h1); break;
        default: decode_item_t(KV_F16, a, r, h0, h1); break;
    }
}

/* ------------------------------------------------------------ quantized KV caches
 *
 * The byte formats of pagedkv/ops/kv_quant.py, read in place: each (token, KV head) part is
 * [values | inline scales], strides count bytes. Codes become float32 in registers (never a
 * dequantized copy of the cache): int8 sign-extended; fp8 e4m3 rebuilt as the fp16 bits
 * sign<<15 | (b&0x7f)<<7 (1/256 of its value, exactly: the x256 goes into kmul/vmul; the
 * e4m3fn NaN code would read as 480, but the writer clamps to +-448); e5m2 is fp16's top byte;
 * int4 nibbles (element 2i low, 2i+1 high) minus the zero point.
 * Per-token-head scales fold into the logit (s = scale * k_scale[tok] * q.codes) and into the
 * probability (acc += (p * v_scale[tok]) * codes), as vLLM does; int4 groups scale their
 * chunk of 16 values in registers (x = q*s - z*s; the portable path (q - z)*s, as torch).
 * KV_I8_TH16/KV_FP8_TH16 (the *_per_token_head_f16 formats: one fp16 scale a part) exist only at
 * the API: pkv_paged_decode runs them as KV_I8_TH/KV_FP8_TH with decode_args.s16 set. */
enum { KV_I8_TH = 3, KV_FP8_TH = 4, KV_FP8_E4M3 = 5, KV_FP8_E5M2 = 6, KV_I4_TH = 7, KV_I4_GROUP = 8,
       KV_I8_TH16 = 9, KV_FP8_TH16 = 10 };
/* Inside the AVX2 kernels only: KV_I4_TH read as raw codes 0..15, its zero points taken out of
 * the loops (q.(c - z) = q.c - z*sum(q); sum_j p_j (c_j - z_j) = sum_j p_j c_j - sum_j p_j z_j). */
enum { KV_I4_RAW = 11 };

enum { MAXG = 64 };  /* int4 scale groups per part the kernel reads (more: the torch path) */

static inline int kv_is_int4(int kvt) { return kvt == KV_I4_TH || kvt == KV_I4_GROUP || kvt == KV_I4_RAW; }
static inline int kv_token_scaled(int kvt) { return kvt == KV_I8_TH || kvt == KV_FP8_TH || kvt == KV_I4_TH; }

/* The scale of a per-token-head part (its bytes at p: fp32, or fp16 if s16); int4's zero point
 * into *z. */
static inline float part_scale(const uint8_t *p, int kvt, int s16, float *z) {
    if (s16) {
        *z = 0.0f;
        return fp16_to_fp32(load_u16(p));
    }
    uint32_t b;
    memcpy(&b, p, 4);
    *z = kvt == KV_I4_TH ? (float)(b & 15u) : 0.0f;
    if (kvt == KV_I4_TH) b &= ~15u;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* Scale of int4 group `grp` (fp16s at p, the zero point in each one's low 4 bits). */
static inline float group_scale(const uint8_t *p, int64_t grp, float *z) {
    uint16_t h = load_u16(p + 2 * grp);
    *z = (float)(h & 15u);
#if defined(__F16C__)
    return _cvtsh_ss((uint16_t)(h & ~15u));
#else
    return fp16_to_fp32((uint16_t)(h & ~15u));
#endif
}

/* Stored value i of a part: int8 code, fp8 e4m3 / 256, e5m2, or the int4 code 0..15. */
static inline float code_at(const uint8_t *p, int64_t i, int kvt) {
    switch (kvt) {
        case KV_I8_TH: return (float)(int8_t)p[i];
        case KV_FP8_TH:
        case KV_FP8_E4M3: return fp16_to_fp32((uint16_t)(((p[i] & 0x80u) << 8) | ((p[i] & 0x7fu) << 7)));
        case KV_FP8_E5M2: return fp16_to_fp32((uint16_t)(p[i] << 8));
        default: return (float)((p[i >> 1] >> (4 * (i & 1))) & 15u);
    }
}

/* Value i of a part as the attention multiplies it: the code, less the int4 zero point z
 * (per-token-head) or times its group's scale (int4 groups of g at the part's `vals` bytes). */
static inline float qval(const uint8_t *p, int64_t i, int kvt, float z, int64_t vals, int64_t g) {
    float c = code_at(p, i, kvt);
    if (kvt == KV_I4_TH) return c - z;
    if (kvt == KV_I4_GROUP) {
        float zz, sc = group_scale(p + vals, i / g, &zz);
        return (c - zz) * sc;
    }
    return c;
}

/* M(kvt) with a->kvt as a constant: each quantized format gets its own branch-free loops. */
#define PKV_DISPATCH(M)                          \
    switch (a->kvt) {                            \
        case KV_I8_TH: M(KV_I8_TH) break;        \
        case KV_FP8_TH: M(KV_FP8_TH) break;      \
        case KV_FP8_E4M3: M(KV_FP8_E4M3) break;  \
        case KV_FP8_E5M2: M(KV_FP8_E5M2) break;  \
        case KV_I4_TH: M(KV_I4_TH) break;        \
        default: M(KV_I4_GROUP) break;           \
    }

/* The quantized dot products value by value (the portable build, and head sizes the AVX2
 * tile buffer does not take): s[g][j] = q_g . k_j and acc[g] += s[g][j] * v_j. */
__attribute__((unused)) static void qk_tile_scalar(const decode_args *a, const float *q, const uint8_t *const *ks,
                                                   int64_t off, int64_t n, const float *z, float (*s)[TILE]) {
    for (int64_t j = 0; j < n; j++)
        for (int64_t g = 0; g < a->G; g++) {
            float t = 0.0f;
            for (int64_t d = 0; d < a->D; d++)
                t += q[g * a->D + d] * qval(ks[j] + off, d, a->kvt, z[j], a->kvals, a->kgroup);
            s[g][j] = t;
        }
}

__attribute__((unused)) static void qv_tile_scalar(const decode_args *a, float *acc, float (*s)[TILE],
                                                   const uint8_t *const *vs, int64_t off, int64_t n, const float *z) {
    for (int64_t j = 0; j < n; j++)
        for (int64_t c = 0; c < a->Dv; c++) {
            float w = qval(vs[j] + off, c, a->kvt, z[j], a->vvals, a->vgroup);
            for (int64_t g = 0; g < a->G; g++) acc[g * a->Dv + c] += s[g][j] * w;
        }
}

#if PKV_ATTN_AVX512 || PKV_AVX2
/* Int4 group scales, converted once per tile (F16C: both SIMD paths).
 * Scales and -z*s of eight fp16 group scales h into gs[0:8) / gz[0:8). */
static inline void group_scales8(__m128i h, float *gs, float *gz) {
    const __m128i low = _mm_set1_epi16(15);
    __m256 sc = _mm256_cvtph_ps(_mm_andnot_si128(low, h));
    __m256 zp = _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(_mm_and_si128(h, low)));
    _mm256_storeu_ps(gs, sc);
    _mm256_storeu_ps(gz, _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), zp), sc));
}

/* 8/NG tokens' NG scales each (at ps[i] + at) into gs/gz[0:8): one conversion for all. */
ALWAYS_INLINE void group_scales_batch(const int ng, const uint8_t *const *ps, int64_t at, float *gs, float *gz) {
    uint16_t h[8];
    for (int i = 0; i < 8 / ng; i++) memcpy(h + i * ng, ps[i] + at, 2 * ng);
    group_scales8(_mm_loadu_si128((const __m128i *)h), gs, gz);
}

/* gs[j*ng + grp] = scale s, gz[j*ng + grp] = -z*s of int4 group grp (of ng) of the parts at
 * ps[j] + at, j < n: converted once per tile, then broadcast from memory by the dot products.
 * Writes up to 8 floats past the last group (the buffers have room). */
static inline void group_scales(const uint8_t *const *ps, int64_t at, int64_t n, int64_t ng, float *gs, float *gz) {
    int64_t j = 0;
    if (ng == 1)  /* several tokens a conversion (V parts; K of head sizes 16 and 64) */
        for (; j + 8 <= n; j += 8) group_scales_batch(1, ps + j, at, gs + j, gz + j);
    else if (ng == 2)
        for (; j + 4 <= n; j += 4) group_scales_batch(2, ps + j, at, gs + 2 * j, gz + 2 * j);
    else if (ng == 4)
        for (; j + 2 <= n; j += 2) group_scales_batch(4, ps + j, at, gs + 4 * j, gz + 4 * j);
    for (; j < n; j++)
        for (int64_t grp = 0; grp < ng; grp += 8) {
            uint16_t h[8] = {0};
            memcpy(h, ps[j] + at + 2 * grp, 2 * (size_t)(ng - grp >= 8 ? 8 : ng - grp));
            group_scales8(_mm_loadu_si128((const __m128i *)h), gs + j * ng + grp, gz + j * ng + grp);
        }
}

#endif

#if PKV_ATTN_AVX512
#define PKV_INLINE static inline __attribute__((always_inline))

/* 16 stored values from p as float32, like code_at; `full`: all 16 there (plain loads, which
 * fold into the conversions), else only the bytes in mb are read. */
PKV_INLINE __m512 codes16(const int kvt, const int full, const uint8_t *p, __mmask16 mb) {
    __m128i b = full ? (kv_is_int4(kvt) ? _mm_loadl_epi64((const __m128i *)p) : _mm_loadu_si128((const __m128i *)p))
                     : _mm_maskz_loadu_epi8(mb, p);
    if (kvt == KV_I8_TH) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    if (kvt == KV_FP8_E5M2) return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
    if (kvt == KV_FP8_TH || kvt == KV_FP8_E4M3)  /* sign-extend, shift: bit 15 = sign, clear bit 14 */
        return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                                _mm256_set1_epi16((short)0xBF80)));
    const __m128i low = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
}

/* 64 int4 codes (32 bytes at p) as four 16-lane float32 chunks: one load and one nibble split
 * for all four (in-lane unpacks give elements 0-15 | 32-47 and 16-31 | 48-63). */
PKV_INLINE void int4_codes64(const uint8_t *p, __m512 *w) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i b = _mm256_loadu_si256((const __m256i *)p);
    __m256i lo = _mm256_and_si256(b, low), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
    __m256i u0 = _mm256_unpacklo_epi8(lo, hi), u1 = _mm256_unpackhi_epi8(lo, hi);
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(u0)));
    w[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(u1)));
    w[2] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(u0, 1)));
    w[3] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(u1, 1)));
}

/* Bytes holding values [d, d + 16) of a part with `rem` = D - d values left. */
PKV_INLINE __mmask16 code_bytes(const int kvt, int64_t rem) {
    return kv_is_int4(kvt) ? lanes(rem >= 16 ? 8 : (rem + 1) / 2) : lanes(rem);
}

/* A chunk's codes as the dot product multiplies them: less the int4 zero point z (per token-
 * head), or q*s + (-z*s) with its group's scale (one FMA: (q - z)*s to within an ulp of z*s). */
PKV_INLINE __m512 adjust(const int kvt, __m512 w, const float *z, const float *gs, const float *gz) {
    if (kvt == KV_I4_TH) return _mm512_sub_ps(w, _mm512_set1_ps(*z));
    if (kvt == KV_I4_GROUP) return _mm512_fmadd_ps(w, _mm512_set1_ps(*gs), _mm512_set1_ps(*gz));
    return w;
}

/* s[h*TILE + j] = q_h . k_j (raw: per-token scales are the caller's) for nh (<= 3) query
 * heads and the 8 keys at ks[j] + off: each chunk of a key is converted once for all heads.
 * full: D is a multiple of 16 (plain loads; int4 parts then take qk16_int4 when D % 64 == 0). */
PKV_INLINE void qk8(const int kvt, const int nh, const int full, const float *q, int64_t D, const uint8_t *const *ks,
                    int64_t off, const int64_t *cg, int64_t ng, const float *z, const float *gs, const float *gz,
                    float *s) {
    __m512 t[3][8];
    for (int h = 0; h < nh; h++)
        for (int j = 0; j < 8; j++) t[h][j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
        __mmask16 m = lanes(D - d), mb = code_bytes(kvt, D - d);
        __m512 qv[3];
        for (int h = 0; h < nh; h++) qv[h] = _mm512_maskz_loadu_ps(m, q + h * D + d);
        for (int j = 0; j < 8; j++) {
            __m512 k = codes16(kvt, full, ks[j] + off + (kv_is_int4(kvt) ? d / 2 : d), mb);
            k = adjust(kvt, k, z + j, gs + j * ng + cg[d / 16], gz + j * ng + cg[d / 16]);
            for (int h = 0; h < nh; h++) t[h][j] = _mm512_fmadd_ps(qv[h], k, t[h][j]);
        }
    }
    for (int h = 0; h < nh; h += 2) {  /* two heads' 8 sums per transposing reduction */
        __m512 v[16];
        for (int j = 0; j < 8; j++) {
            v[j] = t[h][j];
            v[8 + j] = h + 1 < nh ? t[h + 1][j] : _mm512_setzero_ps();
        }
        __m512 r = hsum16(v);
        _mm256_storeu_ps(s + h * TILE, _mm512_castps512_ps256(r));
        if (h + 1 < nh)
            _mm256_storeu_ps(s + (h + 1) * TILE, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(r), 1)));
    }
}

/* qk8 for int4 parts with D a multiple of 64, 16 keys a call, key by key: a key's sums stay
 * in registers over all of D (64 values a load), and each head's 16 sums take one whole
 * transposing reduction (8 keys of 3 heads would leave half of one idle). */
PKV_INLINE void qk16_int4(const int kvt, const int nh, const float *q, int64_t D, const uint8_t *const *ks,
                          int64_t off, const int64_t *cg, int64_t ng, const float *z, const float *gs,
                          const float *gz, float *s) {
    __m512 t[3][16];
    for (int j = 0; j < 16; j++) {
        __m512 th[3];
        for (int h = 0; h < nh; h++) th[h] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 64) {
            __m512 w[4];
            int4_codes64(ks[j] + off + d / 2, w);
            for (int c = 0; c < 4; c++) {
                int64_t grp = cg[d / 16 + c];
                w[c] = adjust(kvt, w[c], z + j, gs + j * ng + grp, gz + j * ng + grp);
                for (int h = 0; h < nh; h++)
                    th[h] = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * D + d + 16 * c), w[c], th[h]);
            }
        }
        for (int h = 0; h < nh; h++) t[h][j] = th[h];
    }
    for (int h = 0; h < nh; h++) _mm512_storeu_ps(s + h * TILE, hsum16(t[h]));
}

/* acc[h*Dv + c] += sum_j p[h*TILE + j] * v_j[c] for nh (<= 4) query heads, 64 columns a pass:
 * each value chunk is converted once for all heads. full: Dv is a multiple of 64. */
PKV_INLINE void qv64(const int kvt, const int nh, const int full, float *acc, int64_t Dv, const float *p,
                     const uint8_t *const *vs, int64_t off, int64_t n, int64_t g, const float *z, const float *gs,
                     const float *gz) {
    const int64_t ng = Dv / g;  /* int4 groups of a part: the stride of gs/gz */
    for (int64_t c0 = 0; c0 < Dv; c0 += 64) {
        __mmask16 m[4], mb[4];
        int64_t grp[4];
        for (int k = 0; k < 4; k++) {
            int64_t c = c0 + 16 * k;
            m[k] = full ? (__mmask16)0xFFFF : lanes(Dv - c);
            mb[k] = code_bytes(kvt, Dv - c);
            grp[k] = (c < Dv ? c : Dv - 1) / g;  /* a masked-off chunk reads a real scale */
        }
        __m512 a[4][4];
        for (int h = 0; h < nh; h++)
            for (int k = 0; k < 4; k++) a[h][k] = _mm512_maskz_loadu_ps(m[k], acc + h * Dv + c0 + 16 * k);
        for (int64_t j = 0; j < n; j++) {
            const uint8_t *pv = vs[j] + off;
            __m512 w[4];
            if (full && kv_is_int4(kvt)) {
                int4_codes64(pv + c0 / 2, w);
            } else {
                for (int k = 0; k < 4; k++)
                    w[k] = codes16(kvt, full, pv + (kv_is_int4(kvt) ? (c0 + 16 * k) / 2 : c0 + 16 * k), mb[k]);
            }
            for (int k = 0; k < 4; k++) w[k] = adjust(kvt, w[k], z + j, gs + j * ng + grp[k], gz + j * ng + grp[k]);
            for (int h = 0; h < nh; h++) {
                __m512 pj = _mm512_set1_ps(p[h * TILE + j]);
                for (int k = 0; k < 4; k++) a[h][k] = _mm512_fmadd_ps(pj, w[k], a[h][k]);
            }
        }
        for (int h = 0; h < nh; h++)
            for (int k = 0; k < 4; k++) _mm512_mask_storeu_ps(acc + h * Dv + c0 + 16 * k, m[k], a[h][k]);
    }
}

#define PKV_QK8(KVT, NH) \
    (full ? qk8(KVT, NH, 1, qg, D, ks + j0, off, cg, ng, z + j0, gs + j0 * ng, gz + j0 * ng, sg) \
          : qk8(KVT, NH, 0, qg, D, ks + j0, off, cg, ng, z + j0, gs + j0 * ng, gz + j0 * ng, sg))
#define PKV_QK16(KVT, NH) qk16_int4(KVT, NH, qg, D, ks + j0, off, cg, ng, z + j0, gs + j0 * ng, gz + j0 * ng, sg)
#define PKV_QK(KVT)                                                    \
    if (kv_is_int4(KVT) && full)                                      \
        for (int64_t j0 = 0; j0 < n; j0 += 16)                        \
            for (int64_t g0 = 0; g0 < G; g0 += 3) {                    \
                const float *qg = q + g0 * D;                          \
                float *sg = s[g0] + j0;                                \
                if (G - g0 >= 3) PKV_QK16(KVT, 3);                     \
                else if (G - g0 == 2) PKV_QK16(KVT, 2);                \
                else PKV_QK16(KVT, 1);                                 \
            }                                                          \
    else                                                               \
        for (int64_t j0 = 0; j0 < n; j0 += 8)                         \
            for (int64_t g0 = 0; g0 < G; g0 += 3) {                    \
                const float *qg = q + g0 * D;                          \
                float *sg = s[g0] + j0;                                \
                if (G - g0 >= 3) PKV_QK8(KVT, 3);                      \
                else if (G - g0 == 2) PKV_QK8(KVT, 2);                 \
                else PKV_QK8(KVT, 1);                                  \
            }
#define PKV_QV64(KVT, NH) \
    (full ? qv64(KVT, NH, 1, ag, Dv, pg, vs, off, n, a->vgroup, z, gs, gz) \
          : qv64(KVT, NH, 0, ag, Dv, pg, vs, off, n, a->vgroup, z, gs, gz))
#define PKV_QV(KVT)                                          \
    for (int64_t g0 = 0; g0 < G; g0 += 4) {                  \
        float *ag = acc + g0 * Dv;                           \
        const float *pg = s[g0];                             \
        switch (G - g0 >= 4 ? 4 : G - g0) {                  \
            case 4: PKV_QV64(KVT, 4); break;                 \
            case 3: PKV_QV64(KVT, 3); break;                 \
            case 2: PKV_QV64(KVT, 2); break;                 \
            default: PKV_QV64(KVT, 1); break;                \
        }                                                    \
    }

/* Raw logits s[g][0:n) of the G query heads q (G rows of D) against keys ks[j] + off (ks
 * padded to a multiple of 16 keys); z: per-key int4 zero points; gs/gz: int4 group scales. */
static void qk_tile(const decode_args *a, const float *q, const uint8_t *const *ks, int64_t off, int64_t n,
                    const float *z, const float *gs, const float *gz, float (*s)[TILE]) {
    const int64_t G = a->G, D = a->D;
    const int full = kv_is_int4(a->kvt) ? D % 64 == 0 : D % 16 == 0;
    int64_t cg[MAXG], ng = D / a->kgroup;  /* int4 group of each 16-value chunk (no division in the loops) */
    if (a->kvt == KV_I4_GROUP)
        for (int64_t c = 0; 16 * c < D; c++) cg[c] = 16 * c / a->kgroup;
    PKV_DISPATCH(PKV_QK)
}

/* acc (G rows of Dv) += p (G rows of TILE) times the values vs[j] + off, j < n. */
static void qv_tile(const decode_args *a, float *acc, float (*s)[TILE], const uint8_t *const *vs, int64_t off,
                    int64_t n, const float *z, const float *gs, const float *gz) {
    const int64_t G = a->G, Dv = a->Dv;
    const int full = Dv % 64 == 0;
    PKV_DISPATCH(PKV_QV)
}
#elif PKV_AVX2
/* AVX2: head sizes that are multiples of 8 dequantize in registers (qk_avx2, qv_avx2: each
 * 8-value chunk converted once for several query heads of the KV head). Other head sizes convert
 * a tile's parts once into an L1 buffer of float32 values (16 KB at head size 64: one tile,
 * never a copy of the cache), and the float32 kernels above (scores16, accumulate_tile) run on it. */
enum { QBUF_D = 256 };  /* largest head size this path converts (more: the portable loops) */

/* The int4 codes of the bytes in b in value order: byte i's low nibble is value 2i, its high
 * nibble 2i + 1 (16 codes from 8 bytes; the upper 8 bytes of b are ignored). */
ALWAYS_INLINE __m128i nibbles(__m128i b) {
    const __m128i low = _mm_set1_epi8(0x0F);
    return _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
}

/* 8 stored values from p (int4: 4 bytes, elements 2i low and 2i+1 high nibble) as code_at
 * reads them: int8 sign-extended, fp8 e4m3 rebuilt as fp16 bits (1/256 of its value), e5m2
 * as fp16's top byte, int4 codes 0..15. */
ALWAYS_INLINE __m256 codes8(const int kvt, const uint8_t *p) {
    if (kvt == KV_I8_TH) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    if (kvt == KV_FP8_E5M2) return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)), 8));
    if (kvt == KV_FP8_TH || kvt == KV_FP8_E4M3)
        return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p)), 7),
                                             _mm_set1_epi16((short)0xBF80)));
    uint32_t w;
    memcpy(&w, p, 4);
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nibbles(_mm_cvtsi32_si128((int)w))));
}

/* A chunk of codes c as the attention multiplies them (qval's values): less int4's zero point
 * z, or c*s + (-z*s) with the int4 group's scale *gs and *gz (read for group formats only), as
 * the AVX-512 path computes them; KV_I4_RAW: c as it is. */
ALWAYS_INLINE __m256 adjust8(const int kvt, __m256 c, float z, const float *gs, const float *gz) {
    if (kvt == KV_I4_TH) return _mm256_sub_ps(c, _mm256_set1_ps(z));
    if (kvt == KV_I4_GROUP) return _mm256_fmadd_ps(c, _mm256_set1_ps(*gs), _mm256_set1_ps(*gz));
    return c;
}

/* Values [d, d + 8) of the part at p (see adjust8). Int4 groups are multiples of 16 values or
 * the whole part (pkv_paged_decode checks), so an aligned chunk of 8 lies in one group. */
ALWAYS_INLINE __m256 chunk8(const int kvt, const uint8_t *p, int64_t d, float z, const float *gs, const float *gz) {
    return adjust8(kvt, codes8(kvt, p + (kv_is_int4(kvt) ? d / 2 : d)), z, gs, gz);
}

/* Values [d, d + 16) as two chunk8s (lo, hi). Int4 in split order: lo holds the values d, d + 2,
 * .., d + 14 (the low nibbles of the 8 bytes), hi d + 1, .., d + 15 (the high ones), which costs
 * 5 instructions for 16 codes against 10 in value order; the caller holds its queries and
 * accumulators of these 16 values in the same order (split16). It keeps d + 16 <= D and the 16
 * in one group. */
ALWAYS_INLINE void chunk16(const int kvt, const uint8_t *p, int64_t d, float z, const float *gs, const float *gz,
                           __m256 *lo, __m256 *hi) {
    if (!kv_is_int4(kvt)) {
        *lo = chunk8(kvt, p, d, z, gs, gz);
        *hi = chunk8(kvt, p, d + 8, z, gs, gz);
        return;
    }
    __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + d / 2)));
    *lo = adjust8(kvt, _mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(15))), z, gs, gz);
    *hi = adjust8(kvt, _mm256_cvtepi32_ps(_mm256_srli_epi32(x, 4)), z, gs, gz);
}

/* 16 floats in value order (a = [0, 8), b = [8, 16)) into chunk16's int4 split order (even
 * values into *e, odd ones into *o), and back. */
ALWAYS_INLINE void split16(__m256 a, __m256 b, __m256 *e, __m256 *o) {
    *e = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
    *o = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
}

ALWAYS_INLINE void join16(__m256 e, __m256 o, __m256 *a, __m256 *b) {
    __m256 l = _mm256_unpacklo_ps(e, o), h = _mm256_unpackhi_ps(e, o);  /* [0-3 | 8-11], [4-7 | 12-15] */
    *a = _mm256_permute2f128_ps(l, h, 0x20);
    *b = _mm256_permute2f128_ps(l, h, 0x31);
}

/* out[0:D) = the D values of the part at p as the attention multiplies them (see adjust8). */
static void part_floats(const int kvt, const uint8_t *p, int64_t D, float z, int64_t vals, int64_t g, float *out) {
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        float zz = 0.0f, sc = kvt == KV_I4_GROUP ? group_scale(p + vals, d / g, &zz) : 0.0f, nzs = -zz * sc;
        _mm256_storeu_ps(out + d, chunk8(kvt, p, d, z, &sc, &nzs));
    }
    for (; d < D; d++) out[d] = qval(p, d, kvt, z, vals, g);
}

/* One step of qk_avx2 at values [d, d + 8 or 16): t[h][j] += q_h . k_j over them. gs/gz: the
 * tile's int4 group scales, ng a key, gi the step's group. */
ALWAYS_INLINE void qk_step(const int kvt, const int nh, const int w16, const float *q, int64_t D, int64_t d,
                           const uint8_t *const *ks, int64_t off, const float *z, const float *gs, const float *gz,
                           int64_t ng, int64_t gi, __m256 (*t)[4]) {
    for (int j = 0; j < 4; j++) {
        const int64_t at = j * ng + gi;
        __m256 k0, k1 = _mm256_setzero_ps();
        if (w16) chunk16(kvt, ks[j] + off, d, z[j], gs + at, gz + at, &k0, &k1);
        else k0 = chunk8(kvt, ks[j] + off, d, z[j], gs + at, gz + at);
        for (int h = 0; h < nh; h++) {
            t[h][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + d), k0, t[h][j]);
            if (w16) t[h][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + d + 8), k1, t[h][j]);
        }
    }
}

/* In registers, for head sizes that are multiples of 8 (the tile buffer below takes the rest;
 * int4 group scales come converted once per tile, gs/gz: decoding them per chunk made this path
 * slower than the buffer).
 * s[h*TILE + j] = q_h . k_j (raw) for nh (<= 3) query heads and the 4 keys ks[j] + off: each
 * chunk of a key is converted once for all heads (12 accumulators; the query chunks are read
 * from L1 for each key: 3 heads x 2 keys with the 6 query chunks in registers measured no
 * faster), then two heads' 4 sums take one transposing reduction. Int4: q in split order
 * (split16) and, for KV_I4_TH, qsum[h] the sum of q_h, which takes the zero points out of the
 * loop (q.(c - z) = q.c - z*qsum). */
ALWAYS_INLINE void qk_avx2(const int kvt0, const int nh, const float *q, const float *qsum, int64_t D,
                           const uint8_t *const *ks, int64_t off, const float *z, const float *gs, const float *gz,
                           int64_t ng, int64_t g, float *s) {
    const int kvt = kvt0 == KV_I4_TH ? KV_I4_RAW : kvt0;
    __m256 t[3][4];
    for (int h = 0; h < nh; h++)
        for (int j = 0; j < 4; j++) t[h][j] = _mm256_setzero_ps();
    int64_t d = 0, gi = 0, gend = g;  /* int4 group gi holds values [gend - g, gend): a multiple of 16, or D */
    /* int4: 16 values a step (one unpack); the other formats 8 (pairing their chunks measured
     * slower: int8 0.44x -> 0.47-0.50x of the float32 cache's time) */
    for (; kv_is_int4(kvt) && d + 16 <= D; d += 16) {
        if (kvt == KV_I4_GROUP && d == gend) gi++, gend += g;
        qk_step(kvt, nh, 1, q, D, d, ks, off, z, gs, gz, ng, gi, t);
    }
    for (; d < D; d += 8) {
        if (kvt == KV_I4_GROUP && d == gend) gi++, gend += g;
        qk_step(kvt, nh, 0, q, D, d, ks, off, z, gs, gz, ng, gi, t);
    }
    for (int h = 0; h < nh; h += 2) {
        __m256 v[8];
        for (int j = 0; j < 4; j++) {
            v[j] = t[h][j];
            v[4 + j] = h + 1 < nh ? t[h + 1][j] : _mm256_setzero_ps();
        }
        __m256 r = hsum8x8(v);  /* lanes 0-3: head h's 4 keys, 4-7: head h+1's */
        if (kvt == KV_I4_RAW)
            r = _mm256_fnmadd_ps(_mm256_broadcast_ps((const __m128 *)z),
                                 _mm256_set_m128(_mm_set1_ps(h + 1 < nh ? qsum[h + 1] : 0.0f), _mm_set1_ps(qsum[h])), r);
        _mm_storeu_ps(s + h * TILE, _mm256_castps256_ps128(r));
        if (h + 1 < nh) _mm_storeu_ps(s + (h + 1) * TILE, _mm256_extractf128_ps(r, 1));
    }
}

/* sum_j p[j] * z[j], j < n. */
static inline float dot_n(const float *p, const float *z, int64_t n) {
    __m256 t = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) t = _mm256_fmadd_ps(_mm256_loadu_ps(p + j), _mm256_loadu_ps(z + j), t);
    float r = hsum8(t);
    for (; j < n; j++) r += p[j] * z[j];
    return r;
}

/* qv_pass's chunk k of nc: 2 = it and k + 1 convert together (int4, k even), 0 = it went with
 * k - 1, 1 = alone. */
ALWAYS_INLINE int chunk_role(const int pair, int k, int nc) { return !pair ? 1 : k % 2 ? 0 : k + 1 < nc ? 2 : 1; }

/* a less the tile's zero-point sum zp (KV_I4_RAW only; the other formats have none). */
ALWAYS_INLINE __m256 less_zero(const int kvt, __m256 a, __m256 zp) {
    return kvt == KV_I4_RAW ? _mm256_sub_ps(a, zp) : a;
}

/* One 8*nc-column pass of qv_avx2 at columns [c0, c0 + 8*nc). */
ALWAYS_INLINE void qv_pass(const int kvt, const int nh, const int nc, float *acc, int64_t Dv, int64_t c0,
                           const float *p, const uint8_t *const *vs, int64_t off, int64_t n, const float *z,
                           const float *gs, const float *gz, int64_t ng, int64_t g, const __m256 *zp) {
    /* nc (chunks of 8 columns), nh and kvt are constants once inlined, so every loop over k and
     * h unrolls and a[][] stays in registers (a runtime nc put it on the stack: 1.4x slower) */
    const int pair = kv_is_int4(kvt);
    int64_t gi[4] = {0};  /* each chunk's int4 group (an aligned chunk of 8 lies in one) */
    if (kvt == KV_I4_GROUP)
        for (int k = 0; k < nc; k++) gi[k] = (c0 + 8 * k) / g;
    __m256 a[3][4];
    for (int h = 0; h < nh; h++)
        for (int k = 0; k < nc; k++) {
            const float *at = acc + h * Dv + c0 + 8 * k;
            const int role = chunk_role(pair, k, nc);
            if (role == 2) split16(_mm256_loadu_ps(at), _mm256_loadu_ps(at + 8), &a[h][k], &a[h][k + 1]);
            else if (role == 1) a[h][k] = _mm256_loadu_ps(at);
        }
    for (int64_t j = 0; j < n; j++) {
        __m256 pj[3];
        for (int h = 0; h < nh; h++) pj[h] = _mm256_set1_ps(p[h * TILE + j]);
        for (int k = 0; k < nc; k++) {
            const int64_t at = j * ng + gi[k];
            const int role = chunk_role(pair, k, nc);
            __m256 w0, w1;
            if (role == 2) {
                chunk16(kvt, vs[j] + off, c0 + 8 * k, z[j], gs + at, gz + at, &w0, &w1);
                for (int h = 0; h < nh; h++) {
                    a[h][k] = _mm256_fmadd_ps(pj[h], w0, a[h][k]);
                    a[h][k + 1] = _mm256_fmadd_ps(pj[h], w1, a[h][k + 1]);
                }
            } else if (role == 1) {
                w0 = chunk8(kvt, vs[j] + off, c0 + 8 * k, z[j], gs + at, gz + at);
                for (int h = 0; h < nh; h++) a[h][k] = _mm256_fmadd_ps(pj[h], w0, a[h][k]);
            }
        }
    }
    for (int h = 0; h < nh; h++)
        for (int k = 0; k < nc; k++) {
            float *at = acc + h * Dv + c0 + 8 * k;
            const int role = chunk_role(pair, k, nc);
            if (role == 2) {
                __m256 lo, hi;
                join16(less_zero(kvt, a[h][k], zp[h]), less_zero(kvt, a[h][k + 1], zp[h]), &lo, &hi);
                _mm256_storeu_ps(at, lo);
                _mm256_storeu_ps(at + 8, hi);
            } else if (role == 1) _mm256_storeu_ps(at, less_zero(kvt, a[h][k], zp[h]));
        }
}

/* acc[h*Dv + c] += sum_j p[h*TILE + j] * v_j[c] for nh (<= 3) query heads, 32 columns a pass
 * (16 for 3 heads: 12 accumulators + 3 broadcasts + 2 values would not fit the 16 registers),
 * Dv a multiple of 8: each chunk of a value converted once for the heads; int4 two chunks a
 * conversion ([c0 + 8k, +16) is 16-aligned, so in one group: 16s or all Dv), their columns held
 * in chunk16's split order, and KV_I4_TH's zero points subtracted once a tile (sum_j p_j z_j). */
ALWAYS_INLINE void qv_avx2(const int kvt0, const int nh, float *acc, int64_t Dv, const float *p,
                           const uint8_t *const *vs, int64_t off, int64_t n, const float *z, const float *gs,
                           const float *gz, int64_t ng, int64_t g) {
    const int kvt = kvt0 == KV_I4_TH ? KV_I4_RAW : kvt0, w = nh == 3 ? 16 : 32;
    __m256 zp[3];
    for (int h = 0; h < nh; h++)
        if (kvt == KV_I4_RAW) zp[h] = _mm256_set1_ps(dot_n(p + h * TILE, z, n));
    int64_t c0 = 0;
    for (; c0 + w <= Dv; c0 += w) qv_pass(kvt, nh, w / 8, acc, Dv, c0, p, vs, off, n, z, gs, gz, ng, g, zp);
    switch ((Dv - c0) / 8) {
        case 3: qv_pass(kvt, nh, 3, acc, Dv, c0, p, vs, off, n, z, gs, gz, ng, g, zp); break;
        case 2: qv_pass(kvt, nh, 2, acc, Dv, c0, p, vs, off, n, z, gs, gz, ng, g, zp); break;
        case 1: qv_pass(kvt, nh, 1, acc, Dv, c0, p, vs, off, n, z, gs, gz, ng, g, zp); break;
        default: break;
    }
}

/* (ng: int4 groups per part; gs/gz: their scales, ng a token, from group_scales) */
#define PKV2_QK4(KVT, NH) \
    qk_avx2(KVT, NH, qh, qsum, D, ks + j0, off, z + j0, gs + j0 * ng, gz + j0 * ng, ng, a->kgroup, s[g0] + j0);
#define PKV2_QK(KVT)                                                                                \
    for (int64_t g0 = 0; g0 < G; g0 += 3) {                                                         \
        const int nh = G - g0 >= 3 ? 3 : (int)(G - g0);                                             \
        const float *qh = kv_is_int4(KVT) ? split_queries(q + g0 * D, nh, D, qs, qsum) : q + g0 * D; \
        for (int64_t j0 = 0; j0 < n; j0 += 4) {                                                     \
            if (nh == 3) PKV2_QK4(KVT, 3)                                                           \
            else if (nh == 2) PKV2_QK4(KVT, 2)                                                      \
            else PKV2_QK4(KVT, 1)                                                                   \
        }                                                                                           \
    }
#define PKV2_QV3(KVT, NH) qv_avx2(KVT, NH, acc + g0 * Dv, Dv, s[g0], vs, off, n, z, gs, gz, ng, a->vgroup);
/* Query heads in 2s, and an odd count's first 3 together (G = 3: one pass converting each value
 * once, not a 2 and a 1 converting it twice; fewer instructions a value than the 2 + 1). */
#define PKV2_QV(KVT)                                                  \
    for (int64_t g0 = 0; g0 < G;) {                                   \
        if ((G - g0) % 2 && G - g0 >= 3) { PKV2_QV3(KVT, 3) g0 += 3; } \
        else if (G - g0 >= 2) { PKV2_QV3(KVT, 2) g0 += 2; }             \
        else { PKV2_QV3(KVT, 1) g0 += 1; }                              \
    }

/* The parts ks[j] + off (j < n) as float32 rows of D at buf; bp[j] points at row j, padded to a
 * multiple of 16 keys with row 0 (computed, never used). */
static void tile_floats(const int kvt, const uint8_t *const *ks, int64_t off, int64_t n, int64_t D, const float *z,
                        int64_t vals, int64_t g, float *buf, const char **bp) {
    for (int64_t j = 0; j < n; j++) {
        part_floats(kvt, ks[j] + off, D, z[j], vals, g, buf + j * D);
        bp[j] = (const char *)(buf + j * D);
    }
    for (int64_t j = n; j < (n + 15) / 16 * 16; j++) bp[j] = bp[0];
}

/* The nh query heads q (rows of D) into qs in chunk16's int4 split order (whole 16-value chunks;
 * the tail stays in value order) and their sums into qsum; returns qs. */
static const float *split_queries(const float *q, int nh, int64_t D, float *qs, float *qsum) {
    for (int h = 0; h < nh; h++) {
        const float *x = q + h * D;
        float *y = qs + h * D;
        __m256 t = _mm256_setzero_ps();
        int64_t d = 0;
        for (; d + 16 <= D; d += 16) {
            __m256 a = _mm256_loadu_ps(x + d), b = _mm256_loadu_ps(x + d + 8), e, o;
            split16(a, b, &e, &o);
            _mm256_storeu_ps(y + d, e);
            _mm256_storeu_ps(y + d + 8, o);
            t = _mm256_add_ps(t, _mm256_add_ps(a, b));
        }
        qsum[h] = hsum8(t);
        for (; d < D; d++) qsum[h] += y[d] = x[d];
    }
    return qs;
}

enum { QSPLIT_D = 1024 };  /* largest int4 head size read in registers (more: the portable loops) */

static void qk_tile(const decode_args *a, const float *q, const uint8_t *const *ks, int64_t off, int64_t n,
                    const float *z, const float *gs, const float *gz, float (*s)[TILE]) {
    const int64_t D = a->D, G = a->G, ng = D / a->kgroup;
    if (D % 8 == 0 && (!kv_is_int4(a->kvt) || D <= QSPLIT_D)) {  /* keys padded to a multiple of 16
                                                                 * (z, gs, gz too): the last 4 are whole */
        float qs[3 * QSPLIT_D], qsum[3];
        PKV_DISPATCH(PKV2_QK)
        return;
    }
    if (D > QBUF_D) {
        qk_tile_scalar(a, q, ks, off, n, z, s);
        return;
    }
    float buf[TILE * QBUF_D];
    const char *bp[TILE];
    tile_floats(a->kvt, ks, off, n, D, z, a->kvals, a->kgroup, buf, bp);
    for (int64_t g = 0; g < a->G; g++)
        for (int64_t j = 0; j < n; j += 16) scores16(q + g * D, bp + j, 0, D, KV_F32, 4, s[g] + j);
}

static void qv_tile(const decode_args *a, float *acc, float (*s)[TILE], const uint8_t *const *vs, int64_t off,
                    int64_t n, const float *z, const float *gs, const float *gz) {
    const int64_t Dv = a->Dv, G = a->G, ng = Dv / a->vgroup;
    if (Dv % 8 == 0) {
        PKV_DISPATCH(PKV2_QV)
        return;
    }
    if (Dv > QBUF_D) {
        qv_tile_scalar(a, acc, s, vs, off, n, z);
        return;
    }
    float buf[TILE * QBUF_D];
    const char *bp[TILE];
    tile_floats(a->kvt, vs, off, n, Dv, z, a->vvals, a->vgroup, buf, bp);
    for (int64_t g = 0; g < a->G; g++) accumulate_tile(acc + g * Dv, s[g], bp, 0, n, Dv, KV_F32, 4);
}
#else
static void qk_tile(const decode_args *a, const float *q, const uint8_t *const *ks, int64_t off, int64_t n,
                    const float *z, const float *gs, const float *gz, float (*s)[TILE]) {
    (void)gs, (void)gz;
    qk_tile_scalar(a, q, ks, off, n, z, s);
}

static void qv_tile(const decode_args *a, float *acc, float (*s)[TILE], const uint8_t *const *vs, int64_t off,
                    int64_t n, const float *z, const float *gs, const float *gz) {
    (void)gs, (void)gz;
    qv_tile_scalar(a, acc, s, vs, off, n, z);
}
#endif

/* Per-token-head scales (times `mul`) and int4 zero points of the parts at ps[j] + at. */
static inline void token_scales(const uint8_t *const *ps, int64_t at, int64_t n, int kvt, int s16, float mul,
                                float *sc, float *z) {
    for (int64_t j = 0; j < n; j++) sc[j] = mul * part_scale(ps[j] + at, kvt, s16, &z[j]);
}

/* Prefetch (into L2: a few % faster than L1 here, the lines are used once) the K and V parts
 * of heads [h0, h1) of tokens [pos, pos + count) of a row. When a token's parts lie close
 * together (every layout but LBHNC) its span is fetched line by line, each line once (*last:
 * the highest line issued); otherwise part by part. */
static void prefetch_tokens(const decode_args *a, const int32_t *table, int64_t pos, int64_t count, int64_t h0,
                            int64_t h1, uintptr_t *last) {
    const uint8_t *kc = (const uint8_t *)a->k, *vc = (const uint8_t *)a->v;
    const int64_t bs = a->block_size, need = (h1 - h0) * (a->kpart + a->vpart);
    for (int64_t j = 0, bi = pos / bs, tok = pos % bs; j < count; j++) {
        const uint8_t *k = kc + table[bi] * a->kb + tok * a->kt, *v = vc + table[bi] * a->vb + tok * a->vt;
        uintptr_t k0 = (uintptr_t)(k + h0 * a->kh), k1 = (uintptr_t)(k + (h1 - 1) * a->kh + a->kpart);
        uintptr_t v0 = (uintptr_t)(v + h0 * a->vh), v1 = (uintptr_t)(v + (h1 - 1) * a->vh + a->vpart);
        uintptr_t lo = k0 < v0 ? k0 : v0, hi = k1 > v1 ? k1 : v1;
        if (hi - lo <= (uintptr_t)(2 * need)) {
            for (uintptr_t line = lo >> 6; line <= (hi - 1) >> 6; line++)
                if (line > *last || line + 64 < *last) {  /* not just issued (tokens ascend in a block) */
                    __builtin_prefetch((const void *)(line << 6), 0, 2);
                    *last = line;
                }
        } else {
            for (int64_t hk = h0; hk < h1; hk++) {
                const uint8_t *pk = k + hk * a->kh, *pv = v + hk * a->vh;
                for (int64_t b = 0; b < a->kpart; b += 64) __builtin_prefetch(pk + b, 0, 2);
                __builtin_prefetch(pk + a->kpart - 1, 0, 2);  /* a part need not start on a cache line */
                for (int64_t b = 0; b < a->vpart; b += 64) __builtin_prefetch(pv + b, 0, 2);
                __builtin_prefetch(pv + a->vpart - 1, 0, 2);
            }
        }
        if (++tok == bs) { tok = 0; bi++; }
    }
}

/* decode_item over a quantized cache (same tiles, split and online softmax). */
static void decode_item_q(const decode_args *a, int64_t r, int64_t h0, int64_t h1) {
    float acc[MAX_ACC], s[256][TILE], mx[256], sum[256], sc[TILE], z[TILE] = {0};
#if PKV_ATTN_AVX512 || PKV_AVX2
    float gs[TILE * MAXG], gz[TILE * MAXG];  /* int4 group scales of the tile's parts */
#else
    float *gs = NULL, *gz = NULL;  /* the portable path reads them per value */
#endif
    const uint8_t *kp[TILE], *vp[TILE];
    const uint8_t *kc = (const uint8_t *)a->k, *vc = (const uint8_t *)a->v;
    const int kvt = a->kvt, scaled = kv_token_scaled(kvt);
    int64_t G = a->G, nq = (h1 - h0) * G, Dv = a->Dv, D = a->D, bs = a->block_size;
    int64_t len = a->seq_lens[r], first = (a->window > 0 && len > a->window) ? len - a->window : 0;
    const int32_t *table = a->block_table + r * a->bt_stride;
    const float *qr = a->q + r * a->q_stride + h0 * G * D;
    for (int64_t i = 0; i < nq; i++) {
        mx[i] = -INFINITY;
        sum[i] = 0.0f;
    }
    memset(acc, 0, nq * Dv * sizeof(float));
    for (int64_t t0 = first; t0 < len; t0 += TILE) {
        int64_t n = len - t0 < TILE ? len - t0 : TILE;
        for (int64_t j = 0, bi = t0 / bs, tok = t0 % bs; j < n; j++) {
            const int64_t blk = table[bi];
            kp[j] = kc + blk * a->kb + tok * a->kt;
            vp[j] = vc + blk * a->vb + tok * a->vt;
            if (++tok == bs) { tok = 0; bi++; }
        }
        for (int64_t j = n; j < TILE; j++) kp[j] = kp[0];  /* padding keys: computed, never used */
        /* The next tile's parts are prefetched in 2*(h1-h0) slices, one before each head's
         * pass below: a whole tile at once would fill the line-fill buffers and stall. */
        int64_t n2 = len - (t0 + TILE) < TILE ? len - (t0 + TILE) : TILE, phases = 2 * (h1 - h0), phase = 0;
        uintptr_t last_line = 0;
        for (int64_t hk = h0; hk < h1; hk++, phase++) {
            prefetch_tokens(a, table, t0 + TILE + n2 * phase / phases, n2 * (phase + 1) / phases - n2 * phase / phases,
                            h0, h1, &last_line);
            float (*sh)[TILE] = s + (hk - h0) * G, f = a->scale * a->kmul;
            if (scaled) token_scales(kp, hk * a->kh + a->kvals, n, kvt, a->s16, f, sc, z);
#if PKV_ATTN_AVX512 || PKV_AVX2
            if (kvt == KV_I4_GROUP)  /* padding keys (up to a multiple of 16) too */
                group_scales(kp, hk * a->kh + a->kvals, (n + 15) / 16 * 16, D / a->kgroup, gs, gz);
#endif
            qk_tile(a, qr + (hk - h0) * G * D, kp, hk * a->kh, n, z, gs, gz, sh);
            for (int64_t g = 0; g < G; g++)
                for (int64_t j = 0; j < n; j++) sh[g][j] *= scaled ? sc[j] : f;
        }
        softmax_tile(s, nq, n, mx, sum, acc, Dv);
        for (int64_t hk = h0; hk < h1; hk++, phase++) {
            prefetch_tokens(a, table, t0 + TILE + n2 * phase / phases, n2 * (phase + 1) / phases - n2 * phase / phases,
                            h0, h1, &last_line);
            float (*sh)[TILE] = s + (hk - h0) * G;
            if (scaled) {
                token_scales(vp, hk * a->vh + a->vvals, n, kvt, a->s16, 1.0f, sc, z);
                for (int64_t g = 0; g < G; g++)
                    for (int64_t j = 0; j < n; j++) sh[g][j] *= sc[j];
            }
#if PKV_ATTN_AVX512 || PKV_AVX2
            if (kvt == KV_I4_GROUP) group_scales(vp, hk * a->vh + a->vvals, n, Dv / a->vgroup, gs, gz);
#endif
            qv_tile(a, acc + (hk - h0) * G * Dv, sh, vp, hk * a->vh, n, z, gs, gz);
        }
    }
    for (int64_t i = 0; i < nq; i++) {
        int64_t h = h0 * G + i;
        float *o = a->out + r * a->out_stride + h * Dv, inv = a->vmul / sum[i];
        for (int64_t c = 0; c < Dv; c++) o[c] = acc[i * Dv + c] * inv;
        if (a->lse) a->lse[r * a->Hq + h] = mx[i] + logf(sum[i]);
    }
}

/* Decode attention straight from the paged cache (no gather copy), online softmax per query
 * head. Row r has one query q[r] ([Hq, D] at q + r*q_stride) at position seq_lens[r]-1 and
 * reads its keys through block_table[r] (bt_stride int32s apart): keys max(0, len - window) ..
 * len-1 (window <= 0: all). K element (block, token, head, i) is at
 * k + block*kb + token*kt + head*kh + i elements (same for V with vb/vt/vh), each a float32,
 * bfloat16 or float16 as kv_type says (KV_F32/KV_BF16/KV_F16). Query head h uses KV head
 * h / (Hq/Hkv). Writes out[r] ([Hq, Dv] at out + r*out_stride) and, if lse is not NULL,
 * lse[r*Hq + h] (natural log-sum-exp of the scaled logits).
 *
 * Quantized caches (kv_type KV_I8_TH .. KV_FP8_TH16): k/v are bytes and the strides count
 * bytes; the (block, token, head) part starts at k + block*kb + token*kt + head*kh, laid out
 * as pagedkv/ops/kv_quant.py says. k_scale/v_scale: the per-tensor fp8 scales (ignored by
 * the per-token-head modes); k_group/v_group: values per int4 scale group of a K/V part
 * (KV_I4_GROUP: a multiple of 16 or the whole part).
 *
 * Work split: with enough rows, one task per row covering all its KV heads (each K/V cache line
 * is fetched once); with few rows (batch-1 decode), one task per (row, KV head) so every thread
 * has work. Returns -1 (nothing written) for an unknown kv_type or group size, or when even one
 * KV head's query group does not fit the accumulators (G*Dv > MAX_ACC or G > 256), else 0. */
int pkv_paged_decode(const float *q, int64_t q_stride, int64_t num_rows, int64_t Hq, int64_t Hkv,
                     int64_t D, int64_t Dv, const void *k, int64_t kb, int64_t kt, int64_t kh,
                     const void *v, int64_t vb, int64_t vt, int64_t vh, int64_t block_size,
                     const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens,
                     int64_t window, float scale, float *out, int64_t out_stride, float *lse, int kv_type,
                     float k_scale, float v_scale, int64_t k_group, int64_t v_group) {
    if (Hkv <= 0 || Hq % Hkv || kv_type < KV_F32 || kv_type > KV_FP8_TH16 || D <= 0 || Dv <= 0) return -1;
    int s16 = kv_type == KV_I8_TH16 || kv_type == KV_FP8_TH16;
    if (s16) kv_type = kv_type == KV_I8_TH16 ? KV_I8_TH : KV_FP8_TH;
    int64_t G = Hq / Hkv;
    if (G * Dv > MAX_ACC || G > 256) return -1;
    int quant = kv_type >= KV_I8_TH;
    decode_args a = {q, (const char *)k, (const char *)v, q_stride, Hq, Hkv, G, D, Dv, kb, kt, kh, vb, vt, vh,
                     block_size, bt_stride, window, block_table, seq_lens, scale, out, lse, out_stride,
                     kv_type, kv_type == KV_F32 ? 4 : kv_type <= KV_F16 ? 2 : 1,
                     1.0f, 1.0f, D, Dv, D, Dv, 0, 0, s16};
    if (quant) {
        int e4m3 = kv_type == KV_FP8_TH || kv_type == KV_FP8_E4M3;
        int tensor = kv_type == KV_FP8_E4M3 || kv_type == KV_FP8_E5M2;
        a.kmul = (tensor ? k_scale : 1.0f) * (e4m3 ? 256.0f : 1.0f);
        a.vmul = (tensor ? v_scale : 1.0f) * (e4m3 ? 256.0f : 1.0f);
        if (kv_type == KV_I4_GROUP) {
            if (k_group <= 0 || v_group <= 0 || D % k_group || Dv % v_group || (k_group % 16 && k_group != D) ||
                (v_group % 16 && v_group != Dv) || (D + 15) / 16 > MAXG || (Dv + 15) / 16 > MAXG)
                return -1;
            a.kgroup = k_group;
            a.vgroup = v_group;
        }
        a.kvals = kv_is_int4(kv_type) ? (D + 1) / 2 : D;
        a.vvals = kv_is_int4(kv_type) ? (Dv + 1) / 2 : Dv;
        int64_t ks = kv_type == KV_I4_GROUP ? 2 * (D / a.kgroup) : kv_token_scaled(kv_type) ? (s16 ? 2 : 4) : 0;
        int64_t vs = kv_type == KV_I4_GROUP ? 2 * (Dv / a.vgroup) : kv_token_scaled(kv_type) ? (s16 ? 2 : 4) : 0;
        a.kpart = a.kvals + ks;
        a.vpart = a.vvals + vs;
    }
    void (*item)(const decode_args *, int64_t, int64_t, int64_t) = quant ? decode_item_q : decode_item;
    int threads = omp_get_max_threads();
    if (num_rows >= 2 * threads && Hq * Dv <= MAX_ACC && Hq <= 256) {
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t r = 0; r < num_rows; r++) item(&a, r, 0, Hkv);
    } else {
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
        for (int64_t r = 0; r < num_rows; r++)
            for (int64_t hk = 0; hk < Hkv; hk++) item(&a, r, hk, hk + 1);
    }
    return 0;
}

/* ------------------------------------------------------------ whole-layer decode step
 *
 * pkv_decode_layers runs every decoder layer of a plain Llama-family model (Llama, Mistral,
 * Qwen2) for the M <= 16 rows of one decode step in ONE call, then the final RMSNorm: per layer
 * RMSNorm -> fused qkv GEMV (+ bias) -> RoPE (rotate-half, cos/sin rows of a precomputed table)
 * -> K/V written to the paged cache at the slot mapping -> paged decode attention (decode_item
 * above) -> o_proj -> residual -> RMSNorm -> gate_up GEMV fused with SiLU*mul -> down ->
 * residual. Why: at batch 1 the ~300 small torch ops and ctypes calls of a step cost as much as
 * its GEMVs; here they are a few microseconds of C.
 *
 * One OpenMP team for the whole step. GEMV output columns and (row, KV head) attention items
 * are shared out with `omp for` (items that do not share evenly among the threads are cut
 * along long rows' keys and merged by log-sum-exp); the cheap row-wise glue (residual adds,
 * norms) is done by every thread on its own copy of the residual stream, which saves a
 * barrier per op and gives identical values on every thread (same code, same order).
 *
 * Float32 math. The GEMVs are exactly pkv_gemv_q's (bit-identical results for the ggml rows),
 * RoPE rounds its products and sums separately like RotaryEmbedding.apply (bit-identical), the
 * K/V writes round like torch's .to(bfloat16/float16) (bit-identical cache contents); norms
 * and SiLU differ from torch's only in summation order / exp ulps. */

enum { STEP_F32 = 0, STEP_MAX_SEGS = 8, STEP_MAX_M = 16, STEP_COLS = 16, STEP_SECTIONS = 6 };

typedef struct {
    int64_t start, end;    /* output rows [start, end) of the layer held by this segment */
    const uint8_t *w;      /* its (end - start) rows of ggml blocks, row_stride bytes apart */
    int64_t row_stride;
    int32_t qtype, pad_;
} pkv_segment;

typedef struct {
    int64_t N, K;
    const float *dense;    /* float32 [N, K] (ldw floats a row): used without segments or above max_rows */
    int64_t ldw;
    const float *bias;     /* [N] or NULL */
    int32_t nseg, max_rows;
    pkv_segment seg[STEP_MAX_SEGS];
} pkv_linear;

typedef struct {
    const float *input_norm, *post_norm;   /* [H] */
    pkv_linear qkv, o, gate_up, down;      /* qkv: [q | k | v] rows; gate_up: [gate | up] */
    void *k_cache, *v_cache;               /* [NB, BS, Hkv, D] of kv_type; strides in elements */
    int64_t kb, kt, kh, vb, vt, vh;
    int64_t window;                        /* sliding window (0: none) */
} pkv_layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t block_size, num_slots;         /* num_slots = NB * BS: every slot must lie below */
    int64_t max_pos;                       /* rows of the rope table */
    const float *rope;                     /* [max_pos, head_dim]: cos | sin (head_dim / 2 each) */
    int64_t vocab;
    const float *embed;                    /* [vocab, H] token embeddings */
    const float *final_norm;               /* [H] */
    const pkv_layer *layers;
    float eps, scale;
    int32_t kv_type, pad_;
} pkv_model;

/* sizeof of the structs above (which = 0..3), so the ctypes mirrors can check their layout. */
int64_t pkv_step_struct_size(int which) {
    switch (which) {
        case 0: return (int64_t)sizeof(pkv_segment);
        case 1: return (int64_t)sizeof(pkv_linear);
        case 2: return (int64_t)sizeof(pkv_layer);
        case 3: return (int64_t)sizeof(pkv_model);
        default: return -1;
    }
}

/* Float32 rows: y[m*ldy + c] = x[m] . w[c] for c < nc, m < M (w: nc rows, ldw floats apart). */
static void dense_cols(const float *w, int64_t ldw, int64_t K, const float *x, int64_t M, int64_t nc, float *y,
                       int64_t ldy) {
#if defined(__AVX512F__)
    if (M == 1) {  /* four rows a pass, two chains each: the x loads are shared */
        for (int64_t c = 0; c < nc; c += 4) {
            int R = nc - c >= 4 ? 4 : (int)(nc - c);
            __m512 a0[4], a1[4];
            for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();
            int64_t k = 0;
            for (; k + 32 <= K; k += 32) {
                __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16);
                for (int r = 0; r < R; r++) {
                    const float *wr = w + (c + r) * ldw + k;
                    a0[r] = _mm512_fmadd_ps(_mm512_loadu_ps(wr), x0, a0[r]);
                    a1[r] = _mm512_fmadd_ps(_mm512_loadu_ps(wr + 16), x1, a1[r]);
                }
            }
            for (; k < K; k += 16) {
                __mmask16 mk = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
                __m512 x0 = _mm512_maskz_loadu_ps(mk, x + k);
                for (int r = 0; r < R; r++)
                    a0[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, w + (c + r) * ldw + k), x0, a0[r]);
            }
            for (int r = 0; r < R; r++) y[c + r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
        }
        return;
    }
    for (int64_t c = 0; c < nc; c++) {
        __m512 acc[STEP_MAX_M];
        for (int64_t m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16) {
            __mmask16 mk = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
            __m512 wv = _mm512_maskz_loadu_ps(mk, w + c * ldw + k);
            for (int64_t m = 0; m < M; m++)
                acc[m] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mk, x + m * K + k), acc[m]);
        }
        for (int64_t m = 0; m < M; m++) y[m * ldy + c] = _mm512_reduce_add_ps(acc[m]);
    }
#elif PKV_AVX2
    const int64_t K16 = K / 16 * 16;
    __m256 acc[2 * STEP_MAX_M];
    for (int64_t c = 0; c < nc; c++) {
        const float *wc = w + c * ldw;
        for (int64_t i = 0; i < 2 * M; i++) acc[i] = _mm256_setzero_ps();
        dot_rows_avx2(wc, K16, x, M, K, acc);  /* four rows of x a pass over the weight row */
        for (int64_t m = 0; m < M; m++) {
            float t = hsum8(_mm256_add_ps(acc[2 * m], acc[2 * m + 1]));
            for (int64_t k = K16; k < K; k++) t += wc[k] * x[m * K + k];
            y[m * ldy + c] = t;
        }
    }
#else
    for (int64_t c = 0; c < nc; c++)
        for (int64_t m = 0; m < M; m++) {
            float acc[16] = {0};  /* 16 independent lanes: the compiler vectorises them */
            const float *wr = w + c * ldw, *xm = x + m * K;
            int64_t k = 0;
            for (; k + 16 <= K; k += 16)
                for (int l = 0; l < 16; l++) acc[l] += wr[k + l] * xm[k + l];
            float s = 0.0f;
            for (int l = 0; l < 16; l++) s += acc[l];
            for (; k < K; k++) s += wr[k] * xm[k];
            y[m * ldy + c] = s;
        }
#endif
}

/* ggml rows of one type: y[m*ldy + c] for c < nc, as pkv_gemv_q computes them. */
static void quant_cols(int qtype, const uint8_t *rows, int64_t stride, int64_t K, const float *x, int64_t M,
                       int64_t nc, float *y, int64_t ldy) {
    int bb = pkv_block_bytes(qtype), bw = pkv_block_weights(qtype);
    int64_t nblocks = K / bw, c = 0;
#if defined(__AVX512F__) || PKV_AVX2
    if (M == 1 && bw == QK) {
        for (; c + 4 <= nc; c += 4) gemv4_m1(qtype, x, nblocks, rows + c * stride, stride, bb, y + c);
        for (; c < nc; c++) gemv1_m1(qtype, x, nblocks, rows + c * stride, bb, y + c);
        return;
    }
#endif
    float out[MAX_M * GEMV_COLS];
    for (; c < nc; c += GEMV_COLS) {
        int n = nc - c < GEMV_COLS ? (int)(nc - c) : GEMV_COLS;
        gemv_block(qtype, x, M, K, nblocks, rows + c * stride, stride, bb, n, out);
        for (int64_t m = 0; m < M; m++)
            for (int j = 0; j < n; j++) y[m * ldy + c + j] = out[m * GEMV_COLS + j];
    }
}

/* Output columns [n0, n1) of x [M, K] @ W^T (+ bias): y[m*ldy + (n - n0)]. */
static void linear_cols(const pkv_linear *L, const float *x, int64_t M, int64_t n0, int64_t n1, float *y,
                        int64_t ldy) {
    if (L->nseg == 0 || M > L->max_rows) {
        dense_cols(L->dense + n0 * L->ldw, L->ldw, L->K, x, M, n1 - n0, y, ldy);
    } else {
        for (int s = 0; s < L->nseg; s++) {
            const pkv_segment *g = &L->seg[s];
            int64_t a = n0 > g->start ? n0 : g->start, b = n1 < g->end ? n1 : g->end;
            if (a < b) quant_cols(g->qtype, g->w + (a - g->start) * g->row_stride, g->row_stride, L->K, x, M, b - a,
                                  y + (a - n0), ldy);
        }
    }
    if (L->bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = n0; n < n1; n++) y[m * ldy + n - n0] += L->bias[n];
}

/* y = x @ W^T for all N columns, columns shared out among the team (ends with a barrier). */
static void linear_team(const pkv_linear *L, const float *x, int64_t M, float *y) {
    int64_t groups = (L->N + 3) / 4;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        int64_t n0 = 4 * g, n1 = n0 + 4 < L->N ? n0 + 4 : L->N;
        linear_cols(L, x, M, n0, n1, y + n0, L->N);
    }
}

/* HF RMSNorm of M rows: y = (x * (1 / sqrt(mean(x^2) + eps))) * w. */
static void rms_norm_rows(const float *x, const float *w, int64_t M, int64_t H, float eps, float *y) {
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * H;
        float *ym = y + m * H, acc[16] = {0}, s = 0.0f;
        int64_t i = 0;
        for (; i + 16 <= H; i += 16)
            for (int l = 0; l < 16; l++) acc[l] += xm[i + l] * xm[i + l];
        for (int l = 0; l < 16; l++) s += acc[l];
        for (; i < H; i++) s += xm[i] * xm[i];
        float r = 1.0f / sqrtf(s / (float)H + eps);
        for (i = 0; i < H; i++) ym[i] = (xm[i] * r) * w[i];
    }
}

/* out[j] = silu(g[j]) * u[j] = g / (1 + exp(-g)) * u, j < n (torch's formula). */
static void silu_mul(const float *g, const float *u, int64_t n, float *out) {
    int64_t j = 0;
#if PKV_ATTN_AVX512
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; j < n; j += 16) {
        __mmask16 mk = lanes(n - j);
        __m512 gv = _mm512_maskz_loadu_ps(mk, g + j);
        __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, e));
        _mm512_mask_storeu_ps(out + j, mk, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(mk, u + j)));
    }
#elif PKV_AVX2
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; j + 8 <= n; j += 8) {
        __m256 gv = _mm256_loadu_ps(g + j);
        __m256 sv = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
        _mm256_storeu_ps(out + j, _mm256_mul_ps(sv, _mm256_loadu_ps(u + j)));
    }
#endif
    for (; j < n; j++) out[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
}

/* float32 -> float16 bits, round to nearest even, exactly as torch converts (F16C-free, so
 * every build gives the same bits): M. Dukhan's float arithmetic trick (FP16 library). */
static inline uint16_t fp32_to_fp16(float f) {
    uint32_t w, bits;
    memcpy(&w, &f, 4);
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t shl1_w = w + w, sign = w & 0x80000000u, bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    uint32_t bb = (bias >> 1) + 0x07800000u;
    float fb;
    memcpy(&fb, &bb, 4);
    base = fb + base;
    memcpy(&bits, &base, 4);
    uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

/* float32 -> bfloat16 bits, round to nearest even (c10::BFloat16's rounding; NaN -> 0x7FC0). */
static inline uint16_t fp32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* n float32 values into the cache element type at dst. */
static void store_kv(const float *src, int64_t n, int kvt, void *dst) {
    if (kvt == KV_F32) {
        memcpy(dst, src, n * sizeof(float));
        return;
    }
    uint16_t *d = (uint16_t *)dst;
    for (int64_t i = 0; i < n; i++) d[i] = kvt == KV_BF16 ? fp32_to_bf16(src[i]) : fp32_to_fp16(src[i]);
}

/* Rotate-half RoPE of one head x[D] in place with cos cs[0:D/2], sin cs[D/2:D]. */
static inline void rope_head(float *x, const float *cs, int64_t D) {
    int64_t h = D / 2;
    for (int64_t i = 0; i < h; i++) {
        float a = x[i], b = x[i + h], c = cs[i], s = cs[h + i];
        x[i] = a * c - b * s;
        x[i + h] = b * c + a * s;
    }
}

/* Row r, KV heads [h0, h1): rotate the q heads they serve and their k heads, and write k/v at
 * the row's slot. q/k/v of the row sit at qkv + r * ld. */
static void rope_and_cache(const pkv_model *m, const pkv_layer *L, const decode_args *a, float *qkv, int64_t ld,
                           const int64_t *positions, const int64_t *slots, int64_t r, int64_t h0, int64_t h1) {
    const int64_t D = m->head_dim, Hq = m->num_heads, Hkv = m->num_kv_heads, G = Hq / Hkv;
    float *row = qkv + r * ld;
    const float *cs = m->rope + positions[r] * D;
    for (int64_t h = h0 * G; h < h1 * G; h++) rope_head(row + h * D, cs, D);
    int64_t slot = slots[r], esz = a->esz;
    for (int64_t hk = h0; hk < h1; hk++) {
        float *k = row + (Hq + hk) * D, *v = row + (Hq + Hkv + hk) * D;
        rope_head(k, cs, D);
        if (slot >= 0) {
            int64_t blk = slot / m->block_size, tok = slot % m->block_size;
            store_kv(k, D, m->kv_type, (char *)L->k_cache + (blk * L->kb + tok * L->kt + hk * L->kh) * esz);
            store_kv(v, D, m->kv_type, (char *)L->v_cache + (blk * L->vb + tok * L->vt + hk * L->vh) * esz);
        }
    }
}

/* KV splits per (row, KV head) item: 1, or, when those items do not share evenly among the
 * threads (batch 1 of 3 KV heads on 2 threads leaves one idle a third of the time), the fewest
 * that make them share evenly, each split keeping >= STEP_SPLIT_MIN keys of every row. */
enum { STEP_SPLIT_MIN = 128, STEP_MAX_SPLITS = 4 };
static int64_t kv_splits(int64_t items, int threads, int64_t M, const int32_t *seq_lens, int64_t window) {
    int64_t S = 1;
    while (S <= STEP_MAX_SPLITS && (items * S) % threads) S++;
    if (S == 1 || S > STEP_MAX_SPLITS) return 1;
    for (int64_t r = 0; r < M; r++) {
        int64_t len = seq_lens[r], keys = window > 0 && len > window ? window : len;
        if (keys < S * STEP_SPLIT_MIN) return 1;
    }
    return S;
}

/* Split s of S of row r's keys, KV heads [h0, h1), into part_out/part_lse (slot s): the same
 * decode_item over a sub-range, expressed as a row of length t1 with a window of t1 - t0. */
static void attend_split(const decode_args *a, int64_t r, int64_t h0, int64_t h1, int64_t s, int64_t S,
                         int64_t M, float *part_out, float *part_lse) {
    int64_t len = a->seq_lens[r], first = (a->window > 0 && len > a->window) ? len - a->window : 0;
    int64_t t0 = first + (len - first) * s / S, t1 = first + (len - first) * (s + 1) / S;
    int32_t lens[STEP_MAX_M];
    decode_args b = *a;
    lens[r] = (int32_t)t1;
    b.seq_lens = lens;
    b.window = t1 - t0;
    b.out = part_out + s * M * a->out_stride;
    b.lse = part_lse + s * M * a->Hq;
    decode_item(&b, r, h0, h1);
}

/* attn[r, h] from the S splits' normalised outputs and log-sum-exps (flash-decoding's merge). */
static void merge_splits(const decode_args *a, int64_t r, int64_t h, int64_t S, int64_t M, const float *part_out,
                         const float *part_lse) {
    const int64_t Dv = a->Dv, o_at = r * a->out_stride + h * Dv, l_at = r * a->Hq + h;
    float mx = -INFINITY, w[STEP_MAX_SPLITS], total = 0.0f;
    for (int64_t s = 0; s < S; s++) mx = fmaxf(mx, part_lse[s * M * a->Hq + l_at]);
    for (int64_t s = 0; s < S; s++) total += w[s] = expf(part_lse[s * M * a->Hq + l_at] - mx);
    float *o = a->out + o_at;
    for (int64_t c = 0; c < Dv; c++) {
        float acc = 0.0f;
        for (int64_t s = 0; s < S; s++) acc += w[s] * part_out[s * M * a->out_stride + o_at + c];
        o[c] = acc / total;
    }
}

/* The whole layer stack for M (1..16) decode rows of token ids[M] (int64, < vocab): writes x
 * [M, hidden] float32, the final RMSNorm of the last residual stream (LlamaModel.forward's
 * result). positions [M] int64 (each < max_pos), slots [M] int64 (< num_slots; negative: not
 * written), block_table [M, bt_stride] int32, seq_lens [M] int32 (>= 1, = position + 1 in a
 * decode step): the layers' shared attention metadata. prof: NULL, or STEP_SECTIONS doubles
 * to which thread 0 adds the seconds it spent in each section (barrier waits included):
 * norms and residual adds, qkv GEMV, RoPE + cache write + attention, o_proj GEMV, gate_up GEMV
 * + SiLU*mul, down GEMV. Returns 0; or, having touched nothing, -1 for a shape the kernel does
 * not cover and -2 for an argument out of range. */
int pkv_decode_layers(const pkv_model *m, int64_t M, const int64_t *ids, float *x, const int64_t *positions,
                      const int64_t *slots, const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens,
                      double *prof) {
    const int64_t H = m->hidden, Hq = m->num_heads, Hkv = m->num_kv_heads, D = m->head_dim, I = m->intermediate;
    if (M < 1 || M > STEP_MAX_M || Hkv <= 0 || Hq % Hkv || D <= 0 || D % 2 || m->kv_type < KV_F32 ||
        m->kv_type > KV_F16 || (Hq / Hkv) * D > MAX_ACC || Hq / Hkv > 256)
        return -1;
    for (int64_t r = 0; r < M; r++)
        if (ids[r] < 0 || ids[r] >= m->vocab || positions[r] < 0 || positions[r] >= m->max_pos ||
            slots[r] >= m->num_slots || seq_lens[r] < 1)
            return -2;
    const int64_t G = Hq / Hkv, ld = (Hq + 2 * Hkv) * D;
    const int threads = omp_get_max_threads();
    /* Per row items (all KV heads) once rows are plenty, as pkv_paged_decode splits its work. */
    const int by_row = M >= 2 * threads && Hq * D <= MAX_ACC && Hq <= 256;
    const int64_t items = by_row ? M : M * Hkv;
    size_t split_out = (size_t)(STEP_MAX_SPLITS * M * Hq * D), split_lse = (size_t)(STEP_MAX_SPLITS * M * Hq);
    size_t shared = (size_t)(M * ld + M * Hq * D + M * H + M * I) + split_out + split_lse, own = (size_t)(2 * M * H);
    float *buf = (float *)malloc((shared + own * threads) * sizeof(float));
    if (!buf) return -1;
    float *qkv = buf, *attn = qkv + M * ld, *proj = attn + M * Hq * D, *act = proj + M * H;
    float *part_out = act + M * I, *part_lse = part_out + split_out;
#pragma omp parallel num_threads(threads)
    {
        float *res = buf + shared + own * omp_get_thread_num(), *hn = res + M * H;
        for (int64_t r = 0; r < M; r++) memcpy(res + r * H, m->embed + ids[r] * H, H * sizeof(float));
        double *clock = omp_get_thread_num() == 0 ? prof : NULL, mark = clock ? omp_get_wtime() : 0.0;
#define STEP_MARK(i) if (clock) { double t_ = omp_get_wtime(); clock[i] += t_ - mark; mark = t_; }
        for (int64_t l = 0; l < m->num_layers; l++) {
            const pkv_layer *L = &m->layers[l];
            decode_args a = {.q = qkv, .k = (const char *)L->k_cache, .v = (const char *)L->v_cache,
                             .q_stride = ld, .Hq = Hq, .Hkv = Hkv, .G = G, .D = D, .Dv = D,
                             .kb = L->kb, .kt = L->kt, .kh = L->kh, .vb = L->vb, .vt = L->vt, .vh = L->vh,
                             .block_size = m->block_size, .bt_stride = bt_stride, .window = L->window,
                             .block_table = block_table, .seq_lens = seq_lens, .scale = m->scale, .out = attn,
                             .lse = NULL, .out_stride = Hq * D, .kvt = m->kv_type,
                             .esz = m->kv_type == KV_F32 ? 4 : 2, .kmul = 1.0f, .vmul = 1.0f,
                             .kgroup = D, .vgroup = D, .kvals = D, .vvals = D, .kpart = D, .vpart = D};
            rms_norm_rows(res, L->input_norm, M, H, m->eps, hn);
            STEP_MARK(0)
            linear_team(&L->qkv, hn, M, qkv);
            STEP_MARK(1)
            const int64_t S = by_row ? 1 : kv_splits(items, threads, M, seq_lens, L->window);
            if (S == 1) {
#pragma omp for schedule(dynamic, 1)
                for (int64_t it = 0; it < items; it++) {
                    int64_t r = by_row ? it : it / Hkv, h0 = by_row ? 0 : it % Hkv, h1 = by_row ? Hkv : h0 + 1;
                    rope_and_cache(m, L, &a, qkv, ld, positions, slots, r, h0, h1);
                    decode_item(&a, r, h0, h1);  /* reads the new key back from the cache, as torch does */
                }
            } else {  /* q rotated and k/v written before any split reads them; then merged */
#pragma omp for schedule(static)
                for (int64_t it = 0; it < items; it++)
                    rope_and_cache(m, L, &a, qkv, ld, positions, slots, it / Hkv, it % Hkv, it % Hkv + 1);
#pragma omp for schedule(dynamic, 1)
                for (int64_t it = 0; it < items * S; it++) {
                    int64_t hk = it / S % Hkv;
                    attend_split(&a, it / S / Hkv, hk, hk + 1, it % S, S, M, part_out, part_lse);
                }
#pragma omp for schedule(static)
                for (int64_t it = 0; it < M * Hq; it++) merge_splits(&a, it / Hq, it % Hq, S, M, part_out, part_lse);
            }
            STEP_MARK(2)
            linear_team(&L->o, attn, M, proj);
            STEP_MARK(3)
            for (int64_t i = 0; i < M * H; i++) res[i] += proj[i];
            rms_norm_rows(res, L->post_norm, M, H, m->eps, hn);
            STEP_MARK(0)
            /* gate_up and SiLU*mul: each item computes matching gate and up columns. */
#pragma omp for schedule(static)
            for (int64_t j0 = 0; j0 < I; j0 += STEP_COLS) {
                int64_t j1 = j0 + STEP_COLS < I ? j0 + STEP_COLS : I;
                float g[STEP_MAX_M * STEP_COLS], u[STEP_MAX_M * STEP_COLS];
                linear_cols(&L->gate_up, hn, M, j0, j1, g, STEP_COLS);
                linear_cols(&L->gate_up, hn, M, I + j0, I + j1, u, STEP_COLS);
                for (int64_t r = 0; r < M; r++) silu_mul(g + r * STEP_COLS, u + r * STEP_COLS, j1 - j0, act + r * I + j0);
            }
            STEP_MARK(4)
            linear_team(&L->down, act, M, proj);
            STEP_MARK(5)
            for (int64_t i = 0; i < M * H; i++) res[i] += proj[i];
        }
#pragma omp barrier
        if (omp_get_thread_num() == 0) rms_norm_rows(res, m->final_norm, M, H, m->eps, x);
        STEP_MARK(0)
#undef STEP_MARK
    }
    free(buf);
    return 0;
}
