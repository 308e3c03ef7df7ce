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
