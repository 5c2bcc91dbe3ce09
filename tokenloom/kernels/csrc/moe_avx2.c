/*
 * quant_moe.c's experts call on the AVX2 family (CPUs with AVX2 and no AVX-512: quant_avx2.c's kernels), the
 * same contract: pairs grouped by expert, y_p = down_e(silu(gate_e(x_t)) * up_e(x_t)), out[t] = sum over t's
 * pairs of weight_p * y_p, float32 between the projections.
 *
 * Experts with fewer than quant_tile_m pairs (every expert at decode) run in one OpenMP region, its phases
 * separated by the worksharing loops' barriers, as quant_moe.c's AVX-512 form does:
 *   A  per expert: its pairs' x rows quantized to the two int8 terms in its gate_up type's lane order;
 *   B  per (expert, AVX2_MOE_ROWS gate_up rows): avx2_int8_rows -> gate_up, float32;
 *   C  per expert: act = silu(gate) * up in float32, quantized the same way for its down type;
 *   D  per (expert, AVX2_MOE_ROWS down rows): avx2_int8_rows -> y, float32;
 *   E  per 16 output columns: out[t] += weight_p * y_p over the pairs in order.
 * A decode step's eight experts cost four barriers, not sixteen OpenMP regions (Zen 3, a Qwen3-MoE-shaped
 * Q4_K_M model at batch 1: see docs/benchmarks.md, session 44). Experts with more pairs (prefill) run first,
 * one by one through quant_linear (the float32 tile, float32 act into down). Each pair's sums are those of
 * quant_linear for its rows (avx2_int8_rows: a row's result does not depend on the rows beside it).
 *
 * Included by kernels.c after quant_gemm.c (quant_avx2.c's kernels) and before quant_moe.c, which calls it.
 */
#if !HAVE_QUANT_GEMM && HAVE_QUANT_AVX2

#define AVX2_MOE_ROWS 32 /* weight rows per work item of phases B and D */

/* One expert's quantized activation rows for one weight type, inside the call's term buffers (from row `first`
 * of them). */
static avx2_act avx2_moe_rows(const tl_quant_type *t, const void *x, int64_t x_stride, int x_is_f32, int64_t rows,
                              int64_t first, int64_t k, int terms, int16_t *q, float *dc, float *xs, int32_t *s16,
                              int8_t *q8) {
    const int64_t nb = k / TL_QK;
    q += first * k, dc += first * nb, xs += first * nb, s16 += first * (k / 16), q8 += 2 * first * k;
    avx2_quantize_rows(x, x_stride, x_is_f32, k, terms, q, dc, xs, 0, rows);
    for (int64_t r = 0; r < rows; ++r) avx2_lanes_act(t->type, q + r * k, k, s16 + r * (k / 16), q8 + 2 * r * k);
    return (avx2_act){q, dc, xs, s16, q8, rows, k};
}

/* Work item i of a phase over the small experts: (expert, weight rows [n0, n1)) of weights with n rows. */
static int64_t avx2_moe_item(const int64_t *small, int64_t n, int64_t i, int64_t *n0, int64_t *n1) {
    const int64_t per = (n + AVX2_MOE_ROWS - 1) / AVX2_MOE_ROWS;
    *n0 = i % per * AVX2_MOE_ROWS;
    *n1 = *n0 + AVX2_MOE_ROWS < n ? *n0 + AVX2_MOE_ROWS : n;
    return small[i / per];
}

static int avx2_moe_experts(int64_t hidden, int64_t inter, const uint16_t *x, int64_t pairs,
                            const int64_t *pair_token, const float *pair_weight, int64_t groups,
                            const int64_t *group_start, const int32_t *gu_type, const int64_t *gu_data,
                            const int32_t *down_type, const int64_t *down_data, float *out, int threads) {
    const int terms = quant_act_residual_on ? 2 : 1;
    const int64_t kmax = hidden > inter ? hidden : inter, tile_from = quant_tile_m(-1);
    /* the experts below quant_tile_m pairs (their own phases) and where their pairs' int8 terms start */
    int64_t *small = malloc(sizeof(int64_t) * (size_t)(2 * groups + 1));
    if (small == NULL) return QUANT_E_MEMORY;
    int64_t *term_at = small + groups, n_small = 0, term_rows = 0;
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t rows = group_start[g + 1] - group_start[g];
        if (rows < tile_from && rows < AVX2_TILE_M) { /* (sums below holds AVX2_TILE_M - 1 rows) */
            term_at[n_small] = term_rows;
            small[n_small++] = g;
            term_rows += rows;
        }
    }
    const int64_t tr = term_rows > 0 ? term_rows : 1; /* the int8 terms only for the small experts' pairs */
    uint16_t *xg = malloc(sizeof(uint16_t) * (size_t)(pairs * hidden));
    float *gate_up = malloc(sizeof(float) * (size_t)(pairs * (2 * inter + hidden))); /* then y */
    int16_t *q = malloc(sizeof(int16_t) * (size_t)(tr * kmax));
    float *dc = malloc(sizeof(float) * (size_t)(2 * tr * (kmax / TL_QK)));
    int32_t *s16 = malloc(sizeof(int32_t) * (size_t)(tr * (kmax / 16)));
    int8_t *q8 = malloc((size_t)(2 * tr * kmax));
    avx2_act *acts = malloc(sizeof(avx2_act) * (size_t)(groups + 1));
    if (!xg || !gate_up || !q || !dc || !s16 || !q8 || !acts || !small) {
        free(xg); free(gate_up); free(q); free(dc); free(s16); free(q8); free(acts); free(small);
        return QUANT_E_MEMORY;
    }
    float *xs = dc + tr * (kmax / TL_QK), *y = gate_up + pairs * 2 * inter;
    int rc = QUANT_OK;
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t first = group_start[g], rows = group_start[g + 1] - first;
        for (int64_t r = 0; r < rows; ++r)
            memcpy(xg + (first + r) * hidden, x + pair_token[first + r] * hidden, sizeof(uint16_t) * (size_t)hidden);
        if (rows < tile_from && rows < AVX2_TILE_M) continue; /* a small expert: the region below */
        float *gu = gate_up + first * 2 * inter;
        rc = quant_linear(gu_type[g], (const uint8_t *)(intptr_t)gu_data[g], 2 * inter, hidden, xg + first * hidden,
                          hidden, 0, rows, NULL, 0, gu, 2 * inter, 1, threads);
        if (rc != QUANT_OK) break;
        const int team = rows * inter >= (1 << 16) ? threads : 1;
        _Pragma("omp parallel for schedule(static) num_threads(team)")
        for (int64_t r = 0; r < rows; ++r) swiglu_row_f32(gu + r * 2 * inter, inter);
        rc = quant_linear(down_type[g], (const uint8_t *)(intptr_t)down_data[g], hidden, inter, gu, 2 * inter, 1,
                          rows, NULL, 0, y + first * hidden, hidden, 1, threads);
        if (rc != QUANT_OK) break;
    }
    const int64_t gu_items = n_small * ((2 * inter + AVX2_MOE_ROWS - 1) / AVX2_MOE_ROWS);
    const int64_t dn_items = n_small * ((hidden + AVX2_MOE_ROWS - 1) / AVX2_MOE_ROWS);
    if (rc == QUANT_OK) {
        _Pragma("omp parallel num_threads(threads)")
        {
            float sums[(AVX2_TILE_M - 1) * AVX2_MOE_ROWS];
            _Pragma("omp for schedule(static)")
            for (int64_t i = 0; i < n_small; ++i) { /* A */
                const int64_t g = small[i], first = group_start[g];
                acts[g] = avx2_moe_rows(tl_quant_lookup(gu_type[g]), xg + first * hidden, hidden, 0,
                                        group_start[g + 1] - first, term_at[i], hidden, terms, q, dc, xs, s16, q8);
            }
            _Pragma("omp for schedule(static)")
            for (int64_t i = 0; i < gu_items; ++i) { /* B */
                int64_t n0, n1;
                const int64_t g = avx2_moe_item(small, 2 * inter, i, &n0, &n1), first = group_start[g];
                avx2_int8_rows(tl_quant_lookup(gu_type[g]), (const uint8_t *)(intptr_t)gu_data[g], hidden, &acts[g],
                               n0, n1, sums);
                for (int64_t r = 0; r < acts[g].m; ++r)
                    memcpy(gate_up + (first + r) * 2 * inter + n0, sums + r * (n1 - n0),
                           sizeof(float) * (size_t)(n1 - n0));
            }
            _Pragma("omp for schedule(static)")
            for (int64_t i = 0; i < n_small; ++i) { /* C */
                const int64_t g = small[i], first = group_start[g], rows = group_start[g + 1] - first;
                float *gu = gate_up + first * 2 * inter;
                for (int64_t r = 0; r < rows; ++r) swiglu_row_f32(gu + r * 2 * inter, inter);
                acts[g] = avx2_moe_rows(tl_quant_lookup(down_type[g]), gu, 2 * inter, 1, rows, term_at[i], inter,
                                        terms, q, dc, xs, s16, q8);
            }
            _Pragma("omp for schedule(static)")
            for (int64_t i = 0; i < dn_items; ++i) { /* D */
                int64_t n0, n1;
                const int64_t g = avx2_moe_item(small, hidden, i, &n0, &n1), first = group_start[g];
                avx2_int8_rows(tl_quant_lookup(down_type[g]), (const uint8_t *)(intptr_t)down_data[g], inter,
                               &acts[g], n0, n1, sums);
                for (int64_t r = 0; r < acts[g].m; ++r)
                    memcpy(y + (first + r) * hidden + n0, sums + r * (n1 - n0), sizeof(float) * (size_t)(n1 - n0));
            }
            _Pragma("omp for schedule(static)")
            for (int64_t c0 = 0; c0 < hidden; c0 += 16) { /* E */
                const int64_t c1 = c0 + 16 < hidden ? c0 + 16 : hidden;
                for (int64_t p = 0; p < pairs; ++p) {
                    float *dst = out + pair_token[p] * hidden;
                    const float *src = y + p * hidden, w = pair_weight[p];
                    for (int64_t j = c0; j < c1; ++j) dst[j] += w * src[j];
                }
            }
        }
    }
    free(xg); free(gate_up); free(q); free(dc); free(s16); free(q8); free(acts); free(small);
    return rc;
}
#endif
