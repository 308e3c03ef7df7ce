/* pkv_kivi_decode: paged decode attention over a KIVI cache (pagedkv/ops/kivi.py), read in place.
 * Part of the unity build: compiled only as included by cpu_kernels.c, after paged_decode.c.
 *
 * What a row's query (at t = len - 1) reads for key j (ops/kivi.py's hot_mask, at decode):
 * the residual's int8 part when j >= start and (j < sink or j >= hot_lo), hot_lo the first
 * position of the last `blocks` blocks, or when sink_lo <= j < sink (sink_lo: the first sink
 * its row holds, 0 for a hit's sinks restored from the sink store); else the page's codes. So a row's keys split into at
 * most two cold ranges (codes) and two hot ranges (the residual), attended in that order with
 * one online softmax (its result does not depend on the order).
 *
 * Cold keys, one block at a time: K is coded per channel over the block, x = (c - z_d) * s_d,
 * so q . x = (q * s) . c - sum_d (q * s)_d z_d. The channel scales fold into the query once
 * per (block, KV head) (q' = q * s, bias = -q' . z), then every key of the block is one dot
 * product of q' with its codes: the low-bit group kernels of decode_attention_quant.c run it
 * with unit scales (kgroup = D, gs = 1, gz = 0). V parts are the int3/int2 group format those
 * kernels read already. Hot keys are KV_I8_TH parts with fp16 scales (the residual's format):
 * decode_item_q's per-token scaling, on pointers into the residual's ring. Where the CPU has
 * AVX512-VNNI and VBMI the cold K and V products are integer (KIVI_VNNI, below), measured
 * 1.3x faster than the float kernels on Zen 4. */
#include "decode_attention.h"
#include "kv_formats.h"

/* KIVI_AHEAD: blocks prefetched ahead of the one read (1 and 4 measured slower than 2) */
enum { KIVI_MAX_G = 16, KIVI_MAX_D = 256, KIVI_AHEAD = 2 };

typedef struct {
    decode_args ck, cv, res; /* cold K (unit group scales), cold V, the residual's int8 K and V */
    const uint8_t *rk, *rv;  /* residual K/V: [rows, span, Hkv, D + 2] / [.., Dv + 2] bytes */
    int64_t rk_row, rk_tok, rv_row, rv_tok, sink, window, blocks;
    const int32_t *res_rows, *starts, *sink_lo;
    unsigned zmask;          /* zero point bits in a K channel scale: 7 (int3) or 3 (int2) */
    int int_dot;             /* take the integer dot products (KIVI_VNNI builds) where they apply */
} kivi_args;

/* Prefetch (into L2) token tok of block blk: its K and V parts of heads [h0, h1), the lines
 * of one range when they lie close (token-major layouts), else part by part. A block ahead is
 * fetched a token at a time as the current block's tokens are read: a whole block at once
 * (44 lines at block 16) filled the fill buffers and stalled. */
static inline void kivi_prefetch_token(const kivi_args *ka, int64_t blk, int64_t tok, int64_t h0, int64_t h1) {
    const decode_args *a = &ka->ck, *c = &ka->cv;
    const uint8_t *k = (const uint8_t *)a->k + blk * a->kb + tok * a->kt + h0 * a->kh;
    const uint8_t *v = (const uint8_t *)c->v + blk * c->vb + tok * c->vt + h0 * c->vh;
    const int64_t kspan = (h1 - h0 - 1) * a->kh + a->kpart, vspan = (h1 - h0 - 1) * c->vh + c->vpart;
    const uint8_t *lo = k < v ? k : v, *hi = k + kspan > v + vspan ? k + kspan : v + vspan;
    if (hi - lo <= 2 * (kspan + vspan)) {
        for (uintptr_t line = (uintptr_t)lo >> 6; line <= ((uintptr_t)hi - 1) >> 6; line++)
            __builtin_prefetch((const void *)(line << 6), 0, 2);
        return;
    }
    for (int64_t b = 0; b < kspan + 63; b += 64) __builtin_prefetch(k + (b < kspan ? b : kspan - 1), 0, 2);
    for (int64_t b = 0; b < vspan + 63; b += 64) __builtin_prefetch(v + (b < vspan ? b : vspan - 1), 0, 2);
}

/* q . codes over one block's keys kp[0:m) for the nh*G query rows q' (already times the
 * channel scales): raw scores into out[g][0:m). */
static void kivi_qk_codes(const kivi_args *ka, const float *qf, const uint8_t *const *kp, int64_t off, int64_t m,
                          float (*out)[TILE]) {
#if PKV_ATTN_AVX512 || PKV_AVX2
    static const float ones[TILE + 16] = {[0 ... TILE + 15] = 1.0f};
    static const float zeros[TILE + 16];
    qk_tile(&ka->ck, qf, kp, off, m, zeros, ones, zeros, out);
#else
    for (int64_t j = 0; j < m; j++)
        for (int64_t g = 0; g < ka->ck.G; g++) {
            float t = 0.0f;
            for (int64_t d = 0; d < ka->ck.D; d++) t += qf[g * ka->ck.D + d] * code_at(kp[j] + off, d, ka->ck.kvt);
            out[g][j] = t;
        }
#endif
}

/* The fp16 channel scales of KV head hk's keys in a block (blk0: its first token) in channel
 * order: channel d's is token d / c's (d % c)-th, c = D / block size. */
static inline void kivi_block_scales(const kivi_args *ka, const uint8_t *blk0, int64_t hk, int64_t c, uint16_t *h) {
    const decode_args *a = &ka->ck;
    const uint8_t *p = blk0 + hk * a->kh + a->kvals;
    if (c == 4)  /* block 16, D 64: constant-size copies (a libc call per token cost 15% of the step) */
        for (int64_t i = 0; i < a->block_size; i++) memcpy(h + 4 * i, p + i * a->kt, 8);
    else if (c == 2)
        for (int64_t i = 0; i < a->block_size; i++) memcpy(h + 2 * i, p + i * a->kt, 4);
    else
        for (int64_t i = 0; i < a->block_size; i++)
            for (int64_t e = 0; e < c; e++) h[i * c + e] = load_u16(p + i * a->kt + 2 * e);
}

/* The channel scales of KV head hk's keys in a block (blk0: its first token) folded into the
 * G query rows q: qf = q * s (G rows of D), bias[g] = -qf[g] . z (the float kernels' fold;
 * the integer path's is kivi_fold_i16). */
static void kivi_fold(const kivi_args *ka, const float *q, const uint8_t *blk0, int64_t hk, float *qf, float *bias) {
    const decode_args *a = &ka->ck;
    const int64_t G = a->G, D = a->D, c = D / a->block_size;
    uint16_t h[KIVI_MAX_D];
    kivi_block_scales(ka, blk0, hk, c, h);
#if PKV_ATTN_AVX512 || PKV_AVX2
    const __m128i low = _mm_set1_epi16((short)ka->zmask);
    __m256 bz[KIVI_MAX_G];
    for (int64_t g = 0; g < G; g++) bz[g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {  /* D % 8 == 0 (pkv_kivi_decode checks) */
        __m128i hv = _mm_loadu_si128((const __m128i *)(h + d));
        __m256 sc = _mm256_cvtph_ps(_mm_andnot_si128(low, hv));
        __m256 zp = _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(_mm_and_si128(hv, low)));
        for (int64_t g = 0; g < G; g++) {
            __m256 x = _mm256_mul_ps(_mm256_loadu_ps(q + g * D + d), sc);
            _mm256_storeu_ps(qf + g * D + d, x);
            bz[g] = _mm256_fmadd_ps(x, zp, bz[g]);
        }
    }
    for (int64_t g = 0; g < G; g++) bias[g] = -hsum8(bz[g]);
#else
    for (int64_t g = 0; g < G; g++) bias[g] = 0.0f;
    for (int64_t d = 0; d < D; d++) {
        float z, sc = group_scale((const uint8_t *)(h + d), 0, ka->zmask, &z);
        for (int64_t g = 0; g < G; g++) {
            float x = q[g * D + d] * sc;
            qf[g * D + d] = x;
            bias[g] -= x * z;
        }
    }
#endif
}

/* Scaled logits s[(hk-h0)*G + g][n0 + i] of the block piece kp[0:m) (keys of one block,
 * blk0: the block's first token part) for heads [h0, h1); pf: a block to prefetch (or -1),
 * spread over the heads. The kernels write whole chunks of
 * keys: columns up to n0 + m rounded up to 16 (the caller keeps that within TILE). */
static void kivi_cold_scores(const kivi_args *ka, const float *qr, const uint8_t *blk0, const uint8_t *const *kp,
                             int64_t m, int64_t h0, int64_t h1, int64_t n0, float (*s)[TILE], int64_t pf) {
    const decode_args *a = &ka->ck;
    const int64_t G = a->G, D = a->D, bs = a->block_size;
    float qf[KIVI_MAX_G * KIVI_MAX_D], bias[KIVI_MAX_G];
    for (int64_t hk = h0; hk < h1; hk++) {
        float (*sh)[TILE] = s + (hk - h0) * G;
        if (pf >= 0)  /* a slice of the block ahead before each head's work */
            for (int64_t i = bs * (hk - h0) / (h1 - h0); i < bs * (hk - h0 + 1) / (h1 - h0); i++)
                kivi_prefetch_token(ka, pf, i, h0, h1);
        kivi_fold(ka, qr + (hk - h0) * G * D, blk0, hk, qf, bias);
        kivi_qk_codes(ka, qf, kp, hk * a->kh, m, (float (*)[TILE])(sh[0] + n0));
        for (int64_t g = 0; g < G; g++)
            for (int64_t i = n0; i < n0 + m; i++) sh[g][i] = (sh[g][i] + bias[g]) * a->scale;
    }
}

#if PKV_ATTN_AVX512 && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
/* Integer dot products (AVX512-VNNI, VBMI), the default where the CPU has them: codes become
 * 16-bit integers in registers (3 instructions for 64 codes: vpermb, vpmultishiftqb, and, then
 * a zero extension) and meet the query (K) or the probabilities (V) as 16-bit integers in
 * vpdpwssd, 32 products an instruction, no float conversion of a code. The float side is
 * scaled to 15 bits once per block (K: per query head, q' = q * s over the block's channels)
 * or per tile (V: per query head and scale group, w_j = p_j * s_j), so each product carries a
 * relative rounding of at most 2^-16 of the largest: float-level accuracy, not 8-bit. */
#define KIVI_VNNI 1

/* 64 codes of `bits` (3: 24 bytes, 2: 16 bytes at p) as 64 bytes 0..7 / 0..3, in order. */
ALWAYS_INLINE __m512i kivi_codes64(const int bits, const uint8_t *p) {
    if (bits == 3) {  /* qword i <- bytes 3i..3i+2 (codes 8i..8i+7), then 8 fields of 3 bits */
        const __m512i perm = _mm512_set_epi8(
            28, 27, 26, 25, 24, 23, 22, 21, 25, 24, 23, 22, 21, 20, 19, 18, 22, 21, 20, 19, 18, 17, 16, 15,
            19, 18, 17, 16, 15, 14, 13, 12, 16, 15, 14, 13, 12, 11, 10, 9, 13, 12, 11, 10, 9, 8, 7, 6,
            10, 9, 8, 7, 6, 5, 4, 3, 7, 6, 5, 4, 3, 2, 1, 0);
        const __m512i ctrl = _mm512_set1_epi64(0x15120F0C09060300LL);
        __m512i x = _mm512_permutexvar_epi8(perm, _mm512_maskz_loadu_epi8(0xFFFFFFull, p));
        return _mm512_and_si512(_mm512_multishift_epi64_epi8(ctrl, x), _mm512_set1_epi8(7));
    }
    const __m512i perm = _mm512_set_epi8(
        21, 20, 19, 18, 17, 16, 15, 14, 19, 18, 17, 16, 15, 14, 13, 12, 17, 16, 15, 14, 13, 12, 11, 10,
        15, 14, 13, 12, 11, 10, 9, 8, 13, 12, 11, 10, 9, 8, 7, 6, 11, 10, 9, 8, 7, 6, 5, 4,
        9, 8, 7, 6, 5, 4, 3, 2, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i ctrl = _mm512_set1_epi64(0x0E0C0A0806040200LL);
    __m512i x = _mm512_permutexvar_epi8(perm, _mm512_maskz_loadu_epi8(0xFFFFull, p));
    return _mm512_and_si512(_mm512_multishift_epi64_epi8(ctrl, x), _mm512_set1_epi8(3));
}

/* The 64 codes as two vectors of 32 words (values [0, 32) and [32, 64)). */
ALWAYS_INLINE void kivi_words64(__m512i c, __m512i *lo, __m512i *hi) {
    *lo = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(c));
    *hi = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(c, 1));
}

/* x (n floats) as int16 words w = round(x * 32767 / max|x|) (w[n] is set to 0 when n is odd:
 * the pair partner of the last one); returns max|x| / 32767 (1 if all are zero). */
static inline float kivi_to_i16(const float *x, int64_t n, int16_t *w) {
    __m512 m = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_maskz_loadu_ps(lanes(n - i), x + i)));
    float amax = _mm512_reduce_max_ps(m), inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = lanes(n - i);
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), _mm512_set1_ps(inv)));
        _mm256_mask_storeu_epi16(w + i, k, _mm512_cvtsepi32_epi16(q));
    }
    if (n % 2) w[n] = 0;
    return amax > 0.0f ? amax * (1.0f / 32767.0f) : 1.0f;
}

/* v[k] (k < 8) summed over each 256-bit half: lanes 2k and 2k+1 of the result are the sums
 * of the low and the high 8 lanes of v[k] (a transposing reduction: 22 instructions for 16
 * sums, against 45 for hsum16's 16 whole-vector sums). */
ALWAYS_INLINE __m512 kivi_hsum_halves8(const __m512 *v) {
    __m512 w[4], x[2];
    for (int i = 0; i < 4; i++)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++) {
        __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* x[i] lane 4L + k: 128-bit lane L's sum of v[4i + k]; add lanes 0+1 and 2+3 */
    __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
    /* r: v0..3 low halves, v0..3 high, v4..7 low, v4..7 high -> v0 lo, v0 hi, v1 lo, .. */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15), r);
}

/* Raw scores out[h*TILE + j] = sum_d qi_h[d] * code_j[d] (int32, as float) for nh (<= 3) query
 * heads and the 8 keys kp[j] + off; D a multiple of 64. Two keys share each accumulator: words
 * of 16 values of key 2p in its low half, of key 2p+1 in its high half (one vpermt2b makes two
 * such chunks from both keys' codes), against qq, the head's 16 query words twice; two pairs
 * a pass (3 heads: 6 accumulators and 12 query vectors in registers), then one half-vector
 * reduction per two heads for the 8 keys. */
ALWAYS_INLINE void kivi_qk8_vnni(const int bits, const int nh, const int16_t *qi, int64_t D, const uint8_t *const *kp,
                                 int64_t off, float *out) {
    const __m512i pick01 = _mm512_setr_epi64(0x0706050403020100LL, 0x0F0E0D0C0B0A0908LL, 0x4746454443424140LL,
                                             0x4F4E4D4C4B4A4948LL, 0x1716151413121110LL, 0x1F1E1D1C1B1A1918LL,
                                             0x5756555453525150LL, 0x5F5E5D5C5B5A5958LL);
    const __m512i pick23 = _mm512_add_epi8(pick01, _mm512_set1_epi8(32));
    __m512 f[3][4];  /* the pairs' sums as float, two pairs a pass (no spilled accumulators) */
    for (int p0 = 0; p0 < 4; p0 += 2) {
        __m512i t[3][2];
        for (int h = 0; h < nh; h++) t[h][0] = t[h][1] = _mm512_setzero_si512();
        for (int64_t d = 0; d < D; d += 64) {
            __m512i qq[3][4];  /* [q(16k..16k+15) | the same] for chunk k */
            for (int h = 0; h < nh; h++)
                for (int k = 0; k < 4; k++)
                    qq[h][k] = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qi + h * D + d + 16 * k)));
            for (int p = 0; p < 2; p++) {
                __m512i ca = kivi_codes64(bits, kp[2 * (p0 + p)] + off + d * bits / 8);
                __m512i cb = kivi_codes64(bits, kp[2 * (p0 + p) + 1] + off + d * bits / 8);
                /* bytes [a 0-15 | b 0-15 | a 16-31 | b 16-31], then the same for 32-63 */
                __m512i u = _mm512_permutex2var_epi8(ca, pick01, cb), v = _mm512_permutex2var_epi8(ca, pick23, cb);
                __m512i w[4] = {_mm512_cvtepu8_epi16(_mm512_castsi512_si256(u)),
                                _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(u, 1)),
                                _mm512_cvtepu8_epi16(_mm512_castsi512_si256(v)),
                                _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(v, 1))};
                for (int h = 0; h < nh; h++)
                    for (int k = 0; k < 4; k++) t[h][p] = _mm512_dpwssd_epi32(t[h][p], w[k], qq[h][k]);
            }
        }
        for (int h = 0; h < nh; h++)
            for (int p = 0; p < 2; p++) f[h][p0 + p] = _mm512_cvtepi32_ps(t[h][p]);
    }
    for (int h = 0; h < nh; h += 2) {
        __m512 v[8];
        for (int p = 0; p < 4; p++) {
            v[p] = f[h][p];
            v[4 + p] = h + 1 < nh ? f[h + 1][p] : _mm512_setzero_ps();
        }
        __m512 r = kivi_hsum_halves8(v);  /* lanes 0-7: head h's 8 keys, 8-15: head h+1's */
        _mm256_storeu_ps(out + h * TILE, _mm512_castps512_ps256(r));
        if (h + 1 < nh) _mm256_storeu_ps(out + (h + 1) * TILE, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(r), 1)));
    }
}

/* The shapes the integer paths take (else the float kernels run). */
static inline int kivi_vnni_k(const decode_args *a) { return a->D % 64 == 0; }
static inline int kivi_vnni_v(const decode_args *a) {
    return a->Dv % 64 == 0 && a->G <= 4 && a->vgroup % 32 == 0 && a->Dv / a->vgroup <= 8;
}

/* The block's channel scales folded into the G query rows and scaled to 15-bit integers in one
 * pass a head: qi[g] = round(q_g * s * 32767 / max|q_g * s|), step[g] = that max / 32767,
 * zq[g] = qi[g] . z (exact in float: |qi| <= 32767, z small integers). */
static void kivi_fold_i16(const kivi_args *ka, const float *q, const uint8_t *blk0, int64_t hk, int16_t *qi,
                          float *step, float *zq) {
    const decode_args *a = &ka->ck;
    const int64_t G = a->G, D = a->D, c = D / a->block_size, nv = D / 16;
    uint16_t h[KIVI_MAX_D];
    kivi_block_scales(ka, blk0, hk, c, h);
    __m512 sc[KIVI_MAX_D / 16], zc[KIVI_MAX_D / 16];
    const __m256i low = _mm256_set1_epi16((short)ka->zmask);
    for (int64_t i = 0; i < nv; i++) {
        __m256i hv = _mm256_loadu_si256((const __m256i *)(h + 16 * i));
        sc[i] = _mm512_cvtph_ps(_mm256_andnot_si256(low, hv));
        zc[i] = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm256_and_si256(hv, low)));
    }
    for (int64_t g = 0; g < G; g++) {
        const float *qg = q + g * D;
        __m512 m = _mm512_setzero_ps(), acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < nv; i++) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_mul_ps(_mm512_loadu_ps(qg + 16 * i), sc[i])));
        float amax = _mm512_reduce_max_ps(m), inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
        step[g] = amax > 0.0f ? amax * (1.0f / 32767.0f) : 1.0f;
        for (int64_t i = 0; i < nv; i++) {
            __m512 x = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(qg + 16 * i), sc[i]), _mm512_set1_ps(inv));
            __m512i v = _mm512_cvtps_epi32(x);
            _mm256_storeu_si256((__m256i *)(qi + g * D + 16 * i), _mm512_cvtsepi32_epi16(v));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), zc[i], acc);
        }
        zq[g] = _mm512_reduce_add_ps(acc);
    }
}

/* Scaled logits of one block piece (kivi_cold_scores' contract) with integer dot products. */
static void kivi_cold_scores_vnni(const kivi_args *ka, const float *qr, const uint8_t *blk0, const uint8_t *const *kp,
                                  int64_t m, int64_t h0, int64_t h1, int64_t n0, float (*s)[TILE], int64_t pf) {
    const decode_args *a = &ka->ck;
    const int64_t G = a->G, D = a->D, bs = a->block_size;
    const int bits = a->kvt == KV_I3_GROUP ? 3 : 2;
    float bias[KIVI_MAX_G], step[KIVI_MAX_G];
    int16_t qi[KIVI_MAX_G * KIVI_MAX_D];
    for (int64_t hk = h0; hk < h1; hk++) {
        float (*sh)[TILE] = s + (hk - h0) * G;
        if (pf >= 0)
            for (int64_t i = bs * (hk - h0) / (h1 - h0); i < bs * (hk - h0 + 1) / (h1 - h0); i++)
                kivi_prefetch_token(ka, pf, i, h0, h1);
        kivi_fold_i16(ka, qr + (hk - h0) * G * D, blk0, hk, qi, step, bias);
        for (int64_t g0 = 0; g0 < G; g0 += 3) {
            const int nh = G - g0 >= 3 ? 3 : (int)(G - g0);
            const int16_t *qg = qi + g0 * D;
            const int64_t off = hk * a->kh;
#define KIVI_QK(B, NH) for (int64_t j = 0; j < m; j += 8) kivi_qk8_vnni(B, NH, qg, D, kp + j, off, sh[g0] + n0 + j);
            if (bits == 3) {
                if (nh == 3) { KIVI_QK(3, 3) } else if (nh == 2) { KIVI_QK(3, 2) } else { KIVI_QK(3, 1) }
            } else {
                if (nh == 3) { KIVI_QK(2, 3) } else if (nh == 2) { KIVI_QK(2, 2) } else { KIVI_QK(2, 1) }
            }
#undef KIVI_QK
        }
        for (int64_t g = 0; g < G; g++)
            for (int64_t i = n0; i < n0 + m; i++) sh[g][i] = (sh[g][i] - bias[g]) * step[g] * a->scale;
    }
}

/* acc (G <= 4 rows of Dv, value order) += p (G rows of TILE) times the V parts vp[j] + off,
 * j < n, with integer dot products: w_j = p_j * s_j per query head and scale group as 15-bit
 * integers, pairs of tokens' codes interleaved as words (vpdpwssd adds both), the zero points'
 * term sum_j w_j z_j in float. Dv a multiple of 64, scale groups a multiple of 32. */
ALWAYS_INLINE void kivi_qv_vnni_t(const int bits, const int G, const decode_args *va, float *acc, float (*s)[TILE],
                                  const uint8_t *const *vp, int64_t off, int64_t n) {
    const int64_t Dv = va->Dv, vg = va->vgroup, ng = Dv / vg;
    const unsigned low = kv_zero_mask(va->kvt);
    float sc[8][TILE], zs[8][TILE], w[TILE], step[4][8], zterm[4][8];
    int16_t wi[4][8][TILE + 2];  /* a pair (2m, 2m+1) of words is the int32 vpdpwssd reads */
    for (int64_t j = 0; j < n; j++)
        for (int64_t gr = 0; gr < ng; gr++) sc[gr][j] = group_scale(vp[j] + off + va->vvals, gr, low, &zs[gr][j]);
    for (int64_t g = 0; g < G; g++)
        for (int64_t gr = 0; gr < ng; gr++) {
            __m512 zt = _mm512_setzero_ps();
            for (int64_t j = 0; j < n; j += 16) {
                __mmask16 k = lanes(n - j);
                __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s[g] + j), _mm512_maskz_loadu_ps(k, sc[gr] + j));
                _mm512_mask_storeu_ps(w + j, k, x);
                zt = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(k, zs[gr] + j), zt);
            }
            step[g][gr] = kivi_to_i16(w, n, wi[g][gr]);
            zterm[g][gr] = _mm512_reduce_add_ps(zt);
        }
    /* rows of 32 words in interleaved order back to value order: unpacklo/hi_epi16 of two
     * tokens' words give value 8L + k (lo) and 8L + 4 + k (hi) at dword 4L + k */
    const __m512i ilo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i ihi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t c0 = 0; c0 < Dv; c0 += 64) {
        const int64_t g0 = c0 / vg, g1 = (c0 + 32) / vg;
        __m512i A[4][4];
        for (int64_t g = 0; g < G; g++)
            for (int k = 0; k < 4; k++) A[g][k] = _mm512_setzero_si512();
        for (int64_t m = 0; m < (n + 1) / 2; m++) {
            const uint8_t *pa = vp[2 * m] + off + c0 * bits / 8;
            const uint8_t *pb = 2 * m + 1 < n ? vp[2 * m + 1] + off + c0 * bits / 8 : pa;  /* its weight is 0 */
            __m512i a0, a1, b0, b1;
            kivi_words64(kivi_codes64(bits, pa), &a0, &a1);
            kivi_words64(kivi_codes64(bits, pb), &b0, &b1);
            __m512i x0 = _mm512_unpacklo_epi16(a0, b0), x1 = _mm512_unpackhi_epi16(a0, b0);
            __m512i x2 = _mm512_unpacklo_epi16(a1, b1), x3 = _mm512_unpackhi_epi16(a1, b1);
            for (int64_t g = 0; g < G; g++) {
                int32_t p0, p1;
                memcpy(&p0, wi[g][g0] + 2 * m, 4);
                memcpy(&p1, wi[g][g1] + 2 * m, 4);
                __m512i w0 = _mm512_set1_epi32(p0), w1 = _mm512_set1_epi32(p1);
                A[g][0] = _mm512_dpwssd_epi32(A[g][0], x0, w0);
                A[g][1] = _mm512_dpwssd_epi32(A[g][1], x1, w0);
                A[g][2] = _mm512_dpwssd_epi32(A[g][2], x2, w1);
                A[g][3] = _mm512_dpwssd_epi32(A[g][3], x3, w1);
            }
        }
        for (int64_t g = 0; g < G; g++) {
            float *o = acc + g * Dv + c0;
            __m512 f0 = _mm512_cvtepi32_ps(A[g][0]), f1 = _mm512_cvtepi32_ps(A[g][1]);
            __m512 f2 = _mm512_cvtepi32_ps(A[g][2]), f3 = _mm512_cvtepi32_ps(A[g][3]);
            __m512 s0 = _mm512_set1_ps(step[g][g0]), s1 = _mm512_set1_ps(step[g][g1]);
            __m512 z0 = _mm512_set1_ps(zterm[g][g0]), z1 = _mm512_set1_ps(zterm[g][g1]);
            __m512 r[4] = {_mm512_permutex2var_ps(f0, ilo, f1), _mm512_permutex2var_ps(f0, ihi, f1),
                           _mm512_permutex2var_ps(f2, ilo, f3), _mm512_permutex2var_ps(f2, ihi, f3)};
            for (int k = 0; k < 4; k++) {
                __m512 sk = k < 2 ? s0 : s1, zk = k < 2 ? z0 : z1;
                __m512 x = _mm512_fmsub_ps(r[k], sk, zk);  /* sum_j w_j c_j - sum_j w_j z_j */
                _mm512_storeu_ps(o + 16 * k, _mm512_add_ps(_mm512_loadu_ps(o + 16 * k), x));
            }
        }
    }
}

/* kivi_qv_vnni_t with the code width and the query heads as constants (its accumulators then
 * stay in registers). */
static void kivi_qv_vnni(const decode_args *va, float *acc, float (*s)[TILE], const uint8_t *const *vp, int64_t off,
                         int64_t n) {
#define KIVI_QV(B, G) kivi_qv_vnni_t(B, G, va, acc, s, vp, off, n); break;
    if (va->kvt == KV_I3_GROUP)
        switch (va->G) { case 1: KIVI_QV(3, 1) case 2: KIVI_QV(3, 2) case 3: KIVI_QV(3, 3) default: KIVI_QV(3, 4) }
    else
        switch (va->G) { case 1: KIVI_QV(2, 1) case 2: KIVI_QV(2, 2) case 3: KIVI_QV(2, 3) default: KIVI_QV(2, 4) }
#undef KIVI_QV
}
#else
#define KIVI_VNNI 0
#endif

/* Online softmax step and V of one tile: s (scaled logits of n keys) into acc; V parts at
 * vp[j] in format `va` (the cold group codes, or the residual's int8 with per-token scales). */
static void kivi_tile_v(const decode_args *va, int scaled, int int_dot, const uint8_t *const *vp, int64_t n,
                        int64_t h0, int64_t h1, float (*s)[TILE], float *mx, float *sum, float *acc) {
    const int64_t G = va->G, Dv = va->Dv;
    float z[TILE + 16] = {0}, sc[TILE];
#if PKV_ATTN_AVX512 || PKV_AVX2
    float gs[TILE * MAXG], gz[TILE * MAXG];
#else
    float *gs = NULL, *gz = NULL;
#endif
    softmax_tile(s, (h1 - h0) * G, n, mx, sum, acc, Dv);
    for (int64_t hk = h0; hk < h1; hk++) {
        float (*sh)[TILE] = s + (hk - h0) * G;
        if (scaled) {
            token_scales(vp, hk * va->vh + va->vvals, n, KV_I8_TH, 1, 1.0f, sc, z);
            for (int64_t g = 0; g < G; g++)
                for (int64_t j = 0; j < n; j++) sh[g][j] *= sc[j];
        }
#if KIVI_VNNI
        if (!scaled && int_dot && kivi_vnni_v(va)) {
            kivi_qv_vnni(va, acc + (hk - h0) * G * Dv, sh, vp, hk * va->vh, n);
            continue;
        }
#endif
#if PKV_ATTN_AVX512 || PKV_AVX2
        if (!scaled) group_scales(vp, hk * va->vh + va->vvals, n, Dv / va->vgroup, kv_zero_mask(va->kvt), gs, gz);
#endif
        qv_tile(va, acc + (hk - h0) * G * Dv, sh, vp, hk * va->vh, n, z, gs, gz);
    }
}

/* Keys [lo, hi) of row r from the pages' codes, a tile of whole block pieces at a time. */
static void kivi_cold(const kivi_args *ka, const float *qr, const int32_t *table, int64_t lo, int64_t hi, int64_t h0,
                      int64_t h1, float (*s)[TILE], float *mx, float *sum, float *acc) {
    const decode_args *a = &ka->ck;
    const int64_t bs = a->block_size;
    const uint8_t *kp[TILE + 16], *vp[TILE];
    int64_t n = 0, ahead = KIVI_AHEAD;  /* blocks prefetched ahead of the one read */
    for (int64_t j0 = lo; j0 < hi;) {
        int64_t b = j0 / bs, j1 = (b + 1) * bs < hi ? (b + 1) * bs : hi, m = j1 - j0;
        int64_t pf = (b + ahead) * bs < hi ? table[b + ahead] : -1;
        if (n + (m + 15) / 16 * 16 > TILE) {  /* the piece's padded chunks stay in the row */
            kivi_tile_v(&ka->cv, 0, ka->int_dot, vp, n, h0, h1, s, mx, sum, acc);
            n = 0;
        }
        const uint8_t *kblk = (const uint8_t *)a->k + (int64_t)table[b] * a->kb;
        const uint8_t *vblk = (const uint8_t *)ka->cv.v + (int64_t)table[b] * ka->cv.vb;
        for (int64_t i = 0; i < m; i++) {
            kp[i] = kblk + (j0 - b * bs + i) * a->kt;
            vp[n + i] = vblk + (j0 - b * bs + i) * ka->cv.vt;
        }
        for (int64_t i = m; i < (m + 15) / 16 * 16; i++) kp[i] = kp[0];  /* padding: computed, unused */
#if KIVI_VNNI
        if (ka->int_dot && kivi_vnni_k(a)) kivi_cold_scores_vnni(ka, qr, kblk, kp, m, h0, h1, n, s, pf);
        else
#endif
            kivi_cold_scores(ka, qr, kblk, kp, m, h0, h1, n, s, pf);
        n += m;
        j0 = j1;
    }
    if (n) kivi_tile_v(&ka->cv, 0, ka->int_dot, vp, n, h0, h1, s, mx, sum, acc);
}

/* Keys [lo, hi) of row r from its residual row (ring: j < sink at j, else sink + j % window). */
static void kivi_hot(const kivi_args *ka, const float *qr, int64_t row, int64_t lo, int64_t hi, int64_t h0,
                     int64_t h1, float (*s)[TILE], float *mx, float *sum, float *acc) {
    const decode_args *a = &ka->res;
    const int64_t G = a->G;
    const uint8_t *kp[TILE + 16], *vp[TILE];
    float z[TILE + 16] = {0}, sc[TILE];
#if PKV_ATTN_AVX512 || PKV_AVX2
    float gs[TILE], gz[TILE];  /* unread: the residual's parts have no group scales */
#else
    float *gs = NULL, *gz = NULL;
#endif
    for (int64_t t0 = lo; t0 < hi; t0 += TILE) {
        int64_t n = hi - t0 < TILE ? hi - t0 : TILE;
        for (int64_t j = 0; j < n; j++) {
            int64_t pos = t0 + j, idx = pos < ka->sink ? pos : ka->sink + pos % ka->window;
            kp[j] = ka->rk + row * ka->rk_row + idx * ka->rk_tok;
            vp[j] = ka->rv + row * ka->rv_row + idx * ka->rv_tok;
        }
        for (int64_t j = n; j < (n + 15) / 16 * 16; j++) kp[j] = kp[0];
        for (int64_t hk = h0; hk < h1; hk++) {
            float (*sh)[TILE] = s + (hk - h0) * G;
            token_scales(kp, hk * a->kh + a->kvals, n, KV_I8_TH, 1, a->scale, sc, z);
            qk_tile(a, qr + (hk - h0) * G * a->D, kp, hk * a->kh, n, z, gs, gz, sh);
            for (int64_t g = 0; g < G; g++)
                for (int64_t j = 0; j < n; j++) sh[g][j] *= sc[j];
        }
        kivi_tile_v(a, 1, 0, vp, n, h0, h1, s, mx, sum, acc);
    }
}

/* Row r, KV heads [h0, h1): its cold and hot key ranges, one online softmax. */
static void kivi_item(const kivi_args *ka, int64_t r, int64_t h0, int64_t h1) {
    const decode_args *a = &ka->ck;
    float acc[MAX_ACC], s[KIVI_MAX_G * 16][TILE], mx[KIVI_MAX_G * 16], sum[KIVI_MAX_G * 16];
    const int64_t G = a->G, nq = (h1 - h0) * G, Dv = a->Dv, bs = a->block_size;
    const int64_t len = a->seq_lens[r], start = ka->starts[r], row = ka->res_rows[r], sink = ka->sink;
    const int64_t sl = ka->sink_lo[r]; /* <= min(start, sink) */
    int64_t hot_lo = ((len - 1) / bs - ka->blocks + 1) * bs;
    hot_lo = hot_lo > 0 ? hot_lo : 0;
    const int32_t *table = a->block_table + r * a->bt_stride;
    const float *qr = a->q + r * a->q_stride + h0 * G * a->D;
    for (int64_t i = 0; i < nq; i++) {
        mx[i] = -INFINITY;
        sum[i] = 0.0f;
    }
    memset(acc, 0, nq * Dv * sizeof(float));
#define KMIN(x, y) ((x) < (y) ? (x) : (y))
#define KMAX(x, y) ((x) > (y) ? (x) : (y))
    if (sl >= sink) {  /* cold [0, c), hot [c, len) */
        int64_t c = KMIN(KMAX(start, hot_lo), len);
        kivi_cold(ka, qr, table, 0, c, h0, h1, s, mx, sum, acc);
        kivi_hot(ka, qr, row, c, len, h0, h1, s, mx, sum, acc);
    } else {  /* cold [0, sl), hot [sl, sink), cold [sink, c), hot [c, len) */
        int64_t e = KMIN(sink, len), c = KMIN(KMAX(KMAX(start, sink), hot_lo), len);
        kivi_cold(ka, qr, table, 0, sl, h0, h1, s, mx, sum, acc);
        kivi_hot(ka, qr, row, sl, e, h0, h1, s, mx, sum, acc);
        kivi_cold(ka, qr, table, e, c, h0, h1, s, mx, sum, acc);
        kivi_hot(ka, qr, row, c, len, h0, h1, s, mx, sum, acc);
    }
#undef KMIN
#undef KMAX
    for (int64_t i = 0; i < nq; i++) {
        int64_t h = h0 * G + i;
        float *o = a->out + r * a->out_stride + h * Dv, inv = 1.0f / sum[i];
        for (int64_t c = 0; c < Dv; c++) o[c] = acc[i * Dv + c] * inv;
    }
}

/* Decode attention over a KIVI cache: row r's query q[r] ([Hq, D], rows Hq*D floats apart) at
 * position seq_lens[r] - 1, its keys through block_table[r] (bt_stride int32s apart). Pages:
 * K parts [NB, BS, Hkv, kpart] at k (block/token/head strides kb/kt/kh bytes: the codes of D
 * `bits`-bit values, then D/BS fp16 channel scales of the block, zero point in the low `bits`
 * bits), V parts likewise at v (codes, then an fp16 scale per v_group values). Residual: K
 * [rows, sink + window, Hkv, D + 2] at rk (row/token strides rk_row/rk_tok bytes: int8 codes,
 * then an fp16 scale), V at rv likewise; row r uses residual row res_rows[r], which holds what
 * it computed from position starts[r] on, and the sinks from sink_lo[r] on. `blocks`: the residual's recent blocks. Writes
 * out[r] ([Hq, Dv] floats). int_dot: take the integer dot products where the build has them
 * (pkv_kivi_int_dot), else the float kernels. Returns -1 (nothing written) for shapes it does not cover (bits
 * other than 2/3, D or Dv not a multiple of 8, BS not dividing D or above TILE, G > 16 or
 * D > 256, a V group the group kernels refuse), else 0. */
int pkv_kivi_decode(const float *q, int64_t num_rows, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv,
                    const void *k, int64_t kb, int64_t kt, int64_t kh, const void *v, int64_t vb, int64_t vt,
                    int64_t vh, int64_t block_size, const int32_t *block_table, int64_t bt_stride,
                    const int32_t *seq_lens, const void *rk, int64_t rk_row, int64_t rk_tok, const void *rv,
                    int64_t rv_row, int64_t rv_tok, const int32_t *res_rows, const int32_t *starts,
                    const int32_t *sink_lo, int64_t sink,
                    int64_t window, int64_t blocks, int bits, int64_t v_group, float scale, float *out, int int_dot) {
    if (Hkv <= 0 || Hq % Hkv || (bits != 2 && bits != 3) || D % 8 || Dv % 8 || D > KIVI_MAX_D) return -1;
    if (block_size <= 0 || block_size > TILE || D % block_size || window <= 0 || sink < 0 || blocks <= 0) return -1;
    int64_t G = Hq / Hkv;
    if (G > KIVI_MAX_G || G * Dv > MAX_ACC || v_group <= 0 || Dv % v_group || (v_group % 16 && v_group != Dv) ||
        (Dv + 15) / 16 > MAXG)
        return -1;
    int kvt = bits == 3 ? KV_I3_GROUP : KV_I2_GROUP;
    decode_args base = {q, (const char *)k, (const char *)v, Hq * D, Hq, Hkv, G, D, Dv, kb, kt, kh, vb, vt, vh,
                        block_size, bt_stride, 0, block_table, seq_lens, scale, out, NULL, Hq * Dv,
                        kvt, 1, 1.0f, 1.0f, D, v_group, kv_code_bytes(kvt, D), kv_code_bytes(kvt, Dv), 0, 0, 0};
    kivi_args ka = {base, base, base, (const uint8_t *)rk, (const uint8_t *)rv, rk_row, rk_tok, rv_row, rv_tok,
                    sink, window, blocks, res_rows, starts, sink_lo, bits == 3 ? 7u : 3u, int_dot};
    ka.cv.kpart = ka.ck.kpart = ka.ck.kvals + 2 * (D / block_size);
    ka.cv.vpart = ka.ck.vpart = ka.cv.vvals + 2 * (Dv / v_group);
    /* the residual: int8 parts, one fp16 scale each, heads D + 2 / Dv + 2 bytes apart */
    ka.res.kvt = KV_I8_TH;
    ka.res.s16 = 1;
    ka.res.kh = D + 2;
    ka.res.vh = Dv + 2;
    ka.res.kgroup = D;
    ka.res.vgroup = Dv;
    ka.res.kvals = D;
    ka.res.vvals = Dv;
    /* KV heads an item takes: within the accumulators and score rows */
    int64_t hstep = MAX_ACC / (G * Dv) < KIVI_MAX_G * 16 / G ? MAX_ACC / (G * Dv) : KIVI_MAX_G * 16 / G;
    int threads = omp_get_max_threads();
    if (num_rows >= 2 * threads) {
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t r = 0; r < num_rows; r++)
            for (int64_t h0 = 0; h0 < Hkv; h0 += hstep) kivi_item(&ka, r, h0, h0 + hstep < Hkv ? h0 + hstep : Hkv);
    } else {
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
        for (int64_t r = 0; r < num_rows; r++)
            for (int64_t hk = 0; hk < Hkv; hk++) kivi_item(&ka, r, hk, hk + 1);
    }
    return 0;
}

/* 1 when this build has the integer dot products (AVX512-VNNI and VBMI), else 0. */
int pkv_kivi_int_dot(void) { return KIVI_VNNI; }
