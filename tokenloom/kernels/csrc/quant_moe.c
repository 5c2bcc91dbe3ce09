/*
 * Mixture-of-experts feed-forward over GGUF-quantized experts in one call (layers/moe.py's native path):
 * for the step's (token, expert) pairs, grouped by expert, y_p = down_e(silu(gate_e(x_t)) * up_e(x_t)) and
 * out[t] = sum over t's pairs p of weight_p * y_p.
 *
 * Why one call: at decode an MoE layer runs k experts of a few rows each; expert by expert through
 * quant_linear that is ~10 small torch ops and two OpenMP regions per expert, and on two cores the wake-ups
 * and op overheads cost several times the weight reads. Here one OpenMP region covers the layer, its phases
 * separated by the worksharing loops' barriers:
 *   A  per sub-batch (up to SUB_ROWS pairs of one expert): gather the pairs' x rows, quantize them to int8
 *      in two terms (quant_gemm.c's quantize_act: the value and its rounding remainder);
 *   B  per (sub-batch, 64 gate_up rows): the type's dot kernel -> gate_up, float32;
 *   C  per sub-batch: act = silu(gate) * up in float32, quantized the same way;
 *   D  per (sub-batch, 64 down rows): the dot kernel -> y, float32;
 *   E  per 16 output columns: out[t] = sum of weight_p * y_p over the pairs in order (no two threads write
 *      the same element; the sum order is the pairs' order, so the result does not depend on the threads).
 * The numerics are quant_linear's small path (the same int8 terms and dot kernels) with float32 in place of
 * the modular path's bf16 roundings between the projections.
 * On CPUs with AVX2 and no AVX-512 (quant_avx2.c's family) moe_avx2.c meets the same contract with that
 * family's kernels (the same phases in one region; float32 between the projections; the sum E in pair order).
 *
 * Inputs: x bf16 [T, hidden]; pairs sorted by expert: pair_token[P] (row of x), pair_weight[P] (float32);
 * groups: group_start[G + 1] (pair offsets), per group the expert's gate_up ([2 * inter, hidden], gate rows
 * then up rows) and down ([hidden, inter]) weights as (type, repacked data). out float32 [T, hidden], written
 * whole. Returns 0 or a negative QUANT_E* code.
 *
 * Also here: the router (`moe_route_bf16`: logits, softmax, top-k, renormalization, shared by the modular path
 * and the native decode step so the two route identically) and `moe_block_bf16`, a whole MoE block for the
 * native decode step (route, group the pairs by expert exactly as layers/moe.py's stable argsort does, run
 * quant_moe).
 */
#include <math.h>

#define SUB_ROWS 8 /* pairs per sub-batch: two int8 terms each fit the dot kernels' SMALL_M_LIMIT rows */
/* Weight rows per work item of phases B and D: a dot call prepares its activations once (quant_gemm.c's
 * small_item_rows says why larger items pay), and a decode step's experts still give the threads dozens of
 * items each. */
#define MOE_CHUNK_ROWS 64

#if HAVE_QUANT_GEMM
typedef struct {
    int64_t group, first, rows; /* pairs first .. first + rows - 1, all of expert group `group` */
} tl_moe_sub;

/* Phases B and D: rows [64 chunk, 64 chunk + 64) of a weight [n, k] (type, repacked data) against the sub-batch's
 * int8 activation terms (stored from its first pair on, `terms` rows per pair, as quantize_act writes them);
 * the terms' sums go to dst [pairs, n] (float32) at the sub-batch's rows. */
static void tl_moe_dot_chunk(int type, int64_t data, int64_t k, int64_t n, int64_t chunk, tl_moe_sub s,
                             const int8_t *q, const int8_t *lanes, const float *d, const int32_t *sums, int terms,
                             float *dst) {
    const tl_quant_type *t = tl_quant_lookup(type);
    const int64_t nb = k / TL_QK, n0 = chunk * MOE_CHUNK_ROWS;
    const int64_t n1 = n0 + MOE_CHUNK_ROWS < n ? n0 + MOE_CHUNK_ROWS : n;
    const tl_act_q8 a = {q + terms * s.first * k, d + terms * s.first * nb, sums + terms * s.first * nb,
                         (int)(terms * s.rows), k, lanes == NULL ? NULL : lanes + terms * s.first * k, 0};
    float buf[2 * SUB_ROWS * MOE_CHUNK_ROWS];
    t->dot_rows((const uint8_t *)(intptr_t)data, n, k / t->block * t->block_size, n0, n1, &a, buf, MOE_CHUNK_ROWS);
    for (int64_t r = 0; r < s.rows; ++r)
        for (int64_t j = 0; j < n1 - n0; ++j)
            dst[(s.first + r) * n + n0 + j] =
                buf[r * MOE_CHUNK_ROWS + j] + (terms > 1 ? buf[(s.rows + r) * MOE_CHUNK_ROWS + j] : 0.0f);
}
#endif

KERNEL_API int quant_moe(int64_t t_rows, int64_t hidden, int64_t inter, const uint16_t *x, int64_t pairs,
                         const int64_t *pair_token, const float *pair_weight, int64_t groups,
                         const int64_t *group_start, const int32_t *gu_type, const int64_t *gu_data,
                         const int32_t *down_type, const int64_t *down_data, float *out, int threads) {
#if HAVE_QUANT_GEMM || HAVE_QUANT_AVX2
    if (t_rows < 0 || pairs < 0 || groups < 0 || hidden % TL_QK || inter % TL_QK) return QUANT_E_SHAPE;
    for (int64_t g = 0; g < groups; ++g) {
        const tl_quant_type *gu = tl_quant_lookup(gu_type[g]), *dn = tl_quant_lookup(down_type[g]);
        int rc = check_shape(gu, 2 * inter, hidden);
        if (rc == QUANT_OK) rc = check_shape(dn, hidden, inter);
        if (rc != QUANT_OK) return rc;
        if (group_start[g] > group_start[g + 1]) return QUANT_E_SHAPE;
    }
    if (groups > 0 && (group_start[0] != 0 || group_start[groups] != pairs)) return QUANT_E_SHAPE;
    for (int64_t p = 0; p < pairs; ++p)
        if (pair_token[p] < 0 || pair_token[p] >= t_rows) return QUANT_E_INDEX;
    memset(out, 0, sizeof(float) * (size_t)(t_rows * hidden));
    if (pairs == 0) return QUANT_OK;
#endif
#if HAVE_QUANT_GEMM
    const int residual = quant_act_residual_on, terms = residual ? 2 : 1;
    int64_t subs = 0;
    for (int64_t g = 0; g < groups; ++g) subs += (group_start[g + 1] - group_start[g] + SUB_ROWS - 1) / SUB_ROWS;
    const int64_t nbx = hidden / TL_QK, nba = inter / TL_QK;
    tl_moe_sub *sub = malloc(sizeof(tl_moe_sub) * (size_t)subs);
    uint16_t *xg = malloc(sizeof(uint16_t) * (size_t)(pairs * hidden));        /* gathered x rows */
    int8_t *qx = malloc((size_t)(terms * pairs * hidden));                       /* their int8 terms */
    float *dx = malloc(sizeof(float) * (size_t)(terms * pairs * nbx));
    int32_t *sx = malloc(sizeof(int32_t) * (size_t)(terms * pairs * nbx));
    float *gate_up = malloc(sizeof(float) * (size_t)(pairs * 2 * inter));       /* then act in its first half */
    int8_t *qa = malloc((size_t)(terms * pairs * inter));
    float *da = malloc(sizeof(float) * (size_t)(terms * pairs * nba));
    int32_t *sa = malloc(sizeof(int32_t) * (size_t)(terms * pairs * nba));
    float *y = malloc(sizeof(float) * (size_t)(pairs * hidden));
    /* the Q4 experts' activation order (quant_legacy.c's q4_lanes_order), made once per sub-batch */
    int q4 = 0;
    for (int64_t g = 0; g < groups; ++g)
        q4 |= gu_type[g] == TL_Q4_0 || gu_type[g] == TL_Q4_1 || down_type[g] == TL_Q4_0 || down_type[g] == TL_Q4_1;
    int8_t *lx = q4 ? malloc((size_t)(terms * pairs * hidden)) : NULL;
    int8_t *la = q4 ? malloc((size_t)(terms * pairs * inter)) : NULL;
    if (!sub || !xg || !qx || !dx || !sx || !gate_up || !qa || !da || !sa || !y || (q4 && (!lx || !la))) {
        free(sub); free(xg); free(qx); free(dx); free(sx); free(gate_up); free(qa); free(da); free(sa); free(y);
        free(lx); free(la);
        return QUANT_E_MEMORY;
    }
    subs = 0;
    for (int64_t g = 0; g < groups; ++g)
        for (int64_t p = group_start[g]; p < group_start[g + 1]; p += SUB_ROWS) {
            const int64_t left = group_start[g + 1] - p;
            sub[subs++] = (tl_moe_sub){g, p, left < SUB_ROWS ? left : SUB_ROWS};
        }
    /* A sub-batch's int8 terms sit at its first pair's offset (times `terms`): rows 0 .. rows - 1 hold the
     * first term, rows .. 2 rows - 1 the remainder, as quantize_act writes them. */
    const int64_t gu_chunks = (2 * inter + MOE_CHUNK_ROWS - 1) / MOE_CHUNK_ROWS;
    const int64_t dn_chunks = (hidden + MOE_CHUNK_ROWS - 1) / MOE_CHUNK_ROWS;
    const int64_t col_chunks = (hidden + 15) / 16;

    _Pragma("omp parallel num_threads(threads)")
    {
        _Pragma("omp for schedule(static)")
        for (int64_t i = 0; i < subs; ++i) { /* A */
            const tl_moe_sub s = sub[i];
            for (int64_t r = 0; r < s.rows; ++r)
                memcpy(xg + (s.first + r) * hidden, x + pair_token[s.first + r] * hidden, sizeof(uint16_t) * hidden);
            quantize_act(xg + s.first * hidden, hidden, 0, s.rows, hidden, residual, qx + terms * s.first * hidden,
                         dx + terms * s.first * nbx, sx + terms * s.first * nbx);
            if (lx != NULL)
                q4_lanes_order(qx + terms * s.first * hidden, terms * s.rows, hidden, lx + terms * s.first * hidden);
        }
        _Pragma("omp for schedule(static)")
        for (int64_t i = 0; i < subs * gu_chunks; ++i) /* B */
            tl_moe_dot_chunk(gu_type[sub[i / gu_chunks].group], gu_data[sub[i / gu_chunks].group], hidden, 2 * inter,
                             i % gu_chunks, sub[i / gu_chunks], qx, lx, dx, sx, terms, gate_up);
        _Pragma("omp for schedule(static)")
        for (int64_t i = 0; i < subs; ++i) { /* C */
            const tl_moe_sub s = sub[i];
            for (int64_t r = 0; r < s.rows; ++r) swiglu_row_f32(gate_up + (s.first + r) * 2 * inter, inter);
            quantize_act(gate_up + s.first * 2 * inter, 2 * inter, 1, s.rows, inter, residual,
                         qa + terms * s.first * inter, da + terms * s.first * nba, sa + terms * s.first * nba);
            if (la != NULL)
                q4_lanes_order(qa + terms * s.first * inter, terms * s.rows, inter, la + terms * s.first * inter);
        }
        _Pragma("omp for schedule(static)")
        for (int64_t i = 0; i < subs * dn_chunks; ++i) /* D */
            tl_moe_dot_chunk(down_type[sub[i / dn_chunks].group], down_data[sub[i / dn_chunks].group], inter, hidden,
                             i % dn_chunks, sub[i / dn_chunks], qa, la, da, sa, terms, y);
        _Pragma("omp for schedule(static)")
        for (int64_t c = 0; c < col_chunks; ++c) { /* E */
            const int64_t c0 = c * 16, c1 = c0 + 16 < hidden ? c0 + 16 : hidden;
            for (int64_t p = 0; p < pairs; ++p) {
                float *dst = out + pair_token[p] * hidden;
                const float *src = y + p * hidden, w = pair_weight[p];
                for (int64_t j = c0; j < c1; ++j) dst[j] += w * src[j];
            }
        }
    }
    free(sub); free(xg); free(qx); free(dx); free(sx); free(gate_up); free(qa); free(da); free(sa); free(y);
    free(lx); free(la);
    return QUANT_OK;
#elif HAVE_QUANT_AVX2
    return avx2_moe_experts(hidden, inter, x, pairs, pair_token, pair_weight, groups, group_start, gu_type, gu_data,
                            down_type, down_data, out, threads);
#else
    (void)t_rows; (void)hidden; (void)inter; (void)x; (void)pairs; (void)pair_token; (void)pair_weight;
    (void)groups; (void)group_start; (void)gu_type; (void)gu_data; (void)down_type; (void)down_data; (void)out;
    (void)threads;
    return QUANT_E_TYPE;
#endif
}

/* An MoE layer's router for rows of x (bf16 [m, hidden], rows x_stride apart): logits = x . router^T in float32
 * (router float32 [experts, hidden]), softmax over the experts, the top_k largest probabilities (of equal ones,
 * the lower expert first), divided by their sum when `renormalize`. weights [m, top_k] float32 and ids
 * [m, top_k] int64, each row by descending weight (torch.topk's order). The logits are split over the threads
 * by (row, expert): at decode the router matrix (experts x hidden floats, 0.5 MB for 128 x 1024) is the read,
 * and one thread reading it alone leaves the other waiting past its spin (GOMP_SPINCOUNT) every layer. Each
 * logit is one thread's sum in a fixed order, so the result does not depend on the thread count. Returns 0 or
 * QUANT_E_SHAPE / QUANT_E_MEMORY. */
KERNEL_API int moe_route_bf16(const uint16_t *x, int64_t x_stride, int64_t m, int64_t hidden, const float *router,
                              int64_t experts, int top_k, int renormalize, float *weights, int64_t *ids,
                              int threads) {
    if (m < 0 || hidden <= 0 || experts <= 0 || top_k <= 0 || top_k > experts) return QUANT_E_SHAPE;
    if (m == 0) return QUANT_OK;
    float *xf = malloc(sizeof(float) * (size_t)(m * (hidden + experts)));
    if (xf == NULL) return QUANT_E_MEMORY;
    float *logits = xf + m * hidden;
    const int team = m * experts * hidden >= (1 << 16) && threads > 1 ? threads : 1;
    _Pragma("omp parallel num_threads(team)")
    {
        _Pragma("omp for schedule(static)")
        for (int64_t r = 0; r < m; ++r)
            for (int64_t i = 0; i < hidden; ++i) xf[r * hidden + i] = bf16_to_f32(x[r * x_stride + i]);
        _Pragma("omp for schedule(static)")
        for (int64_t re = 0; re < m * experts; ++re) {
            const float *xr = xf + (re / experts) * hidden, *w = router + (re % experts) * hidden;
            float acc = 0.f;
            for (int64_t i = 0; i < hidden; ++i) acc += xr[i] * w[i];
            logits[re] = acc;
        }
        _Pragma("omp for schedule(static)")
        for (int64_t r = 0; r < m; ++r) {
            float *p = logits + r * experts, top = p[0], sum = 0.f;
            for (int64_t e = 1; e < experts; ++e) top = p[e] > top ? p[e] : top;
            for (int64_t e = 0; e < experts; ++e) {
                p[e] = expf(p[e] - top);
                sum += p[e];
            }
            for (int64_t e = 0; e < experts; ++e) p[e] /= sum;
            float *wr = weights + r * top_k, picked = 0.f;
            int64_t *ir = ids + r * top_k;
            for (int j = 0; j < top_k; ++j) {
                int64_t best = -1;
                for (int64_t e = 0; e < experts; ++e) /* taken experts hold -1, below every probability */
                    if (p[e] >= 0.f && (best < 0 || p[e] > p[best])) best = e;
                wr[j] = p[best];
                ir[j] = best;
                picked += p[best];
                p[best] = -1.f;
            }
            if (renormalize)
                for (int j = 0; j < top_k; ++j) wr[j] /= picked;
        }
    }
    free(xf);
    return QUANT_OK;
}

/* An MoE block of the native decode step (layers/moe.py's FusedMoE with every expert on this rank): route x
 * (bf16 [m, hidden], contiguous), group the (token, expert) pairs by expert, tokens ascending within an expert
 * (the order layers/moe.py's stable argsort of the flattened ids gives), run the active experts through quant_moe
 * and leave the routing-weighted sum in out (float32 [m, hidden]). Per expert e: gate_up (gu_type[e],
 * gu_data[e]) [2 * inter, hidden] and down (down_type[e], down_data[e]) [hidden, inter]. */
static int moe_block_bf16(const uint16_t *x, int64_t m, int64_t hidden, const float *router, int64_t experts,
                          int top_k, int renormalize, int64_t inter, const int32_t *gu_type, const int64_t *gu_data,
                          const int32_t *down_type, const int64_t *down_data, float *out, int threads) {
    const int64_t pairs = m * top_k;
    float *weights = malloc(sizeof(float) * (size_t)(2 * pairs + 1));
    float *pair_weight = weights + pairs;
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)(2 * pairs + 4 * experts + 2));
    int32_t *types = malloc(sizeof(int32_t) * (size_t)(2 * experts + 1));
    if (weights == NULL || ids == NULL || types == NULL) {
        free(weights); free(ids); free(types);
        return QUANT_E_MEMORY;
    }
    int64_t *pair_token = ids + pairs, *next = pair_token + pairs, *group_start = next + experts;
    int64_t *data = group_start + experts + 1;
    int rc = moe_route_bf16(x, hidden, m, hidden, router, experts, top_k, renormalize, weights, ids, threads);
    if (rc == QUANT_OK) {
        /* counting sort of the flattened pairs by expert: stable, so tokens stay ascending within an expert */
        for (int64_t e = 0; e < experts; ++e) next[e] = 0;
        for (int64_t p = 0; p < pairs; ++p) next[ids[p]] += 1;
        int64_t groups = 0, at = 0;
        for (int64_t e = 0; e < experts; ++e) {
            const int64_t count = next[e];
            next[e] = at;
            if (count) {
                group_start[groups] = at;
                types[groups] = gu_type[e];
                types[experts + groups] = down_type[e];
                data[groups] = gu_data[e];
                data[experts + groups] = down_data[e];
                ++groups;
            }
            at += count;
        }
        group_start[groups] = pairs;
        for (int64_t p = 0; p < pairs; ++p) {
            const int64_t slot = next[ids[p]]++;
            pair_token[slot] = p / top_k;
            pair_weight[slot] = weights[p];
        }
        rc = quant_moe(m, hidden, inter, x, pairs, pair_token, pair_weight, groups, group_start, types,
                       data, types + experts, data + experts, out, threads);
    }
    free(weights); free(ids); free(types);
    return rc;
}
