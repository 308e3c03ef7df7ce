/* Paged decode attention over a float32/bfloat16/float16 KV cache: per-ISA vector helpers
 * (exp, masked loads), tile scores and accumulation, the online softmax, and decode_item (one
 * row's KV heads).
 * Part of the unity build: compiled only as included by cpu_kernels.c (see there), after
 * kv_formats.h, decode_attention.h. */
#include "decode_attention.h"
#include "kv_formats.h"

/* ------------------------------------------------------------------ paged decode attention */

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
