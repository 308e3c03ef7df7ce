/* pkv_kivi_decode: paged decode attention over a KIVI cache (pagedkv/ops/kivi.py), read in place.
 * Part of the unity build: compiled only as included by cpu_kernels.c, after paged_decode.c.
 *
 * What a row's query (at t = len - 1) reads for key j (ops/kivi.py's hot_mask, at decode):
 * the residual's int8 part when j >= start and (j < sink or j >= hot_lo), hot_lo the first
 * position of the last `blocks` blocks; else the page's codes. So a row's keys split into at
 * most two cold ranges (codes) and two hot ranges (the residual), attended in that order with
 * one online softmax (its result does not depend on the order).
 *
 * Cold keys, one block at a time: K is coded per channel over the block, x = (c - z_d) * s_d,
 * so q . x = (q * s) . c - sum_d (q * s)_d z_d. The channel scales fold into the query once
 * per (block, KV head) (q' = q * s, bias = -q' . z), then every key of the block is one dot
 * product of q' with its codes: the low-bit group kernels of decode_attention_quant.c run it
 * with unit scales (kgroup = D, gs = 1, gz = 0). V parts are the int3/int2 group format those
 * kernels read already. Hot keys are KV_I8_TH parts with fp16 scales (the residual's format):
 * decode_item_q's per-token scaling, on pointers into the residual's ring. */
#include "decode_attention.h"
#include "kv_formats.h"

enum { KIVI_MAX_G = 16, KIVI_MAX_D = 256 };
#ifndef KIVI_AHEAD
#define KIVI_AHEAD 2
#endif

typedef struct {
    decode_args ck, cv, res; /* cold K (unit group scales), cold V, the residual's int8 K and V */
    const uint8_t *rk, *rv;  /* residual K/V: [rows, span, Hkv, D + 2] / [.., Dv + 2] bytes */
    int64_t rk_row, rk_tok, rv_row, rv_tok, sink, window, blocks;
    const int32_t *res_rows, *starts;
    unsigned zmask;          /* zero point bits in a K channel scale: 7 (int3) or 3 (int2) */
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

/* The channel scales of KV head hk's keys in a block (blk0: its first token) folded into the
 * G query rows q: qf = q * s (G rows of D), bias[g] = -qf[g] . z. */
static void kivi_fold(const kivi_args *ka, const float *q, const uint8_t *blk0, int64_t hk, float *qf, float *bias) {
    const decode_args *a = &ka->ck;
    const int64_t G = a->G, D = a->D, c = D / a->block_size;
    uint16_t h[KIVI_MAX_D];  /* channel d's scale: token d / c of the block, its (d % c)-th */
    const uint8_t *p = blk0 + hk * a->kh + a->kvals;
    if (c == 4)  /* block 16, D 64: constant-size copies (a libc call per token cost 15% of the step) */
        for (int64_t i = 0; i < a->block_size; i++) memcpy(h + 4 * i, p + i * a->kt, 8);
    else if (c == 2)
        for (int64_t i = 0; i < a->block_size; i++) memcpy(h + 2 * i, p + i * a->kt, 4);
    else
        for (int64_t i = 0; i < a->block_size; i++)
            for (int64_t e = 0; e < c; e++) h[i * c + e] = load_u16(p + i * a->kt + 2 * e);
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

/* Online softmax step and V of one tile: s (scaled logits of n keys) into acc; V parts at
 * vp[j] in format `va` (the cold group codes, or the residual's int8 with per-token scales). */
static void kivi_tile_v(const decode_args *va, int scaled, const uint8_t *const *vp, int64_t n, int64_t h0,
                        int64_t h1, float (*s)[TILE], float *mx, float *sum, float *acc) {
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
            kivi_tile_v(&ka->cv, 0, vp, n, h0, h1, s, mx, sum, acc);
            n = 0;
        }
        const uint8_t *kblk = (const uint8_t *)a->k + (int64_t)table[b] * a->kb;
        const uint8_t *vblk = (const uint8_t *)ka->cv.v + (int64_t)table[b] * ka->cv.vb;
        for (int64_t i = 0; i < m; i++) {
            kp[i] = kblk + (j0 - b * bs + i) * a->kt;
            vp[n + i] = vblk + (j0 - b * bs + i) * ka->cv.vt;
        }
        for (int64_t i = m; i < (m + 15) / 16 * 16; i++) kp[i] = kp[0];  /* padding: computed, unused */
        kivi_cold_scores(ka, qr, kblk, kp, m, h0, h1, n, s, pf);
        n += m;
        j0 = j1;
    }
    if (n) kivi_tile_v(&ka->cv, 0, vp, n, h0, h1, s, mx, sum, acc);
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
        kivi_tile_v(a, 1, vp, n, h0, h1, s, mx, sum, acc);
    }
}

/* Row r, KV heads [h0, h1): its cold and hot key ranges, one online softmax. */
static void kivi_item(const kivi_args *ka, int64_t r, int64_t h0, int64_t h1) {
    const decode_args *a = &ka->ck;
    float acc[MAX_ACC], s[KIVI_MAX_G * 16][TILE], mx[KIVI_MAX_G * 16], sum[KIVI_MAX_G * 16];
    const int64_t G = a->G, nq = (h1 - h0) * G, Dv = a->Dv, bs = a->block_size;
    const int64_t len = a->seq_lens[r], start = ka->starts[r], row = ka->res_rows[r], sink = ka->sink;
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
    if (start >= sink) {  /* cold [0, c), hot [c, len) */
        int64_t c = KMIN(KMAX(start, hot_lo), len);
        kivi_cold(ka, qr, table, 0, c, h0, h1, s, mx, sum, acc);
        kivi_hot(ka, qr, row, c, len, h0, h1, s, mx, sum, acc);
    } else {  /* cold [0, start), hot [start, sink), cold [sink, c), hot [c, len) */
        int64_t e = KMIN(sink, len), c = KMIN(KMAX(sink, hot_lo), len);
        kivi_cold(ka, qr, table, 0, start, h0, h1, s, mx, sum, acc);
        kivi_hot(ka, qr, row, start, e, h0, h1, s, mx, sum, acc);
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
 * it computed from position starts[r] on. `blocks`: the residual's recent blocks. Writes
 * out[r] ([Hq, Dv] floats). Returns -1 (nothing written) for shapes it does not cover (bits
 * other than 2/3, D or Dv not a multiple of 8, BS not dividing D or above TILE, G > 16 or
 * D > 256, a V group the group kernels refuse), else 0. */
int pkv_kivi_decode(const float *q, int64_t num_rows, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv,
                    const void *k, int64_t kb, int64_t kt, int64_t kh, const void *v, int64_t vb, int64_t vt,
                    int64_t vh, int64_t block_size, const int32_t *block_table, int64_t bt_stride,
                    const int32_t *seq_lens, const void *rk, int64_t rk_row, int64_t rk_tok, const void *rv,
                    int64_t rv_row, int64_t rv_tok, const int32_t *res_rows, const int32_t *starts, int64_t sink,
                    int64_t window, int64_t blocks, int bits, int64_t v_group, float scale, float *out) {
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
                    sink, window, blocks, res_rows, starts, bits == 3 ? 7u : 3u};
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
