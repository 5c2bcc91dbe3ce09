/*
 * A whole Llama-family decode step for a few requests in one native call (bf16 activations, a bf16 or fp8 KV
 * pool, CPU): the CPU
 * counterpart of replaying a captured CUDA graph. At batch 1 the Python and dispatch overhead of ~300 small
 * calls per step costs about as much as streaming the weights, so the layer loop runs here instead.
 *
 * It calls exactly the kernels the modular path calls for a few rows (rms_norm, the AMX linear when the
 * weights are packed for it, else linear_small, or on builds for AVX2 without AVX-512 tile_avx2.c's
 * avx2_bf16_linear; rope, paged attention with the fused K/V write, silu_and_mul), in the same order with the
 * same roundings, so its logits are bit-identical to the modular path's wherever that path picks the same
 * linear kernel. This file includes the kernels' sources and builds
 * them as one library.
 *
 * Per layer l, `layer_ptrs[l * LAYER_FIELDS + f]` holds the address of field f (see enum below); a missing
 * QKV bias is 0, and so are the *_AMX fields when the weights have no AMX-packed copy (then every linear
 * streams the plain weight through linear_small). A model whose weights are kept quantized (a GGUF's blocks)
 * sets the *_Q fields to its linears' segment descriptors (see step_quant_linear) and passes `lm_head_q`:
 * its matmuls are then csrc/quant_gemm.c's quant_linear, the very kernel the modular path calls.
 *
 * Qwen3-style layers: F_Q_NORM / F_K_NORM (per-head RMSNorm weights of q and k, applied before RoPE by
 * qk_head_norm_bf16, the modular path's kernel). Mixture-of-experts layers: F_MOE points at the block's
 * descriptor (MOE_* fields: router, top-k, renormalization, per expert the GGUF type and data of gate_up and
 * down) and the MLP fields are unused; the block is csrc/quant_moe.c's moe_block_bf16, routed by the modular
 * path's router kernel, and its float32 sum is rounded to bf16 as the modular path rounds it.
 */
#include "bf16_common.h"
#include <math.h>
#include <stdlib.h>

/* built inside kernels.c, after the kernels it calls */

enum {
    F_QKV, F_QKV_BIAS, F_O, F_GATE_UP, F_DOWN, F_LN_IN, F_LN_POST, F_K_POOL, F_V_POOL,
    F_QKV_AMX, F_O_AMX, F_GATE_UP_AMX, F_DOWN_AMX, F_QKV_Q, F_O_Q, F_GATE_UP_Q, F_DOWN_Q, F_Q_NORM, F_K_NORM,
    F_MOE, LAYER_FIELDS
};

/* An MoE block's descriptor (F_MOE; 0 for a dense MLP): its int64 fields, in this order. */
enum { MOE_ROUTER, MOE_EXPERTS, MOE_TOP_K, MOE_RENORMALIZE, MOE_INTER, MOE_GU_TYPE, MOE_GU_DATA, MOE_DOWN_TYPE,
       MOE_DOWN_DATA, MOE_FIELDS };

KERNEL_API int decode_moe_fields(void) { return MOE_FIELDS; }

KERNEL_API int decode_layer_fields(void) { return LAYER_FIELDS; }

#define P(l, f) ((uint16_t *)(intptr_t)layer_ptrs[(int64_t)(l) * LAYER_FIELDS + (f)])
#define Q(l, f) ((const int64_t *)(intptr_t)layer_ptrs[(int64_t)(l) * LAYER_FIELDS + (f)])

/* A linear layer kept quantized (csrc/quant_gemm.c): `desc` = {segment count, the address of its input order
 * (int64 [k]; 0: none), then per segment its GGUF type, its rows and the address of its re-laid-out bytes}; the
 * segments' rows stack in order (a merged projection may hold parts of different types). Output features
 * [row, row + rows) of `out` come from one segment. With an input order (a GPTQ act-order layer, its columns
 * sorted by group) x's features are first gathered in that order into `gathered` (bf16 [m, k] scratch), as the
 * modular path's gather does. x rows are k apart. */
static int step_quant_linear(const int64_t *desc, const uint16_t *x, const uint16_t *bias, void *out,
                             int out_is_f32, int m, int64_t n, int64_t k, int threads, uint16_t *gathered) {
    const int64_t *order = (const int64_t *)(intptr_t)desc[1];
    if (order != NULL) {
        if (gathered == NULL) return -1;
        for (int r = 0; r < m; ++r)
            for (int64_t j = 0; j < k; ++j) gathered[(int64_t)r * k + j] = x[(int64_t)r * k + order[j]];
        x = gathered;
    }
    int64_t row = 0;
    for (int64_t s = 0; s < desc[0]; ++s) {
        const int type = (int)desc[2 + 3 * s];
        const int64_t rows = desc[3 + 3 * s];
        const uint8_t *w = (const uint8_t *)(intptr_t)desc[4 + 3 * s];
        void *at = out_is_f32 ? (void *)((float *)out + row) : (void *)((uint16_t *)out + row);
        if (row + rows > n || quant_linear(type, w, rows, k, x, k, 0, m, bias == NULL ? NULL : bias + row, 0, at,
                                           n, out_is_f32, threads) != 0)
            return -1;
        row += rows;
    }
    return row == n ? 0 : -1;
}

/* One linear layer, out[m, n] = x[m, k] . W^T (+ bias): quantized when `q` (its descriptor) is given, else
 * the AMX kernel when `amx` (W packed) is given, else the bf16 streaming kernel. `gathered`: scratch for a
 * quantized layer's input order (step_quant_linear). */
static int step_linear(const uint16_t *x, const uint16_t *w, const uint16_t *amx, const int64_t *q,
                       const uint16_t *bias, uint16_t *out, int m, int64_t n, int64_t k, int threads,
                       uint16_t *gathered) {
    if (q != NULL) return step_quant_linear(q, x, bias, out, 0, m, n, k, threads, gathered);
    if (amx != NULL) return amx_linear_bf16(x, k, amx, bias, out, n, m, n, k, threads);
#if HAVE_QUANT_AVX2
    return avx2_bf16_linear(x, k, w, n, k, bias, 0, out, n, 0, m, threads);
#else
    return linear_small_bf16(x, k, w, bias, out, m, n, k, threads);
#endif
}

/* The LM head: the float32 sums stored unrounded (logits are never rounded to bf16), through the quantized
 * kernel (`q` set), the AMX kernel (`amx` set), the feature-pair kernel (`pair`, W packed by
 * pair_pack_weight) or, on AVX2 builds, the AVX2 kernel over the plain weight (`w`). */
static int step_linear_f32(const uint16_t *x, const uint16_t *amx, const uint16_t *pair, const int64_t *q,
                           const uint16_t *w, float *out, int m, int64_t n, int64_t k, int threads) {
    if (q != NULL) return step_quant_linear(q, x, NULL, out, 1, m, n, k, threads, NULL);
    if (amx != NULL) return amx_linear_bf16_f32(x, k, amx, NULL, out, n, m, n, k, threads);
    if (pair != NULL) return pair_linear_bf16_f32(x, k, pair, out, n, m, n, k, threads);
#if HAVE_QUANT_AVX2
    if (w != NULL) return avx2_bf16_linear(x, k, w, n, k, NULL, 0, out, n, 1, m, threads);
#else
    (void)w;
#endif
    return -1;
}

/* The step's attention with the fused K/V write, for the pool's element format (decode_forward_bf16's
 * kv_format: 0 bf16, 1 fp8 e4m3, 2 fp8 e5m2; csrc/paged_attention_fp8.c). */
static int step_attention(int kv_format, const uint16_t *q, int64_t q_stride, void *k, void *v,
                          const int64_t *indptr, const int64_t *indices, uint16_t *out, int m, int heads,
                          int kv_heads, int head_dim, int64_t rows, float scale, int threads, const uint16_t *k_new,
                          const uint16_t *v_new, int64_t kv_stride, const int64_t *out_loc, const int64_t *share_len,
                          const int *group_ptr, const int *members, int groups) {
    if (kv_format == 1)
        return paged_decode_attention_bf16_e4m3(q, q_stride, k, v, indptr, indices, out, m, heads, kv_heads, head_dim,
                                                rows, scale, 0.f, threads, k_new, kv_stride, v_new, kv_stride, out_loc,
                                                share_len, group_ptr, members, groups);
    if (kv_format == 2)
        return paged_decode_attention_bf16_e5m2(q, q_stride, k, v, indptr, indices, out, m, heads, kv_heads, head_dim,
                                                rows, scale, 0.f, threads, k_new, kv_stride, v_new, kv_stride, out_loc,
                                                share_len, group_ptr, members, groups);
    if (kv_format != 0) return -1;
    return paged_decode_attention_bf16(q, q_stride, k, v, indptr, indices, out, m, heads, kv_heads, head_dim, rows,
                                       scale, 0.f, threads, k_new, kv_stride, v_new, kv_stride, out_loc, share_len,
                                       group_ptr, members, groups);
}

/* A mixture-of-experts block (desc: MOE_* fields) on normed [m, hidden]: out (bf16 [m, hidden]) = the rounded
 * routing-weighted sum of the routed experts' outputs; sum (float32 [m, hidden]) is scratch. */
static int step_moe(const int64_t *desc, const uint16_t *normed, uint16_t *out, float *sum, int m, int64_t hidden,
                    int threads) {
    const int rc = moe_block_bf16(normed, m, hidden, (const float *)(intptr_t)desc[MOE_ROUTER], desc[MOE_EXPERTS],
                                  (int)desc[MOE_TOP_K], (int)desc[MOE_RENORMALIZE], desc[MOE_INTER],
                                  (const int32_t *)(intptr_t)desc[MOE_GU_TYPE],
                                  (const int64_t *)(intptr_t)desc[MOE_GU_DATA],
                                  (const int32_t *)(intptr_t)desc[MOE_DOWN_TYPE],
                                  (const int64_t *)(intptr_t)desc[MOE_DOWN_DATA], sum, threads);
    if (rc != 0) return -1;
    for (int64_t i = 0; i < (int64_t)m * hidden; ++i) out[i] = f32_to_bf16(sum[i]);
    return 0;
}

/* Returned when a tensor-parallel all-reduce failed (a peer did not arrive in time: shm_comm_missing_rank). */
#define DECODE_COMM_FAILED (-3)

/* embedded [m, hidden] (the step's token embeddings) -> logits [m, vocab_rows] (float32, before any slicing).
 * Tensor parallelism: with `tp_comm` (the TP group's shared-memory communicator, NULL in one process) the
 * weights, heads and `inter` are this rank's shard, and the outputs of o_proj and down_proj (partial sums)
 * are all-reduced in place, as RowParallelLinear does in the modular path; the logits are this rank's vocab
 * shard (the caller gathers them). Every rank must call with the same m, so the all-reduces pair up.
 * The residual stream is float32 (as in the modular path). `trace`, when not NULL, receives every layer's
 * output (bf16 [m, hidden]) then residual stream (float32 [m, hidden]), per layer (for tests). share_len ..
 * groups: the step's shared-prefix plan (see plan_shared_prefixes), or NULL/0. kv_format: the KV pool's
 * elements (see step_attention). scale: the attention's score scale as the modular path passes it (computed
 * here, -ffast-math would make 1/sqrtf an approximate reciprocal square root: not the same float). Returns 0, -1
 * when a shape is unsupported or memory runs out, or DECODE_COMM_FAILED (nothing meaningful is written then). */
KERNEL_API int decode_forward_bf16(const int64_t *layer_ptrs, int layers, const uint16_t *final_norm,
                                   const uint16_t *lm_head_amx, const uint16_t *lm_head_pair,
                                   const int64_t *lm_head_q, const uint16_t *lm_head_w, int64_t vocab_rows,
                                   const float *cos_table, const float *sin_table, int hidden, int heads,
                                   int kv_heads, int head_dim, int inter, float eps, int64_t kv_rows, int m,
                                   const uint16_t *embedded,
                                   const int64_t *positions, const int64_t *kv_indptr, const int64_t *kv_indices,
                                   const int64_t *out_loc, float *logits, uint16_t *trace, int threads,
                                   const int64_t *share_len, const int *group_ptr, const int *members,
                                   int groups, tl_shm_comm *tp_comm, int kv_format, float scale) {
    const int64_t qkv_width = (int64_t)(heads + 2 * kv_heads) * head_dim, attn_width = (int64_t)heads * head_dim;
    /* scratch buffers start on 64-byte boundaries like torch's tensors: vectorized float reductions peel
     * to alignment, so their summation order (and rounding) depends on where a row starts */
#define ALIGNED(n) (((n) + 31) / 32 * 32)
    /* (the residual stream is float32: it takes two bf16 slots per element) */
    /* the last: a quantized layer's input gathered in its order (step_quant_linear), as wide as any input */
    int64_t widest = hidden > attn_width ? hidden : attn_width;
    if (inter > widest) widest = inter;
    const int64_t sizes[9] = {ALIGNED((int64_t)m * hidden),    ALIGNED(2 * (int64_t)m * hidden),
                              ALIGNED((int64_t)m * hidden),    ALIGNED(m * qkv_width),
                              ALIGNED(m * attn_width),         ALIGNED(2 * (int64_t)m * inter),
                              ALIGNED((int64_t)m * inter),     ALIGNED(2 * (int64_t)m * hidden),
                              ALIGNED(m * widest)};
#undef ALIGNED
    int64_t total = 0;
    for (int i = 0; i < 9; ++i) total += sizes[i];
    uint16_t *scratch = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * (size_t)total);
    if (scratch == NULL) return -1;
    uint16_t *x = scratch, *normed = x + sizes[0] + sizes[1], *qkv = normed + sizes[2];
    float *residual = (float *)(x + sizes[0]);
    uint16_t *attn = qkv + sizes[3], *gate_up = attn + sizes[4], *act = gate_up + sizes[5];
    float *moe_sum = (float *)(act + sizes[6]); /* an MoE block's float32 sum */
    uint16_t *gathered = act + sizes[6] + sizes[7];
    int rc = 0, comm_failed = 0;
    memcpy(x, embedded, sizeof(uint16_t) * (size_t)m * hidden);
    for (int l = 0; l < layers && rc == 0 && !comm_failed; ++l) {
        if (l == 0) { /* first layer: the residual stream starts as the embeddings, normalized without an add */
            for (int64_t i = 0; i < (int64_t)m * hidden; ++i) residual[i] = bf16_to_f32(x[i]);
            rms_norm_bf16(x, hidden, NULL, 0, P(l, F_LN_IN), normed, NULL, m, hidden, eps, threads);
        } else {
            rms_norm_bf16_res32(x, hidden, residual, hidden, P(l, F_LN_IN), normed, residual, m, hidden, eps,
                                threads);
        }
        rc |= step_linear(normed, P(l, F_QKV), P(l, F_QKV_AMX), Q(l, F_QKV_Q), P(l, F_QKV_BIAS), qkv, m, qkv_width,
                          hidden, threads, gathered);
        if (P(l, F_Q_NORM) != NULL)
            qk_head_norm_bf16(qkv, qkv_width, m, heads, kv_heads, head_dim, P(l, F_Q_NORM), P(l, F_K_NORM), eps,
                              threads);
        rope_bf16(qkv, qkv_width, positions, cos_table, sin_table, m, heads + kv_heads, head_dim, threads);
        rc |= step_attention(kv_format, qkv, qkv_width, P(l, F_K_POOL), P(l, F_V_POOL), kv_indptr, kv_indices,
                             attn, m, heads, kv_heads, head_dim, kv_rows, scale, threads, qkv + attn_width,
                             qkv + attn_width + kv_heads * head_dim, qkv_width, out_loc, share_len, group_ptr,
                             members, groups);
        rc |= step_linear(attn, P(l, F_O), P(l, F_O_AMX), Q(l, F_O_Q), NULL, x, m, hidden, attn_width, threads,
                          gathered);
        if (rc == 0 && tp_comm != NULL && shm_allreduce_bf16(tp_comm, x, (int64_t)m * hidden, threads) != 0)
            comm_failed = 1;
        rms_norm_bf16_res32(x, hidden, residual, hidden, P(l, F_LN_POST), normed, residual, m, hidden, eps, threads);
        if (Q(l, F_MOE) != NULL) { /* (the Python side refuses MoE under TP: its all-reduce is float32) */
            rc |= tp_comm != NULL ? -1 : step_moe(Q(l, F_MOE), normed, x, moe_sum, m, hidden, threads);
        } else {
            rc |= step_linear(normed, P(l, F_GATE_UP), P(l, F_GATE_UP_AMX), Q(l, F_GATE_UP_Q), NULL, gate_up, m,
                              2 * (int64_t)inter, hidden, threads, gathered);
            silu_and_mul_bf16(gate_up, 2 * (int64_t)inter, act, m, inter, threads);
            rc |= step_linear(act, P(l, F_DOWN), P(l, F_DOWN_AMX), Q(l, F_DOWN_Q), NULL, x, m, hidden, inter,
                              threads, gathered);
            if (rc == 0 && tp_comm != NULL && shm_allreduce_bf16(tp_comm, x, (int64_t)m * hidden, threads) != 0)
                comm_failed = 1;
        }
        if (trace != NULL) { /* layer l's output and residual stream (float32), [layers][m][3][hidden] bf16 slots */
            uint16_t *at = trace + (int64_t)l * 3 * m * hidden;
            memcpy(at, x, sizeof(uint16_t) * (size_t)m * hidden);
            memcpy(at + (int64_t)m * hidden, residual, sizeof(float) * (size_t)m * hidden);
        }
    }
    if (rc == 0 && !comm_failed) {
        rms_norm_bf16_res32(x, hidden, residual, hidden, final_norm, normed, residual, m, hidden, eps, threads);
        rc |= step_linear_f32(normed, lm_head_amx, lm_head_pair, lm_head_q, lm_head_w, logits, m, vocab_rows, hidden,
                              threads);
    }
    free(scratch);
    if (comm_failed) return DECODE_COMM_FAILED;
    return rc == 0 ? 0 : -1;
}
