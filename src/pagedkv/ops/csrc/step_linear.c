/* The layer step's linears: output columns of x @ W^T (+ bias) from float32 rows or ggml
 * segments (the GEMV's own kernels), shared out over the step's OpenMP team.
 * Part of the unity build: compiled only as included by cpu_kernels.c (see there), after
 * gemv_quant.c, layer_step.h. */
#include "layer_step.h"

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

/* bfloat16 rows (a bf16 HF model read in place): y[m*ldy + c] = x[m] . float(w[c]), float32 math.
 * A bf16 value is the top half of the float32 with the same bits, so widening is a shift. */
static inline float bf16_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}
#if defined(__AVX512F__)
static inline __m512 bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#elif PKV_AVX2
static inline __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

#if defined(__AVX512F__) || PKV_AVX2
/* How many weight rows ahead to prefetch: at half the bytes a weight, the hardware prefetcher
 * alone left a core at ~6 GB/s of its ~10 (2-core EPYC, AVX2); this brings it to ~9. */
#ifndef PF_ROWS
#define PF_ROWS 8
#endif
/* y[r] = x . w_r for R (constant once inlined: the accumulators then stay in registers) rows,
 * two chains each: the x loads are shared. */
ALWAYS_INLINE void bf16_rows_m1(const int R, const uint16_t *w, int64_t ldw, int64_t K, const float *x, float *y) {
#if defined(__AVX512F__)
    __m512 a0[4], a1[4];
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16);
        for (int r = 0; r < R; r++) {  /* one cache line of each row a pass */
            _mm_prefetch((const char *)(w + (r + PF_ROWS) * ldw + k), _MM_HINT_T0);
            a0[r] = _mm512_fmadd_ps(bf16x16(w + r * ldw + k), x0, a0[r]);
            a1[r] = _mm512_fmadd_ps(bf16x16(w + r * ldw + k + 16), x1, a1[r]);
        }
    }
    for (; k + 16 <= K; k += 16) {
        __m512 x0 = _mm512_loadu_ps(x + k);
        for (int r = 0; r < R; r++) a0[r] = _mm512_fmadd_ps(bf16x16(w + r * ldw + k), x0, a0[r]);
    }
    for (int r = 0; r < R; r++) {
        float t = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
        for (int64_t j = k; j < K; j++) t += bf16_f32(w[r * ldw + j]) * x[j];
        y[r] = t;
    }
#else
    __m256 a0[4], a1[4];
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {  /* one cache line of each row a pass */
        __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
        __m256 x2 = _mm256_loadu_ps(x + k + 16), x3 = _mm256_loadu_ps(x + k + 24);
        for (int r = 0; r < R; r++) {
            const uint16_t *wr = w + r * ldw + k;
            _mm_prefetch((const char *)(wr + PF_ROWS * ldw), _MM_HINT_T0);
            a0[r] = _mm256_fmadd_ps(bf16x8(wr), x0, a0[r]);
            a1[r] = _mm256_fmadd_ps(bf16x8(wr + 8), x1, a1[r]);
            a0[r] = _mm256_fmadd_ps(bf16x8(wr + 16), x2, a0[r]);
            a1[r] = _mm256_fmadd_ps(bf16x8(wr + 24), x3, a1[r]);
        }
    }
    for (; k + 16 <= K; k += 16) {
        __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
        for (int r = 0; r < R; r++) {
            a0[r] = _mm256_fmadd_ps(bf16x8(w + r * ldw + k), x0, a0[r]);
            a1[r] = _mm256_fmadd_ps(bf16x8(w + r * ldw + k + 8), x1, a1[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float t = hsum8(_mm256_add_ps(a0[r], a1[r]));
        for (int64_t j = k; j < K; j++) t += bf16_f32(w[r * ldw + j]) * x[j];
        y[r] = t;
    }
#endif
}

/* One input row: four weight rows a pass. */
static void bf16_m1(const uint16_t *w, int64_t ldw, int64_t K, const float *x, int64_t nc, float *y) {
    int64_t c = 0;
    for (; c + 4 <= nc; c += 4) bf16_rows_m1(4, w + c * ldw, ldw, K, x, y + c);
    switch (nc - c) {
        case 3: bf16_rows_m1(3, w + c * ldw, ldw, K, x, y + c); break;
        case 2: bf16_rows_m1(2, w + c * ldw, ldw, K, x, y + c); break;
        case 1: bf16_rows_m1(1, w + c * ldw, ldw, K, x, y + c); break;
        default: break;
    }
}
#endif

static void bf16_cols(const uint16_t *w, int64_t ldw, int64_t K, const float *x, int64_t M, int64_t nc, float *y,
                      int64_t ldy) {
#if defined(__AVX512F__)
    const int64_t K16 = K / 16 * 16;
    if (M == 1) {
        bf16_m1(w, ldw, K, x, nc, y);
        return;
    }
    for (int64_t c = 0; c < nc; c++) {  /* each weight vector widened once, used by every row */
        __m512 acc[STEP_MAX_M];
        const uint16_t *wc = w + c * ldw;
        for (int64_t m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K16; k += 16) {
            __m512 wv = bf16x16(wc + k);
            for (int64_t m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * K + k), acc[m]);
        }
        for (int64_t m = 0; m < M; m++) {
            float t = _mm512_reduce_add_ps(acc[m]);
            for (int64_t j = K16; j < K; j++) t += bf16_f32(wc[j]) * x[m * K + j];
            y[m * ldy + c] = t;
        }
    }
#elif PKV_AVX2
    const int64_t K16 = K / 16 * 16;
    if (M == 1) {
        bf16_m1(w, ldw, K, x, nc, y);
        return;
    }
    /* More rows: widen a stretch of the weight row into L1 once, then the float32 kernel's
     * four-rows-a-pass dot products over it. */
    enum { CHUNK = 512 };
    float wf[CHUNK];
    __m256 acc[2 * STEP_MAX_M];
    for (int64_t c = 0; c < nc; c++) {
        const uint16_t *wc = w + c * ldw;
        for (int64_t i = 0; i < 2 * M; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t k0 = 0; k0 < K16; k0 += CHUNK) {
            int64_t n = K16 - k0 < CHUNK ? K16 - k0 : CHUNK;
            for (int64_t j = 0; j < n; j += 8) _mm256_storeu_ps(wf + j, bf16x8(wc + k0 + j));
            dot_rows_avx2(wf, n, x + k0, M, K, acc);
        }
        for (int64_t m = 0; m < M; m++) {
            float t = hsum8(_mm256_add_ps(acc[2 * m], acc[2 * m + 1]));
            for (int64_t j = K16; j < K; j++) t += bf16_f32(wc[j]) * x[m * K + j];
            y[m * ldy + c] = t;
        }
    }
#else
    for (int64_t c = 0; c < nc; c++)
        for (int64_t m = 0; m < M; m++) {
            float acc[16] = {0};  /* 16 independent lanes: the compiler vectorises them */
            const uint16_t *wr = w + c * ldw;
            const float *xm = x + m * K;
            int64_t k = 0;
            for (; k + 16 <= K; k += 16)
                for (int l = 0; l < 16; l++) acc[l] += bf16_f32(wr[k + l]) * xm[k + l];
            float s = 0.0f;
            for (int l = 0; l < 16; l++) s += acc[l];
            for (; k < K; k++) s += bf16_f32(wr[k]) * xm[k];
            y[m * ldy + c] = s;
        }
#endif
}

/* ggml rows of one type (or bf16 rows): y[m*ldy + c] for c < nc, as pkv_gemv_q computes them,
 * or, given x quantized (xq: the model's act_q8 mode) and a 32-weight type, as pkv_gemv_q8. */
static void quant_cols(int qtype, const uint8_t *rows, int64_t stride, int64_t K, const float *x,
                       const q8_rows *xq, int64_t M, int64_t nc, float *y, int64_t ldy) {
    if (xq && q8_type(qtype)) {
        q8_cols(qtype, rows, stride, xq, M, nc, y, ldy);
        return;
    }
    if (qtype == STEP_BF16) {  /* not a ggml type: plain bf16 rows */
        bf16_cols((const uint16_t *)rows, stride / 2, K, x, M, nc, y, ldy);
        return;
    }
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

/* Output columns [n0, n1) of x [M, K] @ W^T (+ bias): y[m*ldy + (n - n0)]. xq: x quantized to
 * 8-bit blocks, read by the 32-weight ggml segments (NULL: float32 math throughout). */
static void linear_cols(const pkv_linear *L, const float *x, const q8_rows *xq, int64_t M, int64_t n0, int64_t n1,
                        float *y, int64_t ldy) {
    if (L->nseg == 0 || M > L->max_rows) {
        dense_cols(L->dense + n0 * L->ldw, L->ldw, L->K, x, M, n1 - n0, y, ldy);
    } else {
        for (int s = 0; s < L->nseg; s++) {
            const pkv_segment *g = &L->seg[s];
            int64_t a = n0 > g->start ? n0 : g->start, b = n1 < g->end ? n1 : g->end;
            if (a < b) quant_cols(g->qtype, g->w + (a - g->start) * g->row_stride, g->row_stride, L->K, x, xq, M,
                                  b - a, y + (a - n0), ldy);
        }
    }
    if (L->bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = n0; n < n1; n++) y[m * ldy + n - n0] += L->bias[n];
}

/* y = x @ W^T for all N columns, columns shared out among the team (ends with a barrier). */
static void linear_team(const pkv_linear *L, const float *x, const q8_rows *xq, int64_t M, float *y) {
    int64_t groups = (L->N + 3) / 4;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        int64_t n0 = 4 * g, n1 = n0 + 4 < L->N ? n0 + 4 : L->N;
        linear_cols(L, x, xq, M, n0, n1, y + n0, L->N);
    }
}

/* y[m, n] (at y + m*ldy + n) = x[M, K] @ W^T (+ bias[N]) for a dense W: float32 (wtype STEP_F32)
 * or bfloat16 (STEP_BF16) rows ldw elements apart; x row-major, contiguous; float32 math. The
 * small-batch GEMV of a dense model's linears outside the layer step (its LM head); groups of
 * four output columns are shared out statically, so each thread streams one range of rows.
 * Returns 0, or -1 for an unknown wtype. */
int pkv_gemv_dense(int wtype, const float *x, int64_t M, int64_t K, const void *w, int64_t ldw, int64_t N,
                   const float *bias, float *y, int64_t ldy) {
    if (wtype != STEP_F32 && wtype != STEP_BF16) return -1;
    int64_t groups = (N + 3) / 4;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        int64_t n0 = 4 * g, nc = N - n0 < 4 ? N - n0 : 4;
        for (int64_t m0 = 0; m0 < M; m0 += STEP_MAX_M) {
            int64_t mr = M - m0 < STEP_MAX_M ? M - m0 : STEP_MAX_M;
            float *yo = y + m0 * ldy + n0;
            if (wtype == STEP_BF16)
                bf16_cols((const uint16_t *)w + n0 * ldw, ldw, K, x + m0 * K, mr, nc, yo, ldy);
            else
                dense_cols((const float *)w + n0 * ldw, ldw, K, x + m0 * K, mr, nc, yo, ldy);
            if (bias)
                for (int64_t m = 0; m < mr; m++)
                    for (int64_t c = 0; c < nc; c++) yo[m * ldy + c] += bias[n0 + c];
        }
    }
    return 0;
}
