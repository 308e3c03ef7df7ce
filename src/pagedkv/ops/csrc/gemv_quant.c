/* Quantized GEMV: y = x @ W^T (+ bias) straight from ggml rows (pkv_gemv_q), batch-1 row
 * kernels and many-row column passes per ISA, and pkv_dequant.
 * Part of the unity build: compiled only as included by cpu_kernels.c (see there), after
 * ggml_blocks.c. */
#include "isa.h"

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
