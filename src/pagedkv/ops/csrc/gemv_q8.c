/* Integer-dot GEMV over activations quantized to 8-bit blocks: the GGUF models' opt-in
 * `gguf_activations="q8"` mode, llama.cpp's own decode arithmetic (ggml_vec_dot_q4_0_q8_0,
 * q4_1_q8_1, q8_0_q8_0; vLLM's GGUF kernels do the same on GPUs).
 *
 * Why: the exact path (gemv_quant.c) widens every 4-bit weight to float32 and multiplies in
 * float32. On a CPU whose FMA units are half as wide as its registers (Zen 1) that is
 * compute-bound at ~3.8 GB/s of Q4_1 weights, far under the memory's rate. Here each row of x is
 * quantized once per linear to int8 blocks, and a 32-weight block's dot product is integer
 * multiply-adds (vpmaddubsw, vpmaddwd) on its packed quants, one conversion and one FMA.
 *
 * Arithmetic (the contract the tests check against a numpy model of it): block b of a row of x
 * (32 values) has d_b = max|x| / 127 (float32) and q_i = nearest-even(x_i * (1 / d_b)) (0 when
 * d_b = 0), s_b = d_b * sum_i q_i. A weight block (scale dw, Q4_1 min mw, quants u_i) gives
 *   Q4_1: dw * d_b * sum_i u_i q_i + mw * s_b      Q4_0: dw * d_b * sum_i (u_i - 8) q_i
 *   Q8_0: dw * d_b * sum_i u_i q_i
 * the integer sums exact, the rest float32 in an unspecified order. The result differs from the
 * exact path's by the activations' rounding (about 0.4% of a block's largest value): the greedy
 * outputs are llama.cpp's kind, not transformers' (the exact path stays the default).
 * Part of the unity build: compiled only as included by cpu_kernels.c (see there), after
 * gemv_quant.c. */
#include "isa.h"

/* The SIMD build: AVX2 (vpmaddubsw) with F16C for the weights' scales (AVX-512 CPUs have both). */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PKV_Q8_SIMD 1
#else
#define PKV_Q8_SIMD 0
#endif

/* M rows of activations quantized in 32-value blocks: row m's quants at q + m*K; its block
 * scales and sums interleaved at ds + m*2*nbp: ds[2b] = d_b, ds[2b+1] = s_b, zero past block nb
 * up to nbp (nb rounded up to 8), so eight blocks' pairs are two 8-float loads that match
 * block_scales8's (d, m) pairs lane for lane (and a tail's missing blocks multiply zeros). */
typedef struct {
    int8_t *q;
    float *ds;
    int64_t K, nb, nbp;
} q8_rows;

/* Blocks of a row of K values, rounded up to 8 (the (d, s) pairs' row stride). */
static inline int64_t q8_nbp(int64_t K) { return (K / QK + 7) / 8 * 8; }

/* Bytes a q8_rows of M rows of K values needs (q, then ds; float-aligned). */
static inline size_t q8_rows_bytes(int64_t M, int64_t K) {
    return (size_t)(M * K) + 2 * sizeof(float) * (size_t)(M * q8_nbp(K)) + 64;
}

/* q8_rows over `mem` (q8_rows_bytes(M, K) bytes). */
static inline q8_rows q8_rows_at(void *mem, int64_t M, int64_t K) {
    q8_rows r = {.q = (int8_t *)mem, .K = K, .nb = K / QK, .nbp = q8_nbp(K)};
    r.ds = (float *)(((uintptr_t)(r.q + M * K) + 63) & ~(uintptr_t)63);
    return r;
}

/* The 32-weight types this path reads. */
static inline int q8_type(int qtype) { return qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0; }

/* Quantize x [M, K] (K % 32 == 0) into xa (made for K). */
static void q8_quantize(const float *x, int64_t M, int64_t K, q8_rows *xa) {
    const int64_t nb = K / QK;
    for (int64_t m = 0; m < M; m++) {
        float *ds = xa->ds + m * 2 * xa->nbp;
        for (int64_t b = 2 * nb; b < 2 * xa->nbp; b++) ds[b] = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + m * K + b * QK;
            int8_t *q = xa->q + m * K + b * QK;
#if PKV_Q8_SIMD
            const __m256 sign = _mm256_set1_ps(-0.0f);
            __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16),
                   v3 = _mm256_loadu_ps(v + 24);
            __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                      _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            float d = _mm_cvtss_f32(h) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            __m256 s = _mm256_set1_ps(id);
            /* cvtps rounds to nearest even (the default MXCSR mode), as nearbyintf below */
            __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, s)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, s));
            __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, s)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, s));
            __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
            /* packs interleave the 128-bit lanes; the permute puts the 32 bytes back in order */
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
            p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)q, p);
            ds[2 * b] = d;
            ds[2 * b + 1] = d * (float)_mm_cvtsi128_si32(s4);
#else
            float amax = 0.0f;
            for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
            float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            for (int i = 0; i < QK; i++) sum += q[i] = (int8_t)nearbyintf(v[i] * id);
            ds[2 * b] = d;
            ds[2 * b + 1] = d * (float)sum;
#endif
        }
    }
}

#if PKV_Q8_SIMD
/* Sum of w_i * x_i over one 32-value block, as 4 float lanes (exact integers: |sum| < 2^24).
 * 128-bit halves throughout: on CPUs that split 256-bit operations (Zen 1) the 4-bit types then
 * add the halves' int16 pair sums before widening (at most 2 * 2 * 15 * 127 < 2^15), saving a
 * widening, a conversion and an FMA a block; elsewhere it costs no more. vpmaddubsw takes an
 * unsigned left operand, so signed weights (Q4_0 less 8, Q8_0) give their magnitude and lend
 * their sign to x (llama.cpp's trick); its pair sums stay below 2 * 128 * 127 < 2^15. Q4_0 and
 * Q8_0 widen each half to int32 before adding (their pair sums may not add in int16). */
ALWAYS_INLINE __m128 block_dot4(int qtype, const uint8_t *blk, const int8_t *xq) {
    const __m128i ones = _mm_set1_epi16(1), low = _mm_set1_epi8(0x0F);
    __m128i x0 = _mm_loadu_si128((const __m128i *)xq), x1 = _mm_loadu_si128((const __m128i *)(xq + 16)), w0, w1;
    if (qtype == Q8_0) {
        w0 = _mm_loadu_si128((const __m128i *)(blk + 2));
        w1 = _mm_loadu_si128((const __m128i *)(blk + 18));
    } else {
        __m128i t = _mm_loadu_si128((const __m128i *)(blk + (qtype == Q4_1 ? 4 : 2)));
        w0 = _mm_and_si128(t, low);
        w1 = _mm_and_si128(_mm_srli_epi16(t, 4), low);
        if (qtype == Q4_1)
            return _mm_cvtepi32_ps(
                _mm_madd_epi16(_mm_add_epi16(_mm_maddubs_epi16(w0, x0), _mm_maddubs_epi16(w1, x1)), ones));
        w0 = _mm_sub_epi8(w0, _mm_set1_epi8(8));
        w1 = _mm_sub_epi8(w1, _mm_set1_epi8(8));
    }
    __m128i p0 = _mm_maddubs_epi16(_mm_sign_epi8(w0, w0), _mm_sign_epi8(x0, w0));
    __m128i p1 = _mm_maddubs_epi16(_mm_sign_epi8(w1, w1), _mm_sign_epi8(x1, w1));
    return _mm_cvtepi32_ps(_mm_add_epi32(_mm_madd_epi16(p0, ones), _mm_madd_epi16(p1, ones)));
}

static inline float hsum4(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* R weight rows (`stride` bytes apart) against the MR quantized rows from m0, R*MR <= 4
 * accumulators (constants once inlined): y[(m0+m)*ldy + r]. At batch 1, R = 4 weight rows
 * share each load of x. The blocks go 8 at a time: their float16 (d, m) pairs convert at once
 * (block_scales8) and multiply the rows' (d, s) pairs in two vector products, giving each
 * block's d_w*d_x (even lanes: broadcast from memory, a load, in the FMA loop) and Q4_1's
 * m_w*s_x (odd lanes: summed as vectors, the even lanes masked off at the end). Each weight
 * row prefetches 4 KB ahead, once a cache line (as gemv_rows_m1). */
ALWAYS_INLINE void q8_tile(int qtype, const int R, const int MR, const q8_rows *xa, int64_t m0, const uint8_t *row,
                           int64_t stride, int bb, float *y, int64_t ldy) {
    __m128 acc[4];
    __m256 msum[4];
    for (int i = 0; i < R * MR; i++) acc[i] = _mm_setzero_ps(), msum[i] = _mm256_setzero_ps();
    const int64_t nb = xa->nb;
    for (int64_t k0 = 0; k0 < nb; k0 += 8) {
        const int64_t kn = nb - k0 < 8 ? nb - k0 : 8;
        float sc[4][16];
        for (int r = 0; r < R; r++) {
            const uint8_t *b = row + r * stride + k0 * bb;
            float dm[16];
            block_scales8(b, bb, kn, dm);
            for (int64_t l = 0; l < kn * bb; l += 64) _mm_prefetch((const char *)b + 4096 + l, _MM_HINT_T0);
            __m256 lo = _mm256_loadu_ps(dm), hi = _mm256_loadu_ps(dm + 8);
            for (int m = 0; m < MR; m++) {
                const float *ds = xa->ds + (m0 + m) * 2 * xa->nbp + 2 * k0;
                __m256 p0 = _mm256_mul_ps(lo, _mm256_loadu_ps(ds)), p1 = _mm256_mul_ps(hi, _mm256_loadu_ps(ds + 8));
                _mm256_storeu_ps(sc[r * MR + m], p0);
                _mm256_storeu_ps(sc[r * MR + m] + 8, p1);
                if (qtype == Q4_1) msum[r * MR + m] = _mm256_add_ps(msum[r * MR + m], _mm256_add_ps(p0, p1));
            }
        }
        for (int64_t j = 0; j < kn; j++) {
            const int64_t b = k0 + j;
            for (int r = 0; r < R; r++) {
                const uint8_t *blk = row + r * stride + b * bb;
                for (int m = 0; m < MR; m++) {
                    __m128 p = block_dot4(qtype, blk, xa->q + (m0 + m) * xa->K + b * QK);
                    acc[r * MR + m] = _mm_fmadd_ps(_mm_broadcast_ss(&sc[r * MR + m][2 * j]), p, acc[r * MR + m]);
                }
            }
        }
    }
    const __m256 odd = _mm256_castsi256_ps(_mm256_setr_epi32(0, -1, 0, -1, 0, -1, 0, -1));
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MR; m++) {
            float t = hsum4(acc[r * MR + m]);
            if (qtype == Q4_1) t += hsum8(_mm256_and_ps(msum[r * MR + m], odd));
            y[(m0 + m) * ldy + r] = t;
        }
}

/* q8_cols for one (constant, once inlined) qtype. */
ALWAYS_INLINE void q8_cols_t(int qtype, const uint8_t *rows, int64_t stride, const q8_rows *xa, int64_t M,
                             int64_t nc, float *y, int64_t ldy) {
    int bb = pkv_block_bytes(qtype);
    int64_t c = 0;
    if (M == 1) {
        for (; c + 4 <= nc; c += 4) q8_tile(qtype, 4, 1, xa, 0, rows + c * stride, stride, bb, y + c, ldy);
        for (; c < nc; c++) q8_tile(qtype, 1, 1, xa, 0, rows + c * stride, stride, bb, y + c, ldy);
        return;
    }
    for (; c < nc; c++) {  /* one weight row against four rows of x a pass (its blocks stay in L1) */
        const uint8_t *wr = rows + c * stride;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) q8_tile(qtype, 1, 4, xa, m, wr, 0, bb, y + c, ldy);
        switch (M - m) {
            case 3: q8_tile(qtype, 1, 3, xa, m, wr, 0, bb, y + c, ldy); break;
            case 2: q8_tile(qtype, 1, 2, xa, m, wr, 0, bb, y + c, ldy); break;
            case 1: q8_tile(qtype, 1, 1, xa, m, wr, 0, bb, y + c, ldy); break;
            default: break;
        }
    }
}
#endif

/* y[m*ldy + c] = x_m . w_c for c < nc output columns (ggml rows of qtype, `stride` bytes apart),
 * m < M quantized rows: the arithmetic in this file's header. qtype must pass q8_type. */
static void q8_cols(int qtype, const uint8_t *rows, int64_t stride, const q8_rows *xa, int64_t M, int64_t nc,
                    float *y, int64_t ldy) {
#if PKV_Q8_SIMD
    switch (qtype) {  /* one loop per type: no type tests inside it */
        case Q4_0: q8_cols_t(Q4_0, rows, stride, xa, M, nc, y, ldy); break;
        case Q4_1: q8_cols_t(Q4_1, rows, stride, xa, M, nc, y, ldy); break;
        default: q8_cols_t(Q8_0, rows, stride, xa, M, nc, y, ldy); break;
    }
#else
    const int bb = pkv_block_bytes(qtype);
    for (int64_t c = 0; c < nc; c++)
        for (int64_t m = 0; m < M; m++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < xa->nb; b++) {
                const uint8_t *blk = rows + c * stride + b * bb;
                const int8_t *xq = xa->q + m * xa->K + b * QK;
                float dw = fp16_to_fp32(load_u16(blk));
                int sum = 0;
                for (int i = 0; i < QK; i++) {
                    int u;
                    if (qtype == Q8_0) u = ((const int8_t *)(blk + 2))[i];
                    else {
                        const uint8_t *qs = blk + (qtype == Q4_0 ? 2 : 4);
                        u = (i < 16 ? qs[i] & 15 : qs[i - 16] >> 4) - (qtype == Q4_0 ? 8 : 0);
                    }
                    sum += u * xq[i];
                }
                const float *ds = xa->ds + m * 2 * xa->nbp + 2 * b;
                acc += dw * ds[0] * (float)sum;
                if (qtype == Q4_1) acc += fp16_to_fp32(load_u16(blk + 2)) * ds[1];
            }
            y[m * ldy + c] = acc;
        }
#endif
}

/* x [M, K] quantized into q [M, K] int8 and ds [M, 2*nbp] float32 ((d, s) pairs of each row's
 * blocks, nbp = K/32 rounded up to 8; this file's arithmetic). Returns 0, or -1 when K is not a
 * multiple of 32. For tests: the GEMVs quantize internally. */
int pkv_quantize_q8(const float *x, int64_t M, int64_t K, int8_t *q, float *ds) {
    if (K % QK || M < 0) return -1;
    q8_rows xa = {.q = q, .ds = ds, .K = K, .nb = K / QK, .nbp = q8_nbp(K)};
    q8_quantize(x, M, K, &xa);
    return 0;
}

/* y = x @ W^T (+ bias) with x [M, K] float32 quantized to 8-bit blocks first, W [N, K] ggml rows
 * of a 32-weight type (Q4_0, Q4_1, Q8_0) row_stride bytes apart, y row m at y + m*ldy.
 * Returns 0; -1 for another type, K not a multiple of 32 or no memory. Output columns are
 * shared out statically in groups of four (one forward stream through the weights a thread). */
int pkv_gemv_q8(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, int64_t row_stride,
                const float *bias, float *y, int64_t ldy) {
    if (!q8_type(qtype) || K % QK || M < 1) return -1;
    void *mem = malloc(q8_rows_bytes(M, K));
    if (!mem) return -1;
    q8_rows xa = q8_rows_at(mem, M, K);
    q8_quantize(x, M, K, &xa);
    int64_t groups = (N + 3) / 4;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        int64_t n0 = 4 * g, nc = N - n0 < 4 ? N - n0 : 4;
        q8_cols(qtype, w + n0 * row_stride, row_stride, &xa, M, nc, y + n0, ldy);
        if (bias)
            for (int64_t m = 0; m < M; m++)
                for (int64_t c = 0; c < nc; c++) y[m * ldy + n0 + c] += bias[n0 + c];
    }
    free(mem);
    return 0;
}
