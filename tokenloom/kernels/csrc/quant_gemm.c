/*
 * The GGUF-quantized matmul driver: out[m, n] = x[m, k] . W^T (+ bias) with W kept quantized (one row of GGUF
 * blocks per output feature, re-laid-out by the type's repack), plus row dequantize (embedding lookup, full
 * dequantize). The per-type work is in the family files (quant_legacy.c, quant_kquants.c, quant_q5.c; quant_common.h).
 *
 * Three paths, chosen by the number of rows m (quant_path):
 *  - few rows (decode, m <= quant_small_m_max, bf16 x): a stream over W. x is quantized once per call to int8
 *    per 32-element block (tl_act_q8) in two terms, the second the first's rounding remainder (as extra
 *    activation rows, so one pass over the weight serves both); weight rows are split evenly over OpenMP
 *    threads in items of up to SMALL_ITEM_ROWS and each item goes through the type's vpdpbusd dot kernel (each
 *    row's two terms as one pair: tl_act_q8.paired at one row, tl_act_q8.pairs at more; every AVX-512 family
 *    takes them). The rounding of x is the only error beyond float32
 *    summation: |err| <= sum_i |w_i| * d_x(i) / 256 with d_x = max|x_block| / 127 (d_x / 2 with the second
 *    term off, quant_act_residual(0)).
 *  - more rows of bf16 x where AMX does not run (m >= quant_batch_m, every type with a u8_row): the same two
 *    int8 terms (quant_batch_residual(0): one) against integer weight tiles, register-blocked over many rows
 *    (quant_batch.c), same bound.
 *  - the other many-row cases (prefill, batched decode) and every float32 x: per thread, a tile of up to 64
 *    weight rows is dequantized exactly (dequant_row) into a cache-resident scratch, transposed to 16-feature
 *    vectors, and
 *    multiplied with float32 accumulators: for bf16 x, bf16 weights (the dequantized value rounded once, as
 *    loading the GGUF to bf16 would; the legacy family writes them directly) through amx_gemm.c's tiles
 *    where AMX runs, else pair_gemm.c's AVX512-BF16 register bands; for float32 x, float32 weights (exact)
 *    and float32 FMAs.
 * Outputs are float32 sums plus bias, stored unrounded (float32 out) or rounded once to bf16.
 *
 * Every entry point returns 0, or a negative QUANT_E* code (nothing meaningful is written then).
 */
#include "quant_common.h"
#include "bf16_common.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* built inside kernels.c, after pair_gemm.c (group_rows) and the family files (quant_legacy.c, quant_kquants.c,
 * quant_q5.c) */

enum { QUANT_OK = 0, QUANT_E_TYPE = -1, QUANT_E_SHAPE = -2, QUANT_E_INDEX = -3, QUANT_E_MEMORY = -4 };

#define QUANT_MAX_ROW_BYTES 65536 /* the families' in-place re-layout copies a row on the stack */
#define SMALL_ITEM_ROWS 256       /* weight rows per work item of the small-m path, at most (its output buffer) */
#define SMALL_M_LIMIT 32          /* the small path's per-item output buffer holds this many rows */
#define TILE_BLOCKS 4             /* 16-feature blocks per dequantized tile (64 rows) */

/* Rows up to which the int8 stream runs (quant_small_m below; -1: not yet decided). */
static int quant_small_m_max = -1;
/* Decode rows carry a second int8 term, the first one's rounding remainder (quantize_act): on by default, since
 * one int8 term moved SmolLM2's greedy answers further from float32 than bf16 activations do (bench/accuracy.py);
 * quant_act_residual(0) turns it off for benchmarks. */
static int quant_act_residual_on = 1;
/* Each activation row's two terms summed as one integer dot product by the kernels that can: 2 (the default)
 * at every row count of the small path (tl_act_q8.pairs), 1 at one row only (tl_act_q8.paired: how it was
 * before batched decode's pair tiles), 0 never; quant_act_pairs() sets it for benchmarks and tests. */
static int quant_act_pairs_on = 2;
/* The many-row int8 path (quant_batch.c: prefill, batches of more than quant_small_m rows) carries the second
 * term too: one term would make prefill 1.66x faster (a 64-row SmolLM2 decode step 1.2x), but prompt
 * perplexity moved (Q8_0 file +0.35% against +0.01% of float32) and greedy answers after a one-term prefill
 * fell below transformers bf16's (bench/accuracy.py without AMX, docs/benchmarks.md);
 * quant_batch_residual(0) gives those rows one term (llama.cpp's Q8 activations) for A/B runs. */
static int quant_batch_residual_on = 1;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && HAVE_PAIR_GEMM
#define HAVE_QUANT_GEMM 1
#else
#define HAVE_QUANT_GEMM 0
#endif

#include "quant_avx2.c" /* the AVX2 family, built where the AVX-512 ones are not */
#include "tile_avx2.c" /* its float32 tiles (many rows), and the bf16 matmul they serve too */
#include "tile_i8_avx2.c" /* its one-term int8 tile (bf16 x, many rows) */

static const tl_quant_type *tl_quant_lookup(int type) {
#if HAVE_QUANT_GEMM
    const tl_quant_type *t = tl_legacy_type(type);
    if (t == NULL) t = tl_kquant_type(type);
    return t != NULL ? t : tl_q5_type(type);
#elif HAVE_QUANT_AVX2
    return tl_avx2_type(type);
#else
    (void)type;
    return NULL;
#endif
}

KERNEL_API int quant_type_supported(int type) { return tl_quant_lookup(type) != NULL; }

/* Which kernel family this build has: 2 the AVX-512 families (every path below), 1 the AVX2 one
 * (quant_avx2.c: the int8 terms for bf16 x at any row count, the exact weight for float32 x; no MoE kernel),
 * 0 none (the callers' reference runs). */
KERNEL_API int quant_isa(void) { return HAVE_QUANT_GEMM ? 2 : HAVE_QUANT_AVX2 ? 1 : 0; }

/* The small path's row limit: read (value < 0) or set it (benchmarks compare the two paths with it). The
 * defaults are the crossovers measured with both int8 terms (SmolLM2 and 1B shapes, Q4_1 and Q8_0): 4-8 rows
 * where the next path is AMX's bf16 tile; without AMX 11, up to the bf16 tile's rows (quant_tile_m: 12 on the
 * Zen 4). With each row's terms as a pair (quant_act_pairs), the small stream at 10 rows took 0.4-0.85x the
 * time of quant_batch.c's many-row int8 path, which had run 9-11 rows (two threads, weights from memory,
 * 576x1536 and 2048x2048, Q4_1 / Q8_0 / Q4_K / Q5_0); at 12 rows it measured 0.67-1.14x the bf16 tile, at 16
 * 0.76-1.45x. Before the pairs the crossover was 8 (the stream 1.05-1.5x slower at 12). */
#define SMALL_M_AMX 6
#define SMALL_M_NO_AMX 11
KERNEL_API int quant_small_m(int value) {
    if (value >= 0)
        quant_small_m_max = value < SMALL_M_LIMIT ? value : SMALL_M_LIMIT;
    else if (quant_small_m_max < 0) /* a benign race: every caller decides the same */
#if HAVE_AMX
        quant_small_m_max = amx_gemm_supported() ? SMALL_M_AMX : SMALL_M_NO_AMX;
#else
        quant_small_m_max = SMALL_M_NO_AMX;
#endif
    return quant_small_m_max;
}

static int check_shape(const tl_quant_type *t, int64_t n, int64_t k) {
    if (t == NULL) return QUANT_E_TYPE;
    if (n < 0 || k <= 0 || k % t->block != 0 || k % TL_QK != 0) return QUANT_E_SHAPE;
    if (k / t->block * t->block_size > QUANT_MAX_ROW_BYTES) return QUANT_E_SHAPE;
    return QUANT_OK;
}

/* Whether decode rows carry the second int8 term: read (value < 0) or set it (0 off, 1 on). */
KERNEL_API int quant_act_residual(int value) {
    if (value >= 0) quant_act_residual_on = value != 0;
    return quant_act_residual_on;
}

/* Whether the small path's two int8 terms go to the kernels as pairs: read (value < 0) or set it (0 never, 1
 * at one row only, 2 at every row count). */
KERNEL_API int quant_act_pairs(int value) {
    if (value >= 0) quant_act_pairs_on = value < 2 ? value : 2;
    return quant_act_pairs_on;
}

/* Whether the many-row int8 path's rows carry the second int8 term: read (value < 0) or set it (0 off, 1 on). */
KERNEL_API int quant_batch_residual(int value) {
    if (value >= 0) quant_batch_residual_on = value != 0;
    return quant_batch_residual_on;
}

/* The small-row kernels' software prefetch distance in tiles: read (value < 0) or set it (0 off). */
KERNEL_API int quant_prefetch(int value) {
    if (value >= 0) tl_quant_prefetch_tiles = value;
    return tl_quant_prefetch_tiles;
}

/* The cache level the small-row kernels' software prefetch fills: read (value < 0) or set it (1 L2, 0 L1). */
KERNEL_API int quant_prefetch_l2(int value) {
    if (value >= 0) tl_quant_prefetch_l2 = value;
    return tl_quant_prefetch_l2;
}

/* Activation rows up to which the small-row kernels use the row-sequential stream: read (value < 0) or set it. */
KERNEL_API int quant_seq_m(int value) {
    if (value >= 0) tl_quant_seq_max_m = value;
    return tl_quant_seq_max_m;
}

/* Bytes of a re-laid-out [n, k] matrix of `type` (the file's size but for the AVX2 family's Q4_K / Q5_K, whose
 * scales it unpacks: 148 / 180 bytes a super-block where the file has 144 / 176), or -1 where the kernels do not
 * take the type or shape. */
KERNEL_API int64_t quant_packed_bytes(int type, int64_t n, int64_t k) {
    const tl_quant_type *t = tl_quant_lookup(type);
    if (check_shape(t, n, k) != QUANT_OK) return -1;
    return n * (k / t->block) * t->block_size;
}

/* Re-lays out data [n rows of k columns] in place for the type's kernels: the file's bytes at its start, room
 * for quant_packed_bytes. */
KERNEL_API int quant_repack(int type, uint8_t *data, int64_t n, int64_t k) {
    const tl_quant_type *t = tl_quant_lookup(type);
    const int rc = check_shape(t, n, k);
    if (rc != QUANT_OK) return rc;
    if (t->repack == NULL) return QUANT_OK;
    return t->repack(data, n, k) == 0 ? QUANT_OK : QUANT_E_MEMORY;
}

#if HAVE_QUANT_GEMM
static inline void store_row(const float *src, int64_t count, void *dst, int is_f32) {
    if (is_f32) {
        memcpy(dst, src, sizeof(float) * (size_t)count);
        return;
    }
    uint16_t *o = dst;
    int64_t i = 0;
    for (; i + 32 <= count; i += 32) /* vcvtne2ps2bf16 rounds to nearest even, as f32_to_bf16 */
        _mm512_storeu_si512(o + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16),
                                                                _mm512_loadu_ps(src + i)));
    for (; i < count; ++i) o[i] = f32_to_bf16(src[i]);
}
#endif

/* Rows ids[0..count) (or all n rows when ids is NULL: count is then n) of W dequantized into out [count, k],
 * float32 (out_dtype 0) or bf16 rounded once (1). */
KERNEL_API int quant_dequant_rows(int type, const uint8_t *w, int64_t n, int64_t k, const int64_t *ids,
                                  int64_t count, void *out, int out_dtype, int threads) {
    const tl_quant_type *t = tl_quant_lookup(type);
    const int rc = check_shape(t, n, k); /* QUANT_E_TYPE where no family is built */
    if (rc != QUANT_OK) return rc;
    if (ids == NULL) count = n;
    for (int64_t i = 0; ids != NULL && i < count; ++i)
        if (ids[i] < 0 || ids[i] >= n) return QUANT_E_INDEX;
#if HAVE_QUANT_GEMM
    const size_t elem = out_dtype == 0 ? 4 : 2;
    const tl_dequant_bf16_fn to_bf16 = out_dtype == 0 ? NULL : tl_legacy_dequant_bf16(type);
    const int via_f32 = out_dtype != 0 && to_bf16 == NULL; /* bf16 out: float32 first, then rounded */
    int failed = 0;
    const int team = count < threads ? (int)(count > 1 ? count : 1) : threads; /* no thread without a row */
    _Pragma("omp parallel num_threads(team)") {
        float *buf = via_f32 ? aligned_alloc(64, (size_t)((k * 4 + 63) / 64 * 64)) : NULL;
        if (via_f32 && buf == NULL) {
            _Pragma("omp atomic write") failed = 1;
        }
        _Pragma("omp for schedule(static)")
        for (int64_t i = 0; i < count; ++i) {
            const int64_t row = ids == NULL ? i : ids[i];
            char *dst = (char *)out + (size_t)i * (size_t)k * elem;
            if (out_dtype == 0) {
                t->dequant_row(w, n, row, k, (float *)dst);
            } else if (to_bf16 != NULL) {
                to_bf16(w, n, row, k, (uint16_t *)dst);
            } else if (buf != NULL) {
                t->dequant_row(w, n, row, k, buf);
                store_row(buf, k, dst, 0);
            }
        }
        free(buf);
    }
    return failed ? QUANT_E_MEMORY : QUANT_OK;
#elif HAVE_QUANT_AVX2
    float *rowf = out_dtype == 0 ? NULL : malloc(sizeof(float) * (size_t)k);
    if (out_dtype != 0 && rowf == NULL) return QUANT_E_MEMORY;
    (void)threads; /* embedding rows and the reference: one thread is enough */
    for (int64_t i = 0; i < count; ++i) {
        const int64_t row = ids == NULL ? i : ids[i];
        if (out_dtype == 0) {
            avx2_dequant_row(t, w, row, k, (float *)out + i * k);
            continue;
        }
        avx2_dequant_row(t, w, row, k, rowf);
        for (int64_t j = 0; j < k; ++j) ((uint16_t *)out)[i * k + j] = f32_to_bf16(rowf[j]);
    }
    free(rowf);
    return QUANT_OK;
#else
    (void)w; (void)out; (void)out_dtype; (void)threads;
    return QUANT_E_TYPE;
#endif
}

#if HAVE_QUANT_GEMM
/* x [m, k] (bf16 or float32) -> int8 blocks: d = max|x| / 127, q = round(x / d), s = sum q. With `residual`
 * the remainder x - d q (within +-d/2) is quantized the same way into rows m .. 2m - 1 of q, d, s, with scale
 * exactly d / 128 (TL_TERM2_SHIFT; its quants lie in [-64, 64]): the two terms together carry x to within
 * d / 256, max|x| / 32512 of the block, where one int8 term is off by up to d / 2 (llama.cpp's Q8_0
 * activations). The power-of-two ratio lets a kernel add the two terms' integer dot products before it scales
 * them (tl_act_q8.paired); the second scale was d / 127 before (d / 254 overall: the same to 1%). */
static void quantize_act_rows(const void *x, int64_t x_stride, int x_is_f32, int64_t m, int64_t k, int residual,
                              int8_t *q, float *d, int32_t *s, int64_t r0, int64_t r1) {
    const int64_t nb = k / TL_QK;
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            __m512 v[2];
            for (int h = 0; h < 2; ++h) {
                const int64_t o = r * x_stride + 32 * b + 16 * h;
                v[h] = x_is_f32 ? _mm512_loadu_ps((const float *)x + o)
                                : _mm512_castsi512_ps(_mm512_slli_epi32(
                                      _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + o))),
                                      16));
            }
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
            const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            const float scale2 = scale * (1.0f / (1 << TL_TERM2_SHIFT)), inv2 = (float)(1 << TL_TERM2_SHIFT) * inv;
            __m512i sum = _mm512_setzero_si512(), sum2 = _mm512_setzero_si512();
            for (int h = 0; h < 2; ++h) {
                /* round to nearest (even), the MXCSR default */
                const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(inv)));
                sum = _mm512_add_epi32(sum, qi);
                _mm_storeu_si128((__m128i *)(q + r * k + 32 * b + 16 * h), _mm512_cvtsepi32_epi8(qi));
                if (residual) {
                    const __m512 rest = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qi), _mm512_set1_ps(scale), v[h]);
                    const __m512i qr = _mm512_cvtps_epi32(_mm512_mul_ps(rest, _mm512_set1_ps(inv2)));
                    sum2 = _mm512_add_epi32(sum2, qr);
                    _mm_storeu_si128((__m128i *)(q + (m + r) * k + 32 * b + 16 * h), _mm512_cvtsepi32_epi8(qr));
                }
            }
            d[r * nb + b] = scale;
            s[r * nb + b] = _mm512_reduce_add_epi32(sum);
            if (residual) {
                d[(m + r) * nb + b] = scale2;
                s[(m + r) * nb + b] = _mm512_reduce_add_epi32(sum2);
            }
        }
}

/* All m rows (quantize_act_rows: rows r0 .. r1 - 1 of them, for callers that split the rows over threads). */
static void quantize_act(const void *x, int64_t x_stride, int x_is_f32, int64_t m, int64_t k, int residual,
                         int8_t *q, float *d, int32_t *s) {
    quantize_act_rows(x, x_stride, x_is_f32, m, k, residual, q, d, s, 0, m);
}

/* buf [rows, ld] float32 sums of features f0 .. f0 + count -> out (+ bias), one row per activation row. */
static void epilogue(const float *buf, int64_t ld, int64_t rows, int64_t f0, int64_t count, const void *bias,
                     int bias_is_f32, void *out, int64_t out_stride, int out_is_f32) {
    for (int64_t c = 0; c < count; c += 16) {
        const __mmask16 mask = count - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (count - c)) - 1u);
        __m512 b = _mm512_setzero_ps();
        if (bias != NULL)
            b = bias_is_f32 ? _mm512_maskz_loadu_ps(mask, (const float *)bias + f0 + c)
                            : _mm512_castsi512_ps(_mm512_slli_epi32(
                                  _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)bias + f0 + c)),
                                  16));
        for (int64_t r = 0; r < rows; ++r) {
            const __m512 v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, buf + r * ld + c), b);
            if (out_is_f32)
                _mm512_mask_storeu_ps((float *)out + r * out_stride + f0 + c, mask, v);
            else /* vcvtneps2bf16 rounds to nearest even, as f32_to_bf16 */
                _mm256_mask_storeu_epi16((uint16_t *)out + r * out_stride + f0 + c, mask,
                                         (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

/* Weight rows per work item of the small-m path: n split evenly over the threads, in items of at most
 * SMALL_ITEM_ROWS (rounded up to 16). A dot kernel prepares its activations once per call (the stream's
 * regrouped quants and scale vectors: legacy_seq_prep, kq_seq_prep), so a few large items cost less than many
 * small ones. */
static int64_t small_item_rows(int64_t n, int threads) {
    const int64_t parts = threads > 0 ? threads : 1, per_round = parts * SMALL_ITEM_ROWS;
    const int64_t items = parts * ((n + per_round - 1) / per_round);
    const int64_t rows = (n + items - 1) / items;
    return (rows + 15) / 16 * 16;
}

static int small_path(const tl_quant_type *t, const uint8_t *w, int64_t n, int64_t k, const void *x, int64_t x_stride,
                      int x_is_f32, int64_t m, const void *bias, int bias_is_f32, void *out, int64_t out_stride,
                      int out_is_f32, int threads) {
    const int64_t nb = k / TL_QK, row_bytes = k / t->block * t->block_size;
    const int residual = quant_act_residual_on, terms = residual ? 2 : 1;
    int8_t *q = malloc((size_t)(terms * m * k));
    float *d = malloc(sizeof(float) * (size_t)(terms * m * nb));
    int32_t *s = malloc(sizeof(int32_t) * (size_t)(terms * m * nb));
    if (q == NULL || d == NULL || s == NULL) {
        free(q); free(d); free(s);
        return QUANT_E_MEMORY;
    }
    quantize_act(x, x_stride, x_is_f32, m, k, residual, q, d, s);
    /* the Q4 kernels' activation order (they read no other), made once here rather than once per chunk of rows */
    int8_t *lanes = NULL;
    if (t->type == TL_Q4_0 || t->type == TL_Q4_1) {
        if ((lanes = aligned_alloc(64, (size_t)((terms * m * k + 63) / 64 * 64))) == NULL) {
            free(q); free(d); free(s);
            return QUANT_E_MEMORY;
        }
        q4_lanes_order(q, terms * m, k, lanes);
    }
    /* Both terms in one pass over the weight when they fit the kernel's rows, else one pass each. */
    const int together = terms * m <= SMALL_M_LIMIT;
    const int pairs = residual && together && quant_act_pairs_on >= (m == 1 ? 1 : 2) ? (int)m : 0;
    /* the Q8_0 pair tiles' activation order, made once here too */
    int8_t *q8_lanes = NULL;
    if (t->type == TL_Q8_0 && pairs > 1) {
        if ((q8_lanes = aligned_alloc(64, (size_t)((terms * m * k + 63) / 64 * 64))) == NULL) {
            free(q); free(d); free(s); free(lanes);
            return QUANT_E_MEMORY;
        }
        q8_lanes_order(q, terms * m, k, q8_lanes);
    }
    const tl_act_q8 all = {q, d, s, (int)(together ? terms * m : m), k, lanes, pairs == 1, pairs, q8_lanes};
    const tl_act_q8 rest = {q + m * k, d + m * nb, s + m * nb, (int)m, k, lanes == NULL ? NULL : lanes + m * k, 0, 0,
                            NULL};
    const int64_t item = small_item_rows(n, threads), items = (n + item - 1) / item;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t c = 0; c < items; ++c) {
        float buf[2 * SMALL_M_LIMIT * SMALL_ITEM_ROWS];
        const int64_t n0 = c * item, n1 = n - n0 < item ? n : n0 + item;
        t->dot_rows(w, n, row_bytes, n0, n1, &all, buf, item);
        if (residual && !together) t->dot_rows(w, n, row_bytes, n0, n1, &rest, buf + m * item, item);
        if (residual) /* row r's two terms: buf rows r and m + r */
            for (int64_t i = 0; i < m * item; i += 16)
                _mm512_storeu_ps(buf + i,
                                 _mm512_add_ps(_mm512_loadu_ps(buf + i), _mm512_loadu_ps(buf + m * item + i)));
        epilogue(buf, item, m, n0, n1 - n0, bias, bias_is_f32, out, out_stride, out_is_f32);
    }
    free(q); free(d); free(s); free(lanes); free(q8_lanes);
    return QUANT_OK;
}

/* In-place transpose of a 16 x 16 matrix of 32-bit elements held in 16 vectors. */
static inline void transpose16x16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) { /* u[4i + c], 128-bit lane L: rows 4i..4i+3 of column 4L + c */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; ++c) { /* 4 x 4 transpose of 128-bit lanes */
        const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
        const __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
        const __m512i w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
        r[8 + c] = _mm512_shuffle_i32x4(v1, w1, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
    }
}

/* rows [16 * blocks][k] (32-bit units per row: `units`, row stride `units`) -> per 16-row block j, vectors
 * packed[(j * units + u) * 16 + c] = rows[16 j + c][u]: bf16 pairs (pair_gemm.c's layout) or float32. */
static void transpose_tile(const uint32_t *rows, int64_t units, int blocks, uint32_t *packed) {
    for (int j = 0; j < blocks; ++j)
        for (int64_t u0 = 0; u0 < units; u0 += 16) {
            __m512i v[16];
            for (int c = 0; c < 16; ++c) v[c] = _mm512_loadu_si512(rows + (16 * j + c) * units + u0);
            transpose16x16(v);
            for (int i = 0; i < 16; ++i) _mm512_storeu_si512(packed + (j * units + u0 + i) * 16, v[i]);
        }
}

/* float32 bands: rows r0 .. r0 + NR - 1 of x times NB 16-feature blocks of the float32 tile. */
static inline __attribute__((always_inline)) void band_f32(const float *x, int64_t x_stride, int64_t r0, const int NR,
                                                           const float *tile, int64_t k, const int NB, float *buf,
                                                           int64_t ld) {
    __m512 acc[6][TILE_BLOCKS];
    for (int r = 0; r < NR; ++r)
        for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; ++i) {
        __m512 b[TILE_BLOCKS];
        for (int j = 0; j < NB; ++j) b[j] = _mm512_loadu_ps(tile + (j * k + i) * 16);
        for (int r = 0; r < NR; ++r) {
            const __m512 a = _mm512_set1_ps(x[(r0 + r) * x_stride + i]);
            for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_fmadd_ps(a, b[j], acc[r][j]);
        }
    }
    for (int r = 0; r < NR; ++r)
        for (int j = 0; j < NB; ++j) _mm512_storeu_ps(buf + (r0 + r) * ld + 16 * j, acc[r][j]);
}

static inline __attribute__((always_inline)) void rows_f32(const float *x, int64_t x_stride, int64_t m,
                                                           const float *tile, int64_t k, const int NB, float *buf,
                                                           int64_t ld) {
    int64_t r = 0;
    for (; r + 6 <= m; r += 6) band_f32(x, x_stride, r, 6, tile, k, NB, buf, ld);
    switch (m - r) {
    case 5: band_f32(x, x_stride, r, 5, tile, k, NB, buf, ld); break;
    case 4: band_f32(x, x_stride, r, 4, tile, k, NB, buf, ld); break;
    case 3: band_f32(x, x_stride, r, 3, tile, k, NB, buf, ld); break;
    case 2: band_f32(x, x_stride, r, 2, tile, k, NB, buf, ld); break;
    case 1: band_f32(x, x_stride, r, 1, tile, k, NB, buf, ld); break;
    default: break;
    }
}

static int tile_path(const tl_quant_type *t, const uint8_t *w, int64_t n, int64_t k, const void *x, int64_t x_stride,
                     int x_is_f32, int64_t m, const void *bias, int bias_is_f32, void *out, int64_t out_stride,
                     int out_is_f32, int threads) {
    const int64_t tile_rows = 16 * TILE_BLOCKS;
    const int64_t groups = (n + tile_rows - 1) / tile_rows;
#if HAVE_AMX
    /* With AMX, bf16 x goes through amx_gemm.c's tiles: its weight layout per 16 features is the same
     * feature-pair order, and its x copy (tile order, padded) is made once here. */
    const int use_amx = !x_is_f32 && amx_gemm_supported();
    const uint16_t *xa = use_amx ? padded_input(x, x_stride, m, k, k) : NULL;
    if (use_amx && xa == NULL) return QUANT_E_MEMORY;
#else
    const int use_amx = 0;
#endif
    /* per thread: one float32 row, the row-major tile, its transposed copy, the [m, 64] sums */
    const int64_t elem = x_is_f32 ? 4 : 2;
    const size_t tile_bytes = (size_t)(tile_rows * k * elem), row_f32 = (size_t)(k * 4);
    const size_t per_thread = row_f32 + 2 * tile_bytes + (size_t)(m * tile_rows * 4);
    const tl_dequant_bf16_fn to_bf16 = tl_legacy_dequant_bf16(t->type); /* else float32, then rounded */
    int failed = 0;
    _Pragma("omp parallel num_threads(threads)") {
        char *scratch = aligned_alloc(64, (per_thread + 63) / 64 * 64);
        if (scratch == NULL) {
            _Pragma("omp atomic write") failed = 1;
        }
#if HAVE_AMX
        if (use_amx) amx_configure();
#endif
        float *rowf = (float *)scratch;
        uint32_t *tile = (uint32_t *)(scratch + row_f32);
        uint32_t *packed = (uint32_t *)(scratch + row_f32 + tile_bytes);
        float *buf = (float *)(scratch + row_f32 + 2 * tile_bytes);
        _Pragma("omp for schedule(static)")
        for (int64_t g = 0; g < groups; ++g) {
            if (scratch == NULL) continue;
            const int64_t f0 = g * tile_rows, count = n - f0 < tile_rows ? n - f0 : tile_rows;
            int blocks = (int)((count + 15) / 16);
            if (use_amx) blocks = (blocks + 1) / 2 * 2; /* AMX takes feature blocks in pairs */
            for (int64_t c = 0; c < 16 * blocks; ++c) { /* rows past n are zero: their outputs are dropped */
                char *dst = (char *)tile + (size_t)(c * k * elem);
                if (c >= count) {
                    memset(dst, 0, (size_t)(k * elem));
                } else if (x_is_f32) {
                    t->dequant_row(w, n, f0 + c, k, (float *)dst);
                } else if (to_bf16 != NULL) {
                    to_bf16(w, n, f0 + c, k, (uint16_t *)dst);
                } else {
                    t->dequant_row(w, n, f0 + c, k, rowf);
                    store_row(rowf, k, dst, 0);
                }
            }
            const int64_t units = x_is_f32 ? k : k / 2;
            transpose_tile(tile, units, blocks, packed);
            if (x_is_f32) {
                switch (blocks) {
                case 4: rows_f32(x, x_stride, m, (const float *)packed, k, 4, buf, tile_rows); break;
                case 3: rows_f32(x, x_stride, m, (const float *)packed, k, 3, buf, tile_rows); break;
                case 2: rows_f32(x, x_stride, m, (const float *)packed, k, 2, buf, tile_rows); break;
                default: rows_f32(x, x_stride, m, (const float *)packed, k, 1, buf, tile_rows); break;
                }
            } else if (use_amx) {
#if HAVE_AMX
                /* straight into out (+ a bf16 bias) when it can; a float32 bias goes through buf */
                const int direct = bias == NULL || !bias_is_f32;
                for (int q = 0; q < blocks / 2; ++q) {
                    const uint16_t *b0 = (const uint16_t *)packed + (int64_t)q * 2 * 16 * k;
                    if (direct)
                        pair_tiles(xa, m, k, b0, NULL, bias, n, f0 + 32 * q, out_is_f32 ? NULL : out,
                                   out_is_f32 ? out : NULL, out_stride);
                    else
                        pair_tiles(xa, m, k, b0, NULL, NULL, count, 32 * q, NULL, buf, tile_rows);
                }
                if (direct) continue;
#endif
            } else {
                const uint16_t *xb = x, *pk = (const uint16_t *)packed;
                switch (blocks) { /* pair_gemm.c's register bands over the bf16 feature-pair tile */
                case 4: group_rows(xb, x_stride, m, pk, k / 2, 4, buf, tile_rows, 0, count); break;
                case 3: group_rows(xb, x_stride, m, pk, k / 2, 3, buf, tile_rows, 0, count); break;
                case 2: group_rows(xb, x_stride, m, pk, k / 2, 2, buf, tile_rows, 0, count); break;
                default: group_rows(xb, x_stride, m, pk, k / 2, 1, buf, tile_rows, 0, count); break;
                }
            }
            epilogue(buf, tile_rows, m, f0, count, bias, bias_is_f32, out, out_stride, out_is_f32);
        }
#if HAVE_AMX
        if (use_amx) _tile_release();
#endif
        free(scratch);
    }
    return failed ? QUANT_E_MEMORY : QUANT_OK;
}
#endif

#include "quant_batch.c" /* the many-row int8 path: uses quantize_act, transpose_tile, epilogue above */

/* Rows from which bf16 x takes quant_batch.c's int8 path instead of the bf16 tile (every type with a u8_row,
 * k % 64 == 0; rows up to quant_small_m take the small stream first): read (value < 0) or set it (0: never).
 * By default every row count past the small stream where AMX does not run, and never where it runs (AMX's bf16
 * tiles are 1.3-5x faster than this path at 16-256 rows). Where vdpbf16ps keeps pace with vpdpbusd, the tile
 * takes the rows back from quant_tile_m on. */
static int quant_batch_min_rows = -1;
KERNEL_API int quant_batch_m(int value) {
    if (value >= 0)
        quant_batch_min_rows = value;
    else if (quant_batch_min_rows < 0) /* a benign race: every caller decides the same */
#if HAVE_AMX
        quant_batch_min_rows = amx_gemm_supported() ? 0 : 1;
#else
        quant_batch_min_rows = 1;
#endif
    return quant_batch_min_rows;
}

#if HAVE_QUANT_BATCH
static double seconds_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Seconds for `iters` x 12 independent register-only vpdpbusd (bf16 = 0) or vdpbf16ps (bf16 = 1): twelve
 * chains cover either instruction's latency, so the time is the issue rate. */
static double dot_rate_probe(int bf16, int iters) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
            a9 = a0, a10 = a0, a11 = a0;
    const __m512i u = _mm512_set1_epi32(0x3f803f80), v = _mm512_set1_epi32(0x01010101);
    const double t0 = seconds_now();
    for (int i = 0; i < iters; ++i) {
#define DOT12(OP)                                                                                                  \
    __asm__ volatile(OP " %13, %12, %0\n\t" OP " %13, %12, %1\n\t" OP " %13, %12, %2\n\t" OP " %13, %12, %3\n\t"   \
                     OP " %13, %12, %4\n\t" OP " %13, %12, %5\n\t" OP " %13, %12, %6\n\t" OP " %13, %12, %7\n\t"   \
                     OP " %13, %12, %8\n\t" OP " %13, %12, %9\n\t" OP " %13, %12, %10\n\t" OP " %13, %12, %11"     \
                     : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7), "+v"(a8),   \
                       "+v"(a9), "+v"(a10), "+v"(a11)                                                             \
                     : "v"(u), "v"(v))
        if (bf16)
            DOT12("vdpbf16ps");
        else
            DOT12("vpdpbusd");
#undef DOT12
    }
    const double t = seconds_now() - t0;
    volatile int sink = _mm512_reduce_add_epi32(_mm512_xor_si512(
        _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)),
        _mm512_xor_si512(_mm512_xor_si512(_mm512_xor_si512(a4, a5), _mm512_xor_si512(a6, a7)),
                         _mm512_xor_si512(_mm512_xor_si512(a8, a9), _mm512_xor_si512(a10, a11)))));
    (void)sink;
    return t;
}
#endif

/* Time of a vdpbf16ps over a vpdpbusd on this core (the issue-rate ratio; bench/quant_gemm.py prints it), or 0
 * where the many-row int8 path is not built. */
KERNEL_API double quant_bf16_dot_cost(void) {
#if HAVE_QUANT_BATCH
    double best_int8 = 1e9, best_bf16 = 1e9;
    for (int tries = 0; tries < 7; ++tries) {
        const double ti = dot_rate_probe(0, 2000), tb = dot_rate_probe(1, 2000);
        if (ti < best_int8) best_int8 = ti;
        if (tb < best_bf16) best_bf16 = tb;
    }
    return best_bf16 / best_int8;
#else
    return 0.0;
#endif
}

/* Rows from which the dequantized bf16 tile takes over from the many-row int8 path again: read (value < 0) or
 * set it (0: never). By default 12 where this core issues vdpbf16ps (32 multiply-adds) at least 2/3 as fast
 * as vpdpbusd (64, or 32 a term with the two int8 terms): the tile then matches the int8 path's multiply rate
 * without its activation quantizing and block epilogue (AMD Zen 4, two threads, bench/quant_gemm.py --int8
 * --tile: at 32-1024 rows the AVX512-BF16 tile is 1.1-1.7x faster than the two int8 terms on every type and
 * shape of SmolLM2 and a 1B Llama; at 12-14 rows 1.2-1.25x on Q6_K, 1.0-1.23x on Q4_1, level on Q4_K
 * (0.95-1.03x); at 9 rows 0.8-0.9x on Q4_K, so not lower; the probe's cost there: 1.00),
 * else never (an Intel Xeon with AMX off issues vdpbf16ps at a quarter of vpdpbusd's rate, where the int8 path
 * is 1.35-1.6x faster than the tile at 16-256 rows). Decided once per process by
 * quant_bf16_dot_cost (the best of 7 interleaved tries of ~24k instructions each, ~0.2 ms in all). */
#define TILE_M_BF16_PACE 12
#define BF16_PACE_MAX_COST 1.5
static int quant_tile_min_rows = -1;
KERNEL_API int quant_tile_m(int value) {
    if (value >= 0)
        quant_tile_min_rows = value;
    else if (quant_tile_min_rows < 0) { /* a benign race: every caller decides the same */
#if HAVE_QUANT_AVX2
        quant_tile_min_rows = AVX2_TILE_M; /* the AVX2 family's float32 tile against its two int8 terms */
#else
        const double cost = quant_bf16_dot_cost();
        quant_tile_min_rows = cost > 0.0 && cost < BF16_PACE_MAX_COST ? TILE_M_BF16_PACE : 0;
#endif
    }
    return quant_tile_min_rows;
}

/* Rows from which the AVX2 family's one-term int8 tile (tile_i8_avx2.c) replaces its float32 tile for bf16 x:
 * read (value < 0) or set it (0: never, the default; 32 where measured). Elsewhere 0. */
static int quant_i8_tile_min_rows = -1;
KERNEL_API int quant_i8_tile_m(int value) {
    if (value >= 0)
        quant_i8_tile_min_rows = value;
    else if (quant_i8_tile_min_rows < 0)
#if HAVE_QUANT_AVX2
        quant_i8_tile_min_rows = AVX2_I8_TILE_M;
#else
        quant_i8_tile_min_rows = 0;
#endif
    return quant_i8_tile_min_rows;
}

/* The path quant_linear takes for these arguments: 1 the small int8 stream, 2 the many-row int8 path, 0 the
 * dequantized tile, 3 the AVX2 one-term int8 tile; -1 for a type this build lacks (tests pick each path's error
 * bound with it). */
KERNEL_API int quant_path(int type, int64_t m, int64_t k, int x_is_f32) {
#if HAVE_QUANT_GEMM
    const tl_quant_type *t = tl_quant_lookup(type);
    if (t == NULL) return -1;
    if (!x_is_f32 && m <= quant_small_m(-1)) return 1;
#if HAVE_QUANT_BATCH
    const int batch_from = quant_batch_m(-1);
    const int tile_from = quant_tile_m(-1);
    if (!x_is_f32 && batch_from > 0 && m >= batch_from && (tile_from == 0 || m < tile_from) && t->u8_row != NULL &&
        k % 64 == 0)
        return 2;
#endif
    return 0;
#elif HAVE_QUANT_AVX2
    if (tl_quant_lookup(type) == NULL) return -1;
    const int tile_from = quant_tile_m(-1), i8_from = quant_i8_tile_m(-1);
    if (!x_is_f32 && i8_from > 0 && m >= i8_from && avx2_i8_supported(type, k)) return 3;
    return x_is_f32 || (tile_from > 0 && m >= tile_from) ? 0 : 1;
#else
    (void)type; (void)m; (void)k; (void)x_is_f32;
    return -1;
#endif
}

/* out[m, n] (row stride out_stride; float32 or bf16) = x[m, k] (row stride x_stride; float32 or bf16) . W^T
 * (+ bias[n], float32 or bf16, or NULL), W [n, k] of GGUF type `type` re-laid-out by quant_repack. */
KERNEL_API int quant_linear(int type, const uint8_t *w, int64_t n, int64_t k, const void *x, int64_t x_stride,
                            int x_is_f32, int64_t m, const void *bias, int bias_is_f32, void *out, int64_t out_stride,
                            int out_is_f32, int threads) {
    const tl_quant_type *t = tl_quant_lookup(type);
    const int rc = check_shape(t, n, k); /* QUANT_E_TYPE where no family is built */
    if (rc != QUANT_OK) return rc;
    if (m < 0 || x_stride < k || out_stride < n) return QUANT_E_SHAPE;
    if (m == 0 || n == 0) return QUANT_OK;
#if HAVE_QUANT_GEMM
    switch (quant_path(type, m, k, x_is_f32)) {
    case 1:
        return small_path(t, w, n, k, x, x_stride, x_is_f32, m, bias, bias_is_f32, out, out_stride, out_is_f32,
                          threads);
#if HAVE_QUANT_BATCH
    case 2: return batch_path(t, w, n, k, x, x_stride, m, bias, bias_is_f32, out, out_stride, out_is_f32, threads);
#endif
    default: break;
    }
    return tile_path(t, w, n, k, x, x_stride, x_is_f32, m, bias, bias_is_f32, out, out_stride, out_is_f32, threads);
#elif HAVE_QUANT_AVX2
    const int path = quant_path(type, m, k, x_is_f32);
    if (path == 3)
        return avx2_i8_tile_linear(t, w, n, k, (const uint16_t *)x, x_stride, m, bias, bias_is_f32, out, out_stride,
                                   out_is_f32, threads);
    if (path == 0)
        return avx2_tile_linear(t, w, n, k, x, x_stride, x_is_f32, m, bias, bias_is_f32, out, out_stride, out_is_f32,
                                threads);
    return avx2_linear(t, w, n, k, x, x_stride, 0, m, bias, bias_is_f32, out, out_stride, out_is_f32, threads);
#else
    (void)w; (void)x; (void)x_is_f32; (void)bias; (void)bias_is_f32; (void)out; (void)out_is_f32; (void)threads;
    return QUANT_E_TYPE;
#endif
}
