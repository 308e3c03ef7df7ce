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

#endif  /* PKV_ISA_H */
