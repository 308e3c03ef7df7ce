#ifndef PKV_DECODE_ATTENTION_H
#define PKV_DECODE_ATTENTION_H

/* The decode attention's argument block (decode_args), shared by the float-KV and quantized-KV
 * paths, pkv_paged_decode and the layer step. */
#include "isa.h"

enum { TILE = 64, MAX_ACC = 16384 };  /* keys per tile; floats of per-item accumulators */

typedef struct {
    const float *q;
    const char *k, *v;  /* K/V of kvt, esz bytes an element; strides below count elements */
    int64_t q_stride, Hq, Hkv, G, D, Dv, kb, kt, kh, vb, vt, vh, block_size, bt_stride, window;
    const int32_t *block_table, *seq_lens;
    float scale, *out, *lse;
    int64_t out_stride;
    int kvt, esz;
    /* Quantized caches only (esz = 1: strides count bytes). kmul/vmul: constant factors of
     * every K/V value (per-tensor scales, x256 for e4m3 codes read as fp16); kgroup/vgroup:
     * values per int4 scale group; kvals/vvals: bytes of a part's values (its inline scales
     * follow); kpart/vpart: bytes of a whole part. */
    float kmul, vmul;
    int64_t kgroup, vgroup, kvals, vvals, kpart, vpart;
    int s16; /* per-token-head scales stored as fp16 (the *_per_token_head_f16 formats) */
} decode_args;

#endif  /* PKV_DECODE_ATTENTION_H */
