/* ggml quantized blocks: their byte sizes and the dequantizers the GEMV shares (scalar
 * reference for 32-weight blocks, vector loops for K-quant super-blocks).
 * Part of the unity build: compiled only as included by cpu_kernels.c (see there), after
 * isa.h. */
#include "isa.h"

enum { QK = 32, QK_K = 256, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };  /* ggml type ids */
enum { MAX_M = 16 };                            /* rows of x per pass over the weights */

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
