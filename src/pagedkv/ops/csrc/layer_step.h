#ifndef PKV_LAYER_STEP_H
#define PKV_LAYER_STEP_H

/* ------------------------------------------------------------ whole-layer decode step
 *
 * pkv_decode_layers runs every decoder layer of a plain Llama-family model (Llama, Mistral,
 * Qwen2) for the M <= 16 rows of one decode step in ONE call, then the final RMSNorm: per layer
 * RMSNorm -> fused qkv GEMV (+ bias) -> RoPE (rotate-half, cos/sin rows of a precomputed table)
 * -> K/V written to the paged cache at the slot mapping -> paged decode attention (decode_item
 * above) -> o_proj -> residual -> RMSNorm -> gate_up GEMV fused with SiLU*mul -> down ->
 * residual. Why: at batch 1 the ~300 small torch ops and ctypes calls of a step cost as much as
 * its GEMVs; here they are a few microseconds of C.
 *
 * One OpenMP team for the whole step. GEMV output columns and (row, KV head) attention items
 * are shared out with `omp for` (items that do not share evenly among the threads are cut
 * along long rows' keys and merged by log-sum-exp); the cheap row-wise glue (residual adds,
 * norms) is done by every thread on its own copy of the residual stream, which saves a
 * barrier per op and gives identical values on every thread (same code, same order).
 *
 * Float32 math. The GEMVs are exactly pkv_gemv_q's (bit-identical results for the ggml rows),
 * RoPE rounds its products and sums separately like RotaryEmbedding.apply (bit-identical), the
 * K/V writes round like torch's .to(bfloat16/float16) (bit-identical cache contents); norms
 * and SiLU differ from torch's only in summation order / exp ulps. */

/* The step's pointer tables (ops/native_step.py mirrors them with ctypes: keep in step). */
/* STEP_BF16: a segment of plain bfloat16 rows (ggml's own GGML_TYPE_BF16 number). */
enum { STEP_F32 = 0, STEP_BF16 = 30, STEP_MAX_SEGS = 8, STEP_MAX_M = 16, STEP_COLS = 16, STEP_SECTIONS = 6 };

typedef struct {
    int64_t start, end;    /* output rows [start, end) of the layer held by this segment */
    const uint8_t *w;      /* its (end - start) rows of ggml blocks, row_stride bytes apart */
    int64_t row_stride;
    int32_t qtype, pad_;
} pkv_segment;

typedef struct {
    int64_t N, K;
    const float *dense;    /* float32 [N, K] (ldw floats a row): used without segments or above max_rows */
    int64_t ldw;
    const float *bias;     /* [N] or NULL */
    int32_t nseg, max_rows;
    pkv_segment seg[STEP_MAX_SEGS];
} pkv_linear;

typedef struct {
    const float *input_norm, *post_norm;   /* [H] */
    pkv_linear qkv, o, gate_up, down;      /* qkv: [q | k | v] rows; gate_up: [gate | up] */
    void *k_cache, *v_cache;               /* [NB, BS, Hkv, D] of kv_type; strides in elements */
    int64_t kb, kt, kh, vb, vt, vh;
    int64_t window;                        /* sliding window (0: none) */
} pkv_layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t block_size, num_slots;         /* num_slots = NB * BS: every slot must lie below */
    int64_t max_pos;                       /* rows of the rope table */
    const float *rope;                     /* [max_pos, head_dim]: cos | sin (head_dim / 2 each) */
    int64_t vocab;
    const float *embed;                    /* [vocab, H] token embeddings */
    const float *final_norm;               /* [H] */
    const pkv_layer *layers;
    float eps, scale;
    int32_t kv_type;
    int32_t act_q8;                        /* 1: the 32-weight ggml segments take x quantized to
                                              8-bit blocks (gemv_q8.c; the opt-in q8 mode) */
} pkv_model;

#endif  /* PKV_LAYER_STEP_H */
