/* Paged decode attention over a quantized KV cache, read in place (kv_formats.h): codes become
 * float32 in registers per ISA (AVX-512, AVX2, portable loops), and decode_item_q.
 * Part of the unity build: compiled only as included by cpu_kernels.c (see there), after
 * decode_attention.c. */
#include "decode_attention.h"
#include "kv_formats.h"

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
/* Group scales (int4, int3, int2), converted once per tile (F16C: both SIMD paths).
 * Scales and -z*s of eight fp16 group scales h, the zero point in their low bits (mask), into
 * gs[0:8) / gz[0:8). */
static inline void group_scales8(__m128i h, unsigned mask, float *gs, float *gz) {
    const __m128i low = _mm_set1_epi16((short)mask);
    __m256 sc = _mm256_cvtph_ps(_mm_andnot_si128(low, h));
    __m256 zp = _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(_mm_and_si128(h, low)));
    _mm256_storeu_ps(gs, sc);
    _mm256_storeu_ps(gz, _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), zp), sc));
}

/* 8/NG tokens' NG scales each (at ps[i] + at) into gs/gz[0:8): one conversion for all. */
ALWAYS_INLINE void group_scales_batch(const int ng, const uint8_t *const *ps, int64_t at, unsigned mask, float *gs,
                                      float *gz) {
    uint16_t h[8];
    for (int i = 0; i < 8 / ng; i++) memcpy(h + i * ng, ps[i] + at, 2 * ng);
    group_scales8(_mm_loadu_si128((const __m128i *)h), mask, gs, gz);
}

/* gs[j*ng + grp] = scale s, gz[j*ng + grp] = -z*s of int4 group grp (of ng) of the parts at
 * ps[j] + at, j < n: converted once per tile, then broadcast from memory by the dot products.
 * Writes up to 8 floats past the last group (the buffers have room). */
static inline void group_scales(const uint8_t *const *ps, int64_t at, int64_t n, int64_t ng, unsigned mask,
                                float *gs, float *gz) {
    int64_t j = 0;
    if (ng == 1)  /* several tokens a conversion (V parts; K of head sizes 16 and 64) */
        for (; j + 8 <= n; j += 8) group_scales_batch(1, ps + j, at, mask, gs + j, gz + j);
    else if (ng == 2)
        for (; j + 4 <= n; j += 4) group_scales_batch(2, ps + j, at, mask, gs + 2 * j, gz + 2 * j);
    else if (ng == 4)
        for (; j + 2 <= n; j += 2) group_scales_batch(4, ps + j, at, mask, gs + 4 * j, gz + 4 * j);
    for (; j < n; j++)
        for (int64_t grp = 0; grp < ng; grp += 8) {
            uint16_t h[8] = {0};
            memcpy(h, ps[j] + at + 2 * grp, 2 * (size_t)(ng - grp >= 8 ? 8 : ng - grp));
            group_scales8(_mm_loadu_si128((const __m128i *)h), mask, gs + j * ng + grp, gz + j * ng + grp);
        }
}

#endif

#if PKV_ATTN_AVX512
#define PKV_INLINE static inline __attribute__((always_inline))

/* 16 stored values from p as float32, like code_at; `full`: all 16 there (plain loads, which
 * fold into the conversions), else only the bytes in mb are read. */
PKV_INLINE __m512 codes16(const int kvt, const int full, const uint8_t *p, __mmask16 mb) {
    if (kv_is_lowbit(kvt)) {  /* 16 codes in 6 (int3) or 4 (int2) bytes, exactly those read */
        uint64_t w = (uint64_t)_mm_cvtsi128_si64(_mm_maskz_loadu_epi8(mb, p));
        __m512i x;
        if (kvt == KV_I3_GROUP) {  /* lanes 0-9 from bits 0-31, lanes 10-15 from bits 30-61 */
            x = _mm512_mask_blend_epi32((__mmask16)0xFC00, _mm512_set1_epi32((int)(uint32_t)w),
                                        _mm512_set1_epi32((int)(uint32_t)(w >> 30)));
            x = _mm512_srlv_epi32(x, _mm512_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 0, 3, 6, 9, 12, 15));
            return _mm512_cvtepi32_ps(_mm512_and_si512(x, _mm512_set1_epi32(7)));
        }
        x = _mm512_srlv_epi32(_mm512_set1_epi32((int)(uint32_t)w),
                              _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30));
        return _mm512_cvtepi32_ps(_mm512_and_si512(x, _mm512_set1_epi32(3)));
    }
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
    if (kv_is_lowbit(kvt)) return lanes(kv_code_bytes(kvt, rem >= 16 ? 16 : rem));
    return kv_is_int4(kvt) ? lanes(rem >= 16 ? 8 : (rem + 1) / 2) : lanes(rem);
}

/* A chunk's codes as the dot product multiplies them: less the int4 zero point z (per token-
 * head), or q*s + (-z*s) with its group's scale (one FMA: (q - z)*s to within an ulp of z*s). */
PKV_INLINE __m512 adjust(const int kvt, __m512 w, const float *z, const float *gs, const float *gz) {
    if (kvt == KV_I4_TH) return _mm512_sub_ps(w, _mm512_set1_ps(*z));
    if (kv_is_group(kvt)) return _mm512_fmadd_ps(w, _mm512_set1_ps(*gs), _mm512_set1_ps(*gz));
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
            __m512 k = codes16(kvt, full, ks[j] + off + kv_code_bytes(kvt, d), mb);
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
                    w[k] = codes16(kvt, full, pv + kv_code_bytes(kvt, c0 + 16 * k), mb[k]);
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
    int64_t cg[MAXG], ng = D / a->kgroup;  /* group of each 16-value chunk (no division in the loops) */
    if (kv_is_group(a->kvt))
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
    if (kvt == KV_I3_GROUP) {  /* 8 codes in 3 bytes (the 4th byte read is the next one's, or a
                                * scale: the part's scales follow its codes) */
        uint32_t w;
        memcpy(&w, p, 4);
        __m256i x = _mm256_srlv_epi32(_mm256_set1_epi32((int)w), _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21));
        return _mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(7)));
    }
    if (kvt == KV_I2_GROUP) {  /* 8 codes in 2 bytes */
        uint16_t w;
        memcpy(&w, p, 2);
        __m256i x = _mm256_srlv_epi32(_mm256_set1_epi32(w), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
        return _mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(3)));
    }
    uint32_t w;
    memcpy(&w, p, 4);
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nibbles(_mm_cvtsi32_si128((int)w))));
}

/* A chunk of codes c as the attention multiplies them (qval's values): less int4's zero point
 * z, or c*s + (-z*s) with the int4 group's scale *gs and *gz (read for group formats only), as
 * the AVX-512 path computes them; KV_I4_RAW: c as it is. */
ALWAYS_INLINE __m256 adjust8(const int kvt, __m256 c, float z, const float *gs, const float *gz) {
    if (kvt == KV_I4_TH) return _mm256_sub_ps(c, _mm256_set1_ps(z));
    if (kv_is_group(kvt)) return _mm256_fmadd_ps(c, _mm256_set1_ps(*gs), _mm256_set1_ps(*gz));
    return c;
}

/* Values [d, d + 8) of the part at p (see adjust8). Int4 groups are multiples of 16 values or
 * the whole part (pkv_paged_decode checks), so an aligned chunk of 8 lies in one group. */
ALWAYS_INLINE __m256 chunk8(const int kvt, const uint8_t *p, int64_t d, float z, const float *gs, const float *gz) {
    return adjust8(kvt, codes8(kvt, p + kv_code_bytes(kvt, d)), z, gs, gz);
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
        float zz = 0.0f, nzs;
        float sc = kv_is_group(kvt) ? group_scale(p + vals, d / g, kv_zero_mask(kvt), &zz) : 0.0f;
        nzs = -zz * sc;
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
        if (kv_is_group(kvt) && d == gend) gi++, gend += g;
        qk_step(kvt, nh, 1, q, D, d, ks, off, z, gs, gz, ng, gi, t);
    }
    for (; d < D; d += 8) {
        if (kv_is_group(kvt) && d == gend) gi++, gend += g;
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
    if (kv_is_group(kvt))
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
            if (kv_is_group(kvt))  /* padding keys (up to a multiple of 16) too */
                group_scales(kp, hk * a->kh + a->kvals, (n + 15) / 16 * 16, D / a->kgroup, kv_zero_mask(kvt), gs, gz);
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
            if (kv_is_group(kvt)) group_scales(vp, hk * a->vh + a->vvals, n, Dv / a->vgroup, kv_zero_mask(kvt), gs, gz);
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
