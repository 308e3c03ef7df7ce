/* Sampling kernels: the row-wise argmax of greedy sampling (pkv_argmax_rows) and the token
 * bitmask of structured outputs (pkv_apply_token_bitmask).
 * Part of the unity build: compiled only as included by cpu_kernels.c (see there), after
 * isa.h. */
#include "isa.h"

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

/* ------------------------------------------------------------------ structured outputs */

/* Structured outputs' token bitmask (xgrammar's and llguidance's layout): row r of bm holds
 * `words` int32 words, bit b of word w set when token 32*w + b is allowed. Every disallowed
 * token of x's row r (its first N logits) becomes -inf; tokens past 32*words also do. torch's
 * unpack-and-mask took ~230 us per 49,152-token row on an AVX2 EPYC; a word with every bit set
 * (an unconstrained stretch) is skipped, one with none (most of a constrained row) filled. */
void pkv_apply_token_bitmask(float *x, int64_t M, int64_t N, int64_t ld, const int32_t *bm,
                             int64_t words) {
    for (int64_t r = 0; r < M; r++) {
        float *row = x + r * ld;
        const int32_t *mask = bm + r * words;
        for (int64_t w = 0; w < words && 32 * w < N; w++) {
            uint32_t bits = (uint32_t)mask[w];
            if (bits == 0xFFFFFFFFu) continue;
            int64_t end = 32 * w + 32 < N ? 32 * w + 32 : N;
            if (bits == 0) { /* most words of a constrained row: a plain (vectorized) fill */
                for (int64_t i = 32 * w; i < end; i++) row[i] = -INFINITY;
                continue;
            }
            for (int64_t i = 32 * w; i < end; i++)
                if (!((bits >> (i - 32 * w)) & 1u)) row[i] = -INFINITY;
        }
        for (int64_t i = 32 * words; i < N; i++) row[i] = -INFINITY;
    }
}
