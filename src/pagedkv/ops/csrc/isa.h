#ifndef PKV_ISA_H
#define PKV_ISA_H

/* The ISA of this build and the helpers every part of the kernels shares.
 *
 * -march=native picks one of three builds of every hot loop (PKV_AVX2 / __AVX512F__ tests in
 * each part); ops/native.py can force a narrower one with -mno-avx512f [-mno-avx2]. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* Three builds of every hot loop, chosen by what -march=native offers: AVX-512 (F, and BW/VL
 * for the attention), AVX2 + FMA + F16C without AVX-512 (AMD Zen 2/3, Intel Haswell to Alder
 * Lake: PKV_AVX2, the same loops 8 lanes wide), and portable C. All three compute the same
 * float32 products of the same values; only the order of additions differs. pkv_isa() says
 * which one this library holds. */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PKV_AVX2 1
#else
#define PKV_AVX2 0
#endif
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* The attention kernel reads K/V stored as float32, bfloat16 or float16 (converted exactly to
 * float32 in registers); 16-bit masked loads need AVX-512 BW/VL besides F. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PKV_ATTN_AVX512 1
#else
#define PKV_ATTN_AVX512 0
#endif

#if defined(__AVX512F__) || PKV_AVX2
/* dequant_superblock's vector loops, written once for both widths: VW float lanes a register,
 * each from one byte (a 16-byte load for AVX-512, 8 bytes for AVX2). */
#if defined(__AVX512F__)
enum { VW = 16 };
typedef __m512 vfloat;
#define V_SET1 _mm512_set1_ps
#define V_STORE _mm512_storeu_ps
#define V_MUL _mm512_mul_ps
#define V_SUB _mm512_sub_ps
#define V_LOAD_BYTES(p) _mm_loadu_si128((const __m128i *)(p))
/* VW bytes (the low ones of x) as float lanes, each less `off`. */
#define V_BYTES_F(x, off) _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(x), _mm512_set1_epi32(off)))
#else
enum { VW = 8 };
typedef __m256 vfloat;
#define V_SET1 _mm256_set1_ps
#define V_STORE _mm256_storeu_ps
#define V_MUL _mm256_mul_ps
#define V_SUB _mm256_sub_ps
#define V_LOAD_BYTES(p) _mm_loadl_epi64((const __m128i *)(p))
#define V_BYTES_F(x, off) _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(x), _mm256_set1_epi32(off)))
#endif

/* Bytes [VW*i, VW*i + VW) of q, at the bottom of a register. */
static inline __m128i bytes_chunk(__m256i q, int i) {
    __m128i half = (VW * i) & 16 ? _mm256_extracti128_si256(q, 1) : _mm256_castsi256_si128(q);
    return (VW * i) & 8 ? _mm_unpackhi_epi64(half, half) : half;
}
#endif

/* float16 bits -> float32, exact (portable: every build has it). */
static inline float fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t load_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* Helpers of the 8-lane loops (the AVX2 GEMV, and gemv_q8.c on every AVX2 CPU). */
/* Sum of the 8 lanes. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* dm[2j] = d, dm[2j+1] = m (Q4_1; else the first quants, unused) of the n <= 8 blocks at b,
 * bb bytes apart: eight 4-byte loads into one register (not through memory: eight narrow
 * stores read back as one wide load would stall store forwarding) and two float16
 * conversions, instead of two conversions and broadcasts per block in the FMA loop. */
static inline uint32_t load_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
ALWAYS_INLINE void block_scales8(const uint8_t *b, int bb, int64_t n, float *dm /* [16] */) {
    uint32_t h[8];
    for (int64_t j = 0; j < 8; j++) h[j] = j < n ? load_u32(b + j * bb) : 0u;
    __m256i v = _mm256_setr_epi32((int)h[0], (int)h[1], (int)h[2], (int)h[3], (int)h[4], (int)h[5], (int)h[6], (int)h[7]);
    _mm256_storeu_ps(dm, _mm256_cvtph_ps(_mm256_castsi256_si128(v)));
    _mm256_storeu_ps(dm + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(v, 1)));
}
#endif

#endif  /* PKV_ISA_H */
