/* The layer step's row-wise glue: RMSNorm, SiLU*mul, float32 -> bfloat16/float16 rounding
 * of the K/V writes (as torch rounds), rotate-half RoPE.
 * Part of the unity build: compiled only as included by cpu_kernels.c (see there), after
 * isa.h. */
#include "isa.h"
#include "kv_formats.h"

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
