#ifndef PKV_KV_FORMATS_H
#define PKV_KV_FORMATS_H

/* The KV cache formats the decode attention reads: float32/bfloat16/float16 elements, and the
 * quantized byte formats of pagedkv/ops/kv_quant.py (kv_type codes: ops/native.py's KV_TYPES,
 * KV_QUANT_TYPES and KV_FP8_TYPES mirror them), with their scalar readers. */
#include "isa.h"

/* ------------------------------------------------------------ float KV caches */

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };

static inline float kv_scalar(const char *p, int64_t i, int kvt) {
    if (kvt == KV_F32) { float f; memcpy(&f, p + 4 * i, 4); return f; }
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    if (kvt == KV_F16) return fp16_to_fp32(h);
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* ------------------------------------------------------------ quantized KV caches
 *
 * The byte formats of pagedkv/ops/kv_quant.py, read in place: each (token, KV head) part is
 * [values | inline scales], strides count bytes. Codes become float32 in registers (never a
 * dequantized copy of the cache): int8 sign-extended; fp8 e4m3 rebuilt as the fp16 bits
 * sign<<15 | (b&0x7f)<<7 (1/256 of its value, exactly: the x256 goes into kmul/vmul; the
 * e4m3fn NaN code would read as 480, but the writer clamps to +-448); e5m2 is fp16's top byte;
 * int4 nibbles (element 2i low, 2i+1 high) minus the zero point; int3/int2 bit-stream codes.
 * Per-token-head scales fold into the logit (s = scale * k_scale[tok] * q.codes) and into the
 * probability (acc += (p * v_scale[tok]) * codes), as vLLM does; int4 groups scale their
 * chunk of 16 values in registers (x = q*s - z*s; the portable path (q - z)*s, as torch).
 * KV_I8_TH16/KV_FP8_TH16 (the *_per_token_head_f16 formats: one fp16 scale a part) exist only at
 * the API: pkv_paged_decode runs them as KV_I8_TH/KV_FP8_TH with decode_args.s16 set. */
enum { KV_I8_TH = 3, KV_FP8_TH = 4, KV_FP8_E4M3 = 5, KV_FP8_E5M2 = 6, KV_I4_TH = 7, KV_I4_GROUP = 8,
       KV_I8_TH16 = 9, KV_FP8_TH16 = 10 };
/* Inside the AVX2 kernels only: KV_I4_TH read as raw codes 0..15, its zero points taken out of
 * the loops (q.(c - z) = q.c - z*sum(q); sum_j p_j (c_j - z_j) = sum_j p_j c_j - sum_j p_j z_j). */
enum { KV_I4_RAW = 11 };
/* int3/int2 groups (int3_per_token_group, int2_per_token_group): b-bit codes as a
 * little-endian bit stream (value i at bits [b*i, b*i + b)), then one fp16 scale per group
 * with the zero point in its low b bits, as KV_I4_GROUP with b = 4. */
enum { KV_I3_GROUP = 12, KV_I2_GROUP = 13 };

enum { MAXG = 64 };  /* int4 scale groups per part the kernel reads (more: the torch path) */

static inline int kv_is_int4(int kvt) { return kvt == KV_I4_TH || kvt == KV_I4_GROUP || kvt == KV_I4_RAW; }
static inline int kv_is_lowbit(int kvt) { return kvt == KV_I3_GROUP || kvt == KV_I2_GROUP; }
/* Formats with group scales (the zero point in each fp16 scale's low bits: kv_zero_mask). */
static inline int kv_is_group(int kvt) { return kvt == KV_I4_GROUP || kv_is_lowbit(kvt); }
static inline unsigned kv_zero_mask(int kvt) { return kvt == KV_I3_GROUP ? 7u : kvt == KV_I2_GROUP ? 3u : 15u; }
/* Bytes of the codes of a part of D values. */
static inline int64_t kv_code_bytes(int kvt, int64_t D) {
    if (kvt == KV_I3_GROUP) return (3 * D + 7) / 8;
    if (kvt == KV_I2_GROUP) return (2 * D + 7) / 8;
    return kv_is_int4(kvt) ? (D + 1) / 2 : D;
}
static inline int kv_token_scaled(int kvt) { return kvt == KV_I8_TH || kvt == KV_FP8_TH || kvt == KV_I4_TH; }

/* The scale of a per-token-head part (its bytes at p: fp32, or fp16 if s16); int4's zero point
 * into *z. */
static inline float part_scale(const uint8_t *p, int kvt, int s16, float *z) {
    if (s16) {
        *z = 0.0f;
        return fp16_to_fp32(load_u16(p));
    }
    uint32_t b;
    memcpy(&b, p, 4);
    *z = kvt == KV_I4_TH ? (float)(b & 15u) : 0.0f;
    if (kvt == KV_I4_TH) b &= ~15u;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* Scale of group `grp` (fp16s at p, the zero point in each one's low bits: mask). */
static inline float group_scale(const uint8_t *p, int64_t grp, unsigned mask, float *z) {
    uint16_t h = load_u16(p + 2 * grp);
    *z = (float)(h & mask);
#if defined(__F16C__)
    return _cvtsh_ss((uint16_t)(h & ~mask));
#else
    return fp16_to_fp32((uint16_t)(h & ~mask));
#endif
}

/* Stored value i of a part: int8 code, fp8 e4m3 / 256, e5m2, or the int4 code 0..15. */
static inline float code_at(const uint8_t *p, int64_t i, int kvt) {
    switch (kvt) {
        case KV_I8_TH: return (float)(int8_t)p[i];
        case KV_FP8_TH:
        case KV_FP8_E4M3: return fp16_to_fp32((uint16_t)(((p[i] & 0x80u) << 8) | ((p[i] & 0x7fu) << 7)));
        case KV_FP8_E5M2: return fp16_to_fp32((uint16_t)(p[i] << 8));
        case KV_I3_GROUP: {  /* the next byte exists: the part's scales follow its codes */
            int64_t bit = 3 * i;
            unsigned w = (unsigned)p[bit >> 3] | ((unsigned)p[(bit >> 3) + 1] << 8);
            return (float)((w >> (bit & 7)) & 7u);
        }
        case KV_I2_GROUP: return (float)((p[i >> 2] >> (2 * (i & 3))) & 3u);
        default: return (float)((p[i >> 1] >> (4 * (i & 1))) & 15u);
    }
}

/* Value i of a part as the attention multiplies it: the code, less the int4 zero point z
 * (per-token-head) or times its group's scale (int4 groups of g at the part's `vals` bytes). */
static inline float qval(const uint8_t *p, int64_t i, int kvt, float z, int64_t vals, int64_t g) {
    float c = code_at(p, i, kvt);
    if (kvt == KV_I4_TH) return c - z;
    if (kv_is_group(kvt)) {
        float zz, sc = group_scale(p + vals, i / g, kv_zero_mask(kvt), &zz);
        return (c - zz) * sc;
    }
    return c;
}

/* M(kvt) with a->kvt as a constant: each quantized format gets its own branch-free loops. */
#define PKV_DISPATCH(M)                          \
    switch (a->kvt) {                            \
        case KV_I8_TH: M(KV_I8_TH) break;        \
        case KV_FP8_TH: M(KV_FP8_TH) break;      \
        case KV_FP8_E4M3: M(KV_FP8_E4M3) break;  \
        case KV_FP8_E5M2: M(KV_FP8_E5M2) break;  \
        case KV_I4_TH: M(KV_I4_TH) break;        \
        case KV_I3_GROUP: M(KV_I3_GROUP) break;  \
        case KV_I2_GROUP: M(KV_I2_GROUP) break;  \
        default: M(KV_I4_GROUP) break;           \
    }

#endif  /* PKV_KV_FORMATS_H */
