/* pkv_decode_layers: every decoder layer of a Llama-family model for a small decode batch in
 * one call (see layer_step.h), and pkv_step_struct_size.
 * Part of the unity build: compiled only as included by cpu_kernels.c (see there), after
 * the other parts. */
#include "decode_attention.h"
#include "layer_step.h"

/* sizeof of the structs above (which = 0..3), so the ctypes mirrors can check their layout. */
int64_t pkv_step_struct_size(int which) {
    switch (which) {
        case 0: return (int64_t)sizeof(pkv_segment);
        case 1: return (int64_t)sizeof(pkv_linear);
        case 2: return (int64_t)sizeof(pkv_layer);
        case 3: return (int64_t)sizeof(pkv_model);
        default: return -1;
    }
}

/* Row r, KV heads [h0, h1): rotate the q heads they serve and their k heads, and write k/v at
 * the row's slot. q/k/v of the row sit at qkv + r * ld. */
static void rope_and_cache(const pkv_model *m, const pkv_layer *L, const decode_args *a, float *qkv, int64_t ld,
                           const int64_t *positions, const int64_t *slots, int64_t r, int64_t h0, int64_t h1) {
    const int64_t D = m->head_dim, Hq = m->num_heads, Hkv = m->num_kv_heads, G = Hq / Hkv;
    float *row = qkv + r * ld;
    const float *cs = m->rope + positions[r] * D;
    for (int64_t h = h0 * G; h < h1 * G; h++) rope_head(row + h * D, cs, D);
    int64_t slot = slots[r], esz = a->esz;
    for (int64_t hk = h0; hk < h1; hk++) {
        float *k = row + (Hq + hk) * D, *v = row + (Hq + Hkv + hk) * D;
        rope_head(k, cs, D);
        if (slot >= 0) {
            int64_t blk = slot / m->block_size, tok = slot % m->block_size;
            store_kv(k, D, m->kv_type, (char *)L->k_cache + (blk * L->kb + tok * L->kt + hk * L->kh) * esz);
            store_kv(v, D, m->kv_type, (char *)L->v_cache + (blk * L->vb + tok * L->vt + hk * L->vh) * esz);
        }
    }
}

/* KV splits per (row, KV head) item: 1, or, when those items do not share evenly among the
 * threads (batch 1 of 3 KV heads on 2 threads leaves one idle a third of the time), the fewest
 * that make them share evenly, each split keeping >= STEP_SPLIT_MIN keys of every row. */
enum { STEP_SPLIT_MIN = 128, STEP_MAX_SPLITS = 4 };
static int64_t kv_splits(int64_t items, int threads, int64_t M, const int32_t *seq_lens, int64_t window) {
    int64_t S = 1;
    while (S <= STEP_MAX_SPLITS && (items * S) % threads) S++;
    if (S == 1 || S > STEP_MAX_SPLITS) return 1;
    for (int64_t r = 0; r < M; r++) {
        int64_t len = seq_lens[r], keys = window > 0 && len > window ? window : len;
        if (keys < S * STEP_SPLIT_MIN) return 1;
    }
    return S;
}

/* Split s of S of row r's keys, KV heads [h0, h1), into part_out/part_lse (slot s): the same
 * decode_item over a sub-range, expressed as a row of length t1 with a window of t1 - t0. */
static void attend_split(const decode_args *a, int64_t r, int64_t h0, int64_t h1, int64_t s, int64_t S,
                         int64_t M, float *part_out, float *part_lse) {
    int64_t len = a->seq_lens[r], first = (a->window > 0 && len > a->window) ? len - a->window : 0;
    int64_t t0 = first + (len - first) * s / S, t1 = first + (len - first) * (s + 1) / S;
    int32_t lens[STEP_MAX_M];
    decode_args b = *a;
    lens[r] = (int32_t)t1;
    b.seq_lens = lens;
    b.window = t1 - t0;
    b.out = part_out + s * M * a->out_stride;
    b.lse = part_lse + s * M * a->Hq;
    decode_item(&b, r, h0, h1);
}

/* attn[r, h] from the S splits' normalised outputs and log-sum-exps (flash-decoding's merge). */
static void merge_splits(const decode_args *a, int64_t r, int64_t h, int64_t S, int64_t M, const float *part_out,
                         const float *part_lse) {
    const int64_t Dv = a->Dv, o_at = r * a->out_stride + h * Dv, l_at = r * a->Hq + h;
    float mx = -INFINITY, w[STEP_MAX_SPLITS], total = 0.0f;
    for (int64_t s = 0; s < S; s++) mx = fmaxf(mx, part_lse[s * M * a->Hq + l_at]);
    for (int64_t s = 0; s < S; s++) total += w[s] = expf(part_lse[s * M * a->Hq + l_at] - mx);
    float *o = a->out + o_at;
    for (int64_t c = 0; c < Dv; c++) {
        float acc = 0.0f;
        for (int64_t s = 0; s < S; s++) acc += w[s] * part_out[s * M * a->out_stride + o_at + c];
        o[c] = acc / total;
    }
}

/* The whole layer stack for M (1..16) decode rows of token ids[M] (int64, < vocab): writes x
 * [M, hidden] float32, the final RMSNorm of the last residual stream (LlamaModel.forward's
 * result). positions [M] int64 (each < max_pos), slots [M] int64 (< num_slots; negative: not
 * written), block_table [M, bt_stride] int32, seq_lens [M] int32 (>= 1, = position + 1 in a
 * decode step): the layers' shared attention metadata. prof: NULL, or STEP_SECTIONS doubles
 * to which thread 0 adds the seconds it spent in each section (barrier waits included):
 * norms and residual adds, qkv GEMV, RoPE + cache write + attention, o_proj GEMV, gate_up GEMV
 * + SiLU*mul, down GEMV. Returns 0; or, having touched nothing, -1 for a shape the kernel does
 * not cover and -2 for an argument out of range. */
int pkv_decode_layers(const pkv_model *m, int64_t M, const int64_t *ids, float *x, const int64_t *positions,
                      const int64_t *slots, const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens,
                      double *prof) {
    const int64_t H = m->hidden, Hq = m->num_heads, Hkv = m->num_kv_heads, D = m->head_dim, I = m->intermediate;
    if (M < 1 || M > STEP_MAX_M || Hkv <= 0 || Hq % Hkv || D <= 0 || D % 2 || m->kv_type < KV_F32 ||
        m->kv_type > KV_F16 || (Hq / Hkv) * D > MAX_ACC || Hq / Hkv > 256)
        return -1;
    for (int64_t r = 0; r < M; r++)
        if (ids[r] < 0 || ids[r] >= m->vocab || positions[r] < 0 || positions[r] >= m->max_pos ||
            slots[r] >= m->num_slots || seq_lens[r] < 1)
            return -2;
    const int64_t G = Hq / Hkv, ld = (Hq + 2 * Hkv) * D;
    const int threads = omp_get_max_threads();
    /* Per row items (all KV heads) once rows are plenty, as pkv_paged_decode splits its work. */
    const int by_row = M >= 2 * threads && Hq * D <= MAX_ACC && Hq <= 256;
    const int64_t items = by_row ? M : M * Hkv;
    size_t split_out = (size_t)(STEP_MAX_SPLITS * M * Hq * D), split_lse = (size_t)(STEP_MAX_SPLITS * M * Hq);
    /* act_q8: each thread quantizes every linear's input itself into its own q8_rows (cheap
     * next to the GEMV, and it needs no barrier: the inputs are the same on every thread). */
    const int64_t Kq = H > Hq * D ? (H > I ? H : I) : (Hq * D > I ? Hq * D : I);
    size_t qfloats = m->act_q8 ? (q8_rows_bytes(M, Kq) + sizeof(float) - 1) / sizeof(float) : 0;
    size_t shared = (size_t)(M * ld + M * Hq * D + M * H + M * I) + split_out + split_lse,
           own = (size_t)(2 * M * H) + qfloats;
    float *buf = (float *)malloc((shared + own * threads) * sizeof(float));
    if (!buf) return -1;
    float *qkv = buf, *attn = qkv + M * ld, *proj = attn + M * Hq * D, *act = proj + M * H;
    float *part_out = act + M * I, *part_lse = part_out + split_out;
#pragma omp parallel num_threads(threads)
    {
        float *res = buf + shared + own * omp_get_thread_num(), *hn = res + M * H;
        q8_rows xq_[4], *xq[4] = {NULL, NULL, NULL, NULL};  /* per linear: qkv, o, gate_up, down */
        if (m->act_q8) {
            const int64_t ks[4] = {H, Hq * D, H, I};
            for (int i = 0; i < 4; i++) xq_[i] = q8_rows_at(hn + M * H, M, ks[i]), xq[i] = &xq_[i];
        }
        for (int64_t r = 0; r < M; r++) memcpy(res + r * H, m->embed + ids[r] * H, H * sizeof(float));
        double *clock = omp_get_thread_num() == 0 ? prof : NULL, mark = clock ? omp_get_wtime() : 0.0;
#define STEP_MARK(i) if (clock) { double t_ = omp_get_wtime(); clock[i] += t_ - mark; mark = t_; }
        for (int64_t l = 0; l < m->num_layers; l++) {
            const pkv_layer *L = &m->layers[l];
            decode_args a = {.q = qkv, .k = (const char *)L->k_cache, .v = (const char *)L->v_cache,
                             .q_stride = ld, .Hq = Hq, .Hkv = Hkv, .G = G, .D = D, .Dv = D,
                             .kb = L->kb, .kt = L->kt, .kh = L->kh, .vb = L->vb, .vt = L->vt, .vh = L->vh,
                             .block_size = m->block_size, .bt_stride = bt_stride, .window = L->window,
                             .block_table = block_table, .seq_lens = seq_lens, .scale = m->scale, .out = attn,
                             .lse = NULL, .out_stride = Hq * D, .kvt = m->kv_type,
                             .esz = m->kv_type == KV_F32 ? 4 : 2, .kmul = 1.0f, .vmul = 1.0f,
                             .kgroup = D, .vgroup = D, .kvals = D, .vvals = D, .kpart = D, .vpart = D};
            rms_norm_rows(res, L->input_norm, M, H, m->eps, hn);
            if (xq[0]) q8_quantize(hn, M, H, xq[0]);
            STEP_MARK(0)
            linear_team(&L->qkv, hn, xq[0], M, qkv);
            STEP_MARK(1)
            const int64_t S = by_row ? 1 : kv_splits(items, threads, M, seq_lens, L->window);
            if (S == 1) {
#pragma omp for schedule(dynamic, 1)
                for (int64_t it = 0; it < items; it++) {
                    int64_t r = by_row ? it : it / Hkv, h0 = by_row ? 0 : it % Hkv, h1 = by_row ? Hkv : h0 + 1;
                    rope_and_cache(m, L, &a, qkv, ld, positions, slots, r, h0, h1);
                    decode_item(&a, r, h0, h1);  /* reads the new key back from the cache, as torch does */
                }
            } else {  /* q rotated and k/v written before any split reads them; then merged */
#pragma omp for schedule(static)
                for (int64_t it = 0; it < items; it++)
                    rope_and_cache(m, L, &a, qkv, ld, positions, slots, it / Hkv, it % Hkv, it % Hkv + 1);
#pragma omp for schedule(dynamic, 1)
                for (int64_t it = 0; it < items * S; it++) {
                    int64_t hk = it / S % Hkv;
                    attend_split(&a, it / S / Hkv, hk, hk + 1, it % S, S, M, part_out, part_lse);
                }
#pragma omp for schedule(static)
                for (int64_t it = 0; it < M * Hq; it++) merge_splits(&a, it / Hq, it % Hq, S, M, part_out, part_lse);
            }
            if (xq[1]) q8_quantize(attn, M, Hq * D, xq[1]);
            STEP_MARK(2)
            linear_team(&L->o, attn, xq[1], M, proj);
            STEP_MARK(3)
            for (int64_t i = 0; i < M * H; i++) res[i] += proj[i];
            rms_norm_rows(res, L->post_norm, M, H, m->eps, hn);
            if (xq[2]) q8_quantize(hn, M, H, xq[2]);
            STEP_MARK(0)
            /* gate_up and SiLU*mul: each item computes matching gate and up columns. */
#pragma omp for schedule(static)
            for (int64_t j0 = 0; j0 < I; j0 += STEP_COLS) {
                int64_t j1 = j0 + STEP_COLS < I ? j0 + STEP_COLS : I;
                float g[STEP_MAX_M * STEP_COLS], u[STEP_MAX_M * STEP_COLS];
                linear_cols(&L->gate_up, hn, xq[2], M, j0, j1, g, STEP_COLS);
                linear_cols(&L->gate_up, hn, xq[2], M, I + j0, I + j1, u, STEP_COLS);
                for (int64_t r = 0; r < M; r++) silu_mul(g + r * STEP_COLS, u + r * STEP_COLS, j1 - j0, act + r * I + j0);
            }
            if (xq[3]) q8_quantize(act, M, I, xq[3]);
            STEP_MARK(4)
            linear_team(&L->down, act, xq[3], M, proj);
            STEP_MARK(5)
            for (int64_t i = 0; i < M * H; i++) res[i] += proj[i];
        }
#pragma omp barrier
        if (omp_get_thread_num() == 0) rms_norm_rows(res, m->final_norm, M, H, m->eps, x);
        STEP_MARK(0)
#undef STEP_MARK
    }
    free(buf);
    return 0;
}
