/* pagedkv CPU kernels: fused GGUF dequant + GEMV, and paged decode attention (float32 math
 * over a float32, bfloat16 or float16 KV cache).
 *
 * Built at first use by pagedkv/ops/native.py with
 *   cc -O3 -march=native -fopenmp -ffp-contract=off -shared -fPIC
 * and called through ctypes (no Python or torch headers: it compiles in about a second).
 * OpenMP resolves to the libgomp torch already loaded, so these loops share torch's threads.
 *
 * Exactness contract. A weight is rebuilt exactly as gguf.quants (and pagedkv's torch
 * dequantizer) does it: Q4_0 w = d*(q-8), Q4_1 w = d*q + m (product rounded, then the sum:
 * hence -ffp-contract=off), Q8_0 w = d*q, Q4_K w = (d*sc)*q - dmin*m, Q6_K w = (d*sc)*(q-32),
 * with d and m converted exactly from float16. So the
 * kernel multiplies x by the very float32 weights the dense model holds; only the order of the
 * dot product's additions differs from BLAS (as BLAS's differs between shapes).
 *
 * Why: at small batch a decode step streams every weight once. Q4_1 is 0.625 bytes a weight
 * against 4 for float32, and this machine class is bound by memory bandwidth there.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { QK = 32, QK_K = 256, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };  /* ggml type ids */
enum { MAX_M = 16 };                            /* rows of x per pass over the weights */

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
#if defined(__AVX512F__)
    if (qtype == Q4_K) {
        float d = fp16_to_fp32(load_u16(b)), dmin = fp16_to_fp32(load_u16(b + 2));
        const uint8_t *scales = b + 4, *qs = b + 16;
        const __m128i low = _mm_set1_epi8(0x0F);
        for (int j = 0; j < 8; j++) {
            int sc, m;
            q4k_scale_min(scales, j, &sc, &m);
            __m512 ds = _mm512_set1_ps(d * (float)sc), dm = _mm512_set1_ps(dmin * (float)m);
            const uint8_t *q = qs + (j / 2) * 32;
            for (int h = 0; h < 2; h++) {
                __m128i v = _mm_loadu_si128((const __m128i *)(q + 16 * h));
                if (j % 2) v = _mm_srli_epi16(v, 4);
                __m512 qf = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, low)));
                _mm512_storeu_ps(w + j * 32 + 16 * h, _mm512_sub_ps(_mm512_mul_ps(ds, qf), dm));
            }
        }
        return;
    }
    if (qtype == Q6_K) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *scales = (const int8_t *)(b + 192);
        float d = fp16_to_fp32(load_u16(b + 208));
        const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
        const __m512i off = _mm512_set1_epi32(32);
        for (int c = 0; c < 8; c++) {
            int h = c / 4, r = c % 4;
            __m256i l = _mm256_loadu_si256((const __m256i *)(ql + h * 64 + (r % 2) * 32));
            __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + h * 32));
            l = _mm256_and_si256(_mm256_srli_epi16(l, (r / 2) * 4), m4);
            hb = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * r), m2), 4);
            __m256i q = _mm256_or_si256(l, hb);
            for (int half = 0; half < 2; half++) {
                __m128i q16 = half ? _mm256_extracti128_si256(q, 1) : _mm256_castsi256_si128(q);
                __m512 qf = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(q16), off));
                __m512 dj = _mm512_set1_ps(d * (float)scales[c * 2 + half]);
                _mm512_storeu_ps(w + c * 32 + 16 * half, _mm512_mul_ps(dj, qf));
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

/* One output column n of y = x @ W^T for up to MAX_M rows of x. */
static void gemv_row(int qtype, const float *x, int64_t m_rows, int64_t ldx, int64_t nblocks,
                     const uint8_t *row, int bb, float *out /* [m_rows] */) {
#if defined(__AVX512F__)
    __m512 acc[MAX_M];
    for (int i = 0; i < m_rows; i++) acc[i] = _mm512_setzero_ps();
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int64_t k = 0; k < nblocks; k++) {
        const uint8_t *b = row + k * bb;
        __m512 d = _mm512_set1_ps(fp16_to_fp32(load_u16(b)));
        __m512 w0, w1;
        if (qtype == Q8_0) {
            __m128i q0 = _mm_loadu_si128((const __m128i *)(b + 2));
            __m128i q1 = _mm_loadu_si128((const __m128i *)(b + 18));
            w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)));
            w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)));
        } else {
            __m128i q = _mm_loadu_si128((const __m128i *)(b + (qtype == Q4_0 ? 2 : 4)));
            __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(q, low));
            __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), low));
            if (qtype == Q4_0) {
                const __m512i eight = _mm512_set1_epi32(8);
                w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(lo, eight)));
                w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(hi, eight)));
            } else {
                __m512 m = _mm512_set1_ps(fp16_to_fp32(load_u16(b + 2)));
                w0 = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)), m);
                w1 = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)), m);
            }
        }
        const float *xk = x + k * QK;
        for (int i = 0; i < m_rows; i++) {
            acc[i] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xk + i * ldx), acc[i]);
            acc[i] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xk + i * ldx + 16), acc[i]);
        }
    }
    for (int i = 0; i < m_rows; i++) out[i] = _mm512_reduce_add_ps(acc[i]);
#else
    float acc[MAX_M][QK], w[QK];
    memset(acc, 0, sizeof(acc));
    for (int64_t k = 0; k < nblocks; k++) {
        dequant_block(qtype, row + k * bb, w);
        for (int i = 0; i < m_rows; i++)
            for (int j = 0; j < QK; j++) acc[i][j] += w[j] * x[i * ldx + k * QK + j];
    }
    for (int i = 0; i < m_rows; i++) {
        float s = 0.0f;
        for (int j = 0; j < QK; j++) s += acc[i][j];
        out[i] = s;
    }
#endif
}

/* K-quant rows: each super-block is dequantized into a 256-float buffer (L1), then FMA'd. */
static void gemv_row_k(int qtype, const float *x, int64_t m_rows, int64_t ldx, int64_t nblocks,
                       const uint8_t *row, int bb, float *out) {
    float w[QK_K];
#if defined(__AVX512F__)
    __m512 acc[MAX_M];
    for (int i = 0; i < m_rows; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < nblocks; k++) {
        dequant_superblock(qtype, row + k * bb, w);
        const float *xk = x + k * QK_K;
        for (int v = 0; v < QK_K; v += 16) {
            __m512 wv = _mm512_loadu_ps(w + v);
            for (int i = 0; i < m_rows; i++) acc[i] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xk + i * ldx + v), acc[i]);
        }
    }
    for (int i = 0; i < m_rows; i++) out[i] = _mm512_reduce_add_ps(acc[i]);
#else
    float acc[MAX_M][16];
    memset(acc, 0, sizeof(acc));
    for (int64_t k = 0; k < nblocks; k++) {
        dequant_superblock(qtype, row + k * bb, w);
        for (int i = 0; i < m_rows; i++)
            for (int j = 0; j < QK_K; j++) acc[i][j % 16] += w[j] * x[i * ldx + k * QK_K + j];
    }
    for (int i = 0; i < m_rows; i++) {
        float s = 0.0f;
        for (int j = 0; j < 16; j++) s += acc[i][j];
        out[i] = s;
    }
#endif
}

/* y[m, n] (at y + m*ldy + n) = x[M, K] @ W^T (+ bias[N]), W given as N rows of ggml blocks of
 * `qtype`, `row_stride` bytes apart; x is row-major and contiguous. `ldy` lets a fused layer
 * whose row ranges come in different types write each range into its columns of one output.
 * Returns 0, or -1 for an unsupported type or a K that is not a multiple of the block. */
int pkv_gemv_q(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
               int64_t row_stride, const float *bias, float *y, int64_t ldy) {
    int bb = pkv_block_bytes(qtype), bw = pkv_block_weights(qtype);
    if (bb == 0 || K % bw) return -1;
    int64_t nblocks = K / bw;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float out[MAX_M];
        for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
            int64_t mr = M - m0 < MAX_M ? M - m0 : MAX_M;
            if (bw == QK_K)
                gemv_row_k(qtype, x + m0 * K, mr, K, nblocks, w + n * row_stride, bb, out);
            else
                gemv_row(qtype, x + m0 * K, mr, K, nblocks, w + n * row_stride, bb, out);
            for (int64_t i = 0; i < mr; i++) y[(m0 + i) * ldy + n] = out[i] + (bias ? bias[n] : 0.0f);
        }
    }
    return 0;
}

/* Dequantize rows into float32 (same values as the kernel uses): w [N rows] -> out [N, K]. */
int pkv_dequant(int qtype, const uint8_t *w, int64_t N, int64_t K, int64_t row_stride, float *out) {
    int bb = pkv_block_bytes(qtype), bw = pkv_block_weights(qtype);
    if (bb == 0 || K % bw) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K / bw; k++) {
            const uint8_t *b = w + n * row_stride + k * bb;
            if (bw == QK_K)
                dequant_superblock(qtype, b, out + n * K + k * bw);
            else
                dequant_block(qtype, b, out + n * K + k * bw);
        }
    return 0;
}

/* ------------------------------------------------------------------ paged decode attention */

/* The attention kernel reads K/V stored as float32, bfloat16 or float16 (converted exactly to
 * float32 in registers); 16-bit masked loads need AVX-512 BW/VL besides F. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PKV_ATTN_AVX512 1
#else
#define PKV_ATTN_AVX512 0
#endif
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
#else
static inline void exp_inplace(float *s, int64_t n) {
    for (int64_t i = 0; i < n; i++) s[i] = expf(s[i]);
}
#endif

enum { TILE = 64, MAX_ACC = 16384 };  /* keys per tile; floats of per-item accumulators */

typedef struct {
    const float *q;
    const char *k, *v;  /* K/V of kvt, esz bytes an element; strides below count elements */
    int64_t q_stride, Hq, Hkv, G, D, Dv, kb, kt, kh, vb, vt, vh, block_size, bt_stride, window;
    const int32_t *block_table, *seq_lens;
    float scale, *out, *lse;
    int64_t out_stride;
    int kvt, esz;
} decode_args;

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

/* KV heads [h0, h1) of row r: every tile of keys is read once for all of them (a token's heads
 * share cache lines in the usual layouts), then one online-softmax update per query head. */
static void decode_item(const decode_args *a, int64_t r, int64_t h0, int64_t h1) {
    float acc[MAX_ACC], s[256][TILE], mx[256], sum[256];
    const char *kp[TILE], *vp[TILE];
    const int64_t esz = a->esz;
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
                for (int64_t j = 0; j < n; j += 16) scores16(qr + i * D, kp + j, hk * a->kh * esz, D, a->kvt, (int)esz, s[i] + j);
                for (int64_t j = 0; j < n; j++) s[i][j] *= a->scale;
            }
        for (int64_t i = 0; i < nq; i++) {
            float m_new = mx[i];
            for (int64_t j = 0; j < n; j++) m_new = s[i][j] > m_new ? s[i][j] : m_new;
            float corr = expf(mx[i] - m_new);  /* 0 on the first tile (mx = -inf) */
            for (int64_t j = 0; j < n; j++) s[i][j] -= m_new;
            exp_inplace(s[i], n);
            float ps = 0.0f;
            for (int64_t j = 0; j < n; j++) ps += s[i][j];
            sum[i] = sum[i] * corr + ps;
            mx[i] = m_new;
            if (corr != 1.0f)
                for (int64_t c = 0; c < Dv; c++) acc[i * Dv + c] *= corr;
        }
        for (int64_t hk = h0; hk < h1; hk++)
            for (int64_t g = 0; g < a->G; g++) {
                int64_t i = (hk - h0) * a->G + g;
                accumulate_tile(acc + i * Dv, s[i], vp, hk * a->vh * esz, n, Dv, a->kvt, (int)esz);
            }
    }
    for (int64_t i = 0; i < nq; i++) {
        int64_t h = h0 * a->G + i;
        float *o = a->out + r * a->out_stride + h * Dv, inv = 1.0f / sum[i];
        for (int64_t c = 0; c < Dv; c++) o[c] = acc[i * Dv + c] * inv;
        if (a->lse) a->lse[r * a->Hq + h] = mx[i] + logf(sum[i]);
    }
}

/* Decode attention straight from the paged cache (no gather copy), online softmax per query
 * head. Row r has one query q[r] ([Hq, D] at q + r*q_stride) at position seq_lens[r]-1 and
 * reads its keys through block_table[r] (bt_stride int32s apart): keys max(0, len - window) ..
 * len-1 (window <= 0: all). K element (block, token, head, i) is at
 * k + block*kb + token*kt + head*kh + i elements (same for V with vb/vt/vh), each a float32,
 * bfloat16 or float16 as kv_type says (KV_F32/KV_BF16/KV_F16). Query head h uses KV head
 * h / (Hq/Hkv). Writes out[r] ([Hq, Dv] at out + r*out_stride) and, if lse is not NULL,
 * lse[r*Hq + h] (natural log-sum-exp of the scaled logits).
 *
 * Work split: with enough rows, one task per row covering all its KV heads (each K/V cache line
 * is fetched once); with few rows (batch-1 decode), one task per (row, KV head) so every thread
 * has work. Returns -1 (nothing written) when even one KV head's query group does not fit the
 * accumulators (G*Dv > MAX_ACC or G > 256), else 0. */
int pkv_paged_decode(const float *q, int64_t q_stride, int64_t num_rows, int64_t Hq, int64_t Hkv,
                     int64_t D, int64_t Dv, const void *k, int64_t kb, int64_t kt, int64_t kh,
                     const void *v, int64_t vb, int64_t vt, int64_t vh, int64_t block_size,
                     const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens,
                     int64_t window, float scale, float *out, int64_t out_stride, float *lse, int kv_type) {
    if (Hkv <= 0 || Hq % Hkv || kv_type < KV_F32 || kv_type > KV_F16) return -1;
    int64_t G = Hq / Hkv;
    if (G * Dv > MAX_ACC || G > 256) return -1;
    decode_args a = {q, (const char *)k, (const char *)v, q_stride, Hq, Hkv, G, D, Dv, kb, kt, kh, vb, vt, vh,
                     block_size, bt_stride, window, block_table, seq_lens, scale, out, lse, out_stride,
                     kv_type, kv_type == KV_F32 ? 4 : 2};
    int threads = omp_get_max_threads();
    if (num_rows >= 2 * threads && Hq * Dv <= MAX_ACC && Hq <= 256) {
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t r = 0; r < num_rows; r++) decode_item(&a, r, 0, Hkv);
    } else {
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
        for (int64_t r = 0; r < num_rows; r++)
            for (int64_t hk = 0; hk < Hkv; hk++) decode_item(&a, r, hk, hk + 1);
    }
    return 0;
}
