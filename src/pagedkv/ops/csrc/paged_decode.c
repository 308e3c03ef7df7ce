/* pkv_paged_decode: the decode attention's entry point (argument checks, the format's
 * constants, the work split over OpenMP threads).
 * Part of the unity build: compiled only as included by cpu_kernels.c (see there), after
 * decode_attention_quant.c. */
#include "decode_attention.h"
#include "kv_formats.h"

/* Decode attention straight from the paged cache (no gather copy), online softmax per query
 * head. Row r has one query q[r] ([Hq, D] at q + r*q_stride) at position seq_lens[r]-1 and
 * reads its keys through block_table[r] (bt_stride int32s apart): keys max(0, len - window) ..
 * len-1 (window <= 0: all). K element (block, token, head, i) is at
 * k + block*kb + token*kt + head*kh + i elements (same for V with vb/vt/vh), each a float32,
 * bfloat16 or float16 as kv_type says (KV_F32/KV_BF16/KV_F16). Query head h uses KV head
 * h / (Hq/Hkv). Writes out[r] ([Hq, Dv] at out + r*out_stride) and, if lse is not NULL,
 * lse[r*Hq + h] (natural log-sum-exp of the scaled logits).
 *
 * Quantized caches (kv_type KV_I8_TH .. KV_FP8_TH16): k/v are bytes and the strides count
 * bytes; the (block, token, head) part starts at k + block*kb + token*kt + head*kh, laid out
 * as pagedkv/ops/kv_quant.py says. k_scale/v_scale: the per-tensor fp8 scales (ignored by
 * the per-token-head modes); k_group/v_group: values per scale group of a K/V part
 * (KV_I4_GROUP, KV_I3_GROUP, KV_I2_GROUP: a multiple of 16 or the whole part; int3/int2 need
 * head sizes that are multiples of 8).
 *
 * Work split: with enough rows, one task per row covering all its KV heads (each K/V cache line
 * is fetched once); with few rows (batch-1 decode), one task per (row, KV head) so every thread
 * has work. Returns -1 (nothing written) for an unknown kv_type or group size, or when even one
 * KV head's query group does not fit the accumulators (G*Dv > MAX_ACC or G > 256), else 0. */
int pkv_paged_decode(const float *q, int64_t q_stride, int64_t num_rows, int64_t Hq, int64_t Hkv,
                     int64_t D, int64_t Dv, const void *k, int64_t kb, int64_t kt, int64_t kh,
                     const void *v, int64_t vb, int64_t vt, int64_t vh, int64_t block_size,
                     const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens,
                     int64_t window, float scale, float *out, int64_t out_stride, float *lse, int kv_type,
                     float k_scale, float v_scale, int64_t k_group, int64_t v_group) {
    if (Hkv <= 0 || Hq % Hkv || kv_type < KV_F32 || D <= 0 || Dv <= 0) return -1;
    if (kv_type > KV_FP8_TH16 && !kv_is_lowbit(kv_type)) return -1;
    int s16 = kv_type == KV_I8_TH16 || kv_type == KV_FP8_TH16;
    if (s16) kv_type = kv_type == KV_I8_TH16 ? KV_I8_TH : KV_FP8_TH;
    int64_t G = Hq / Hkv;
    if (G * Dv > MAX_ACC || G > 256) return -1;
    int quant = kv_type >= KV_I8_TH;
    decode_args a = {q, (const char *)k, (const char *)v, q_stride, Hq, Hkv, G, D, Dv, kb, kt, kh, vb, vt, vh,
                     block_size, bt_stride, window, block_table, seq_lens, scale, out, lse, out_stride,
                     kv_type, kv_type == KV_F32 ? 4 : kv_type <= KV_F16 ? 2 : 1,
                     1.0f, 1.0f, D, Dv, D, Dv, 0, 0, s16};
    if (quant) {
        int e4m3 = kv_type == KV_FP8_TH || kv_type == KV_FP8_E4M3;
        int tensor = kv_type == KV_FP8_E4M3 || kv_type == KV_FP8_E5M2;
        a.kmul = (tensor ? k_scale : 1.0f) * (e4m3 ? 256.0f : 1.0f);
        a.vmul = (tensor ? v_scale : 1.0f) * (e4m3 ? 256.0f : 1.0f);
        if (kv_is_group(kv_type)) {
            if (k_group <= 0 || v_group <= 0 || D % k_group || Dv % v_group || (k_group % 16 && k_group != D) ||
                (v_group % 16 && v_group != Dv) || (D + 15) / 16 > MAXG || (Dv + 15) / 16 > MAXG)
                return -1;
            /* int3/int2: whole bytes per part and 8-value chunks on byte boundaries */
            if (kv_is_lowbit(kv_type) && (D % 8 || Dv % 8)) return -1;
            a.kgroup = k_group;
            a.vgroup = v_group;
        }
        a.kvals = kv_code_bytes(kv_type, D);
        a.vvals = kv_code_bytes(kv_type, Dv);
        int64_t ks = kv_is_group(kv_type) ? 2 * (D / a.kgroup) : kv_token_scaled(kv_type) ? (s16 ? 2 : 4) : 0;
        int64_t vs = kv_is_group(kv_type) ? 2 * (Dv / a.vgroup) : kv_token_scaled(kv_type) ? (s16 ? 2 : 4) : 0;
        a.kpart = a.kvals + ks;
        a.vpart = a.vvals + vs;
    }
    void (*item)(const decode_args *, int64_t, int64_t, int64_t) = quant ? decode_item_q : decode_item;
    int threads = omp_get_max_threads();
    if (num_rows >= 2 * threads && Hq * Dv <= MAX_ACC && Hq <= 256) {
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t r = 0; r < num_rows; r++) item(&a, r, 0, Hkv);
    } else {
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
        for (int64_t r = 0; r < num_rows; r++)
            for (int64_t hk = 0; hk < Hkv; hk++) item(&a, r, hk, hk + 1);
    }
    return 0;
}
