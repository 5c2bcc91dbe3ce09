/*
 * The many-row int8 path of the GGUF-quantized matmul (prefill, batched decode): out[m, n] = x[m, k] . W^T with
 * bf16 x quantized once per call to int8 per 32-column block (d = max|x| / 127, q = round(x / d), and by
 * default a second term for the remainder) and
 * the weight kept in integers, so the multiply is AVX512-VNNI's vpdpbusd: 64 byte products per instruction,
 * twice the multiply-adds of AVX512-BF16's vdpbf16ps (and of a float32 FMA) at the same instruction rate on
 * the CPUs measured (bench/quant_gemm.py's tables in docs/benchmarks.md).
 *
 * Per thread, a group of 64 output features is turned once into a tile (the type's u8_row, quant_common.h):
 * unsigned quants in natural column order, transposed so that one 64-byte vector holds 4 consecutive columns
 * of 16 features (vpdpbusd's operand order), plus per-feature float scales and minimums per block of the
 * type's u8_cols columns (32, or Q6_K's 16: the 32-column block's int32 sums then close every 16 columns),
 * laid out 16 features to a vector. A register band of up to BAND_I8 activation rows x 32 features keeps one
 * int32 sum per (row, feature) over a weight scale block and one float32 accumulator across blocks:
 *     acc += float(sum_i q_w q_x) * (scale_w * d_x) + min_w * (d_x * sum_i q_x)
 * so the weight tile is read from L1/L2 once per band and the weight bytes from memory once per call.
 *
 * Numerics: the weight term is exact up to the type's own dequantize rounding; the activation rounding is the
 * only error: |err| <= sum_i |w_i| * d_x(i) / 2 per output (the bound tests/unit/test_quant_gemm.py checks),
 * the same as llama.cpp's Q8 activations, with one term; the second term (the first one's remainder, on by
 * default: quant_batch_residual) cuts it to d_x(i) / 256. Float32 sums, in block
 * order: a result does not depend on m, the band or the thread count.
 *
 * Built inside kernels.c after quant_gemm.c (quantize_act, transpose_tile, epilogue).
 */
#include "quant_common.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BAND_I8 6   /* activation rows per register band: 6 x 2 int32 sums + 6 x 2 float accumulators */
#define BATCH_NJ 2  /* 16-feature blocks per band */

#if HAVE_QUANT_GEMM && defined(__AVX512VNNI__)
#define HAVE_QUANT_BATCH 1

/* acc + vpdpbusd(w, x) written as one instruction that updates acc in place: with the intrinsic, gcc 12 copies
 * each of the band's accumulators to a fresh register and back around every vpdpbusd (two extra moves per
 * multiply, measured as the kernel's bottleneck). */
static inline __attribute__((always_inline)) __m512i dpbusd_inplace(__m512i acc, __m512i w, __m512i x) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
    return acc;
}

/* Rows r0 .. r0 + NR - 1 times feature blocks j0, j0 + 1 of the tile (NR, T, GS constants once inlined). The
 * weight's scales and minimums cover GS groups of 4 columns (GS 8: 32 columns, GS 4: 16), nbs = k / (4 GS) of
 * them a row; activation blocks are 32 columns (nb = k / 32). Term t's quants of row r are at
 * xq + (t * m + r) * k, its block scales at xd + (t * m + r) * nb; xds [m, nbs] is the activation side of the
 * minimum term per weight scale block, sum over terms of d_x * sum q_x. */
static inline __attribute__((always_inline)) void band_i8(const int8_t *xq, const float *xd, const float *xds,
                                                          int64_t m, int64_t k, int64_t r0, const int NR, const int T,
                                                          const int GS, const uint8_t *packed, const float *wsc,
                                                          const float *wmn, int j0, float *buf, int64_t ld) {
    const int64_t nb = k / TL_QK, nbs = k / (4 * GS), units = k / 4;
    __m512 acc[BAND_I8][BATCH_NJ];
    for (int r = 0; r < NR; ++r)
        for (int j = 0; j < BATCH_NJ; ++j) acc[r][j] = _mm512_setzero_ps();
    const uint8_t *p0 = packed + (int64_t)j0 * units * 64, *p1 = p0 + units * 64;
    for (int64_t b = 0; b < nbs; ++b) {
        const int64_t bx = b * GS / 8; /* the activation block holding this weight scale block */
        __m512 sc[BATCH_NJ];
        for (int j = 0; j < BATCH_NJ; ++j) sc[j] = _mm512_loadu_ps(wsc + ((int64_t)(j0 + j) * nbs + b) * 16);
        for (int t = 0; t < T; ++t) { /* the same registers per term: the weight block comes from L1 again */
            __m512i s[BAND_I8][BATCH_NJ];
            for (int r = 0; r < NR; ++r)
                for (int j = 0; j < BATCH_NJ; ++j) s[r][j] = _mm512_setzero_si512();
            const int8_t *xt = xq + t * m * k;
            for (int g = 0; g < GS; ++g) {
                const int64_t u = GS * b + g;
                const __m512i w0 = _mm512_loadu_si512(p0 + u * 64), w1 = _mm512_loadu_si512(p1 + u * 64);
                for (int r = 0; r < NR; ++r) {
                    int32_t xv;
                    memcpy(&xv, xt + (r0 + r) * k + 4 * u, 4);
                    const __m512i xb = _mm512_set1_epi32(xv);
                    s[r][0] = dpbusd_inplace(s[r][0], w0, xb);
                    s[r][1] = dpbusd_inplace(s[r][1], w1, xb);
                }
            }
            for (int r = 0; r < NR; ++r) {
                const __m512 dx = _mm512_set1_ps(xd[(t * m + r0 + r) * nb + bx]);
                for (int j = 0; j < BATCH_NJ; ++j)
                    acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][j]), _mm512_mul_ps(sc[j], dx), acc[r][j]);
            }
        }
        for (int j = 0; j < BATCH_NJ; ++j) {
            const __m512 mn = _mm512_loadu_ps(wmn + ((int64_t)(j0 + j) * nbs + b) * 16);
            for (int r = 0; r < NR; ++r)
                acc[r][j] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xds[(r0 + r) * nbs + b]), acc[r][j]);
        }
    }
    for (int r = 0; r < NR; ++r)
        for (int j = 0; j < BATCH_NJ; ++j) _mm512_storeu_ps(buf + (r0 + r) * ld + 16 * (j0 + j), acc[r][j]);
}

static inline __attribute__((always_inline)) void rows_i8(const int8_t *xq, const float *xd, const float *xds,
                                                          int64_t k, int64_t m, const int T, const int GS,
                                                          const uint8_t *packed, const float *wsc, const float *wmn,
                                                          int blocks, float *buf, int64_t ld) {
#define BAND(NR) band_i8(xq, xd, xds, m, k, r, NR, T, GS, packed, wsc, wmn, j0, buf, ld)
    /* 16-column scale blocks close the sums twice as often: 4-row bands keep that epilogue in registers */
    const int band_rows = GS == 4 ? 4 : BAND_I8;
    for (int j0 = 0; j0 < blocks; j0 += BATCH_NJ) {
        int64_t r = 0;
        if (band_rows == 4)
            for (; r + 4 <= m; r += 4) BAND(4);
        else
            for (; r + BAND_I8 <= m; r += BAND_I8) BAND(BAND_I8);
        switch (m - r) { /* the last band's rows, each a constant so the sums stay in registers */
        case 5: BAND(5); break;
        case 4: BAND(4); break;
        case 3: BAND(3); break;
        case 2: BAND(2); break;
        case 1: BAND(1); break;
        default: break;
        }
    }
#undef BAND
}

/* ds [m, nbs]: per row and weight scale block of `cols` columns (32 or 16), the sum over terms of the
 * activation block's d_x times the sum of its quants over those columns (the minimum term's activation side). */
static void minimum_sides(const int8_t *q, const float *d, const int32_t *s, int64_t m, int64_t k, int terms,
                          int cols, float *ds, int64_t r0, int64_t r1) {
    const int64_t nb = k / TL_QK, nbs = k / cols;
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t b = 0; b < nbs; ++b) {
            float v = 0.0f;
            for (int t = 0; t < terms; ++t) {
                const int64_t bx = b * cols / TL_QK, row = t * m + r;
                int32_t sum = s[row * nb + bx];
                if (cols != TL_QK) { /* a part of the 32-column block: sum its own quants */
                    const int8_t *qq = q + row * k + b * cols;
                    sum = 0;
                    for (int i = 0; i < cols; ++i) sum += qq[i];
                }
                v += d[row * nb + bx] * (float)sum;
            }
            ds[r * nbs + b] = v;
        }
}

/* Output features per work item: 64, or 32 where that evens out the threads' shares (576 features over 2
 * threads: 9 items of 64 leave one thread 5, i.e. 320 features against 288 for 18 of 32; measured 8-15% faster
 * on SmolLM2's 576- and 192-feature projections, while items of 32 measured up to 9% slower at 16384). */
static int64_t batch_tile_rows(int64_t n, int threads) {
    const int64_t wide = 16 * TILE_BLOCKS, narrow = 16 * BATCH_NJ;
    const int64_t share_wide = ((n + wide - 1) / wide + threads - 1) / threads * wide;
    const int64_t share_narrow = ((n + narrow - 1) / narrow + threads - 1) / threads * narrow;
    return share_narrow < share_wide ? narrow : wide;
}

/* Activation rows per pass over the weight: a pass re-reads its rows' quants once per 32 output features, so
 * they should stay in L2 (about 384 KiB of them; 192-768 KiB measured alike here, and AMD's L2 is 1 MiB); the
 * weight's tiles are rebuilt per pass. One pass over all rows ran SmolLM2's 3072x576 and 576x1536 at 16384
 * rows (a full prefill batch) at 288 and 209 GOP/s, against 470 and 368 at 256 rows; in passes of this size
 * (and the quantizing split over the threads) 380 and 410. At least 288 rows a pass, so that rebuilding the
 * tiles stays small beside the multiply (the ~1B's 2048x8192 at 4096 rows: 396 GOP/s in passes of 96, 419 in
 * passes of 288). */
static int64_t batch_chunk_rows(int64_t k, int terms) {
    const int64_t rows = (384 * 1024) / (k * terms) / BAND_I8 * BAND_I8;
    return rows < 48 * BAND_I8 ? 48 * BAND_I8 : rows;
}

static int batch_path(const tl_quant_type *t, const uint8_t *w, int64_t n, int64_t k, const void *x,
                      int64_t x_stride, int64_t m, const void *bias, int bias_is_f32, void *out, int64_t out_stride,
                      int out_is_f32, int threads) {
    const int64_t nb = k / TL_QK, tile_rows = batch_tile_rows(n, threads);
    const int cols = t->u8_cols;
    const int64_t nbs = k / cols, groups = (n + tile_rows - 1) / tile_rows;
    const int terms = quant_batch_residual_on ? 2 : 1;
    const int64_t chunk = batch_chunk_rows(k, terms) < m ? batch_chunk_rows(k, terms) : m;
    /* one chunk of rows at a time: its activations quantized (split over the threads), then every weight tile */
    int8_t *q = malloc((size_t)(terms * chunk * k));
    float *d = malloc(sizeof(float) * (size_t)(terms * chunk * nb));
    float *ds = malloc(sizeof(float) * (size_t)(chunk * nbs));
    int32_t *s = malloc(sizeof(int32_t) * (size_t)(terms * chunk * nb));
    if (q == NULL || d == NULL || ds == NULL || s == NULL) {
        free(q); free(d); free(ds); free(s);
        return QUANT_E_MEMORY;
    }
    /* per thread: the row-major quants, their transposed copy, scales and minimums [blocks][nbs][16],
     * [chunk, tile_rows] sums */
    const size_t tile_bytes = (size_t)(tile_rows * k), side = sizeof(float) * (size_t)(tile_rows * nbs);
    const size_t per_thread = 2 * tile_bytes + 2 * side + sizeof(float) * (size_t)(chunk * tile_rows) +
                              2 * sizeof(float) * (size_t)nbs;
    int failed = 0;
    _Pragma("omp parallel num_threads(threads)") {
        char *scratch = aligned_alloc(64, (per_thread + 63) / 64 * 64);
        if (scratch == NULL) {
            _Pragma("omp atomic write") failed = 1;
        }
        uint8_t *tile = (uint8_t *)scratch, *packed = tile + tile_bytes;
        float *wsc = (float *)(packed + tile_bytes), *wmn = wsc + tile_rows * nbs, *buf = wmn + tile_rows * nbs;
        float *rsc = buf + chunk * tile_rows, *rmn = rsc + nbs;
        for (int64_t rb = 0; rb < m; rb += chunk) { /* every thread runs every chunk: the omp fors are shared */
        const int64_t mc = m - rb < chunk ? m - rb : chunk;
        const void *xc = (const uint16_t *)x + rb * x_stride;
        _Pragma("omp for schedule(static)")
        for (int64_t r0 = 0; r0 < mc; r0 += 16) {
            const int64_t r1 = mc - r0 < 16 ? mc : r0 + 16;
            quantize_act_rows(xc, x_stride, 0, mc, k, terms == 2, q, d, s, r0, r1);
            minimum_sides(q, d, s, mc, k, terms, cols, ds, r0, r1);
        }
        _Pragma("omp for schedule(static)")
        for (int64_t g = 0; g < groups; ++g) {
            if (scratch == NULL) continue;
            const int64_t f0 = g * tile_rows, count = n - f0 < tile_rows ? n - f0 : tile_rows;
            const int blocks = (int)((count + 31) / 32 * 2); /* pairs of 16-feature blocks */
            for (int64_t c = 0; c < 16 * blocks; ++c) { /* rows past n are zero: their outputs are dropped */
                uint8_t *row = tile + c * k;
                if (c >= count) {
                    memset(row, 0, (size_t)k);
                    memset(rsc, 0, sizeof(float) * (size_t)nbs);
                    memset(rmn, 0, sizeof(float) * (size_t)nbs);
                } else {
                    t->u8_row(w, n, f0 + c, k, row, rsc, rmn);
                }
                const int64_t j = c / 16, lane = c % 16;
                for (int64_t b = 0; b < nbs; ++b) {
                    wsc[(j * nbs + b) * 16 + lane] = rsc[b];
                    wmn[(j * nbs + b) * 16 + lane] = rmn[b];
                }
            }
            transpose_tile((const uint32_t *)tile, k / 4, blocks, (uint32_t *)packed);
            if (terms == 2 && cols == 16)
                rows_i8(q, d, ds, k, mc, 2, 4, packed, wsc, wmn, blocks, buf, tile_rows);
            else if (terms == 2)
                rows_i8(q, d, ds, k, mc, 2, 8, packed, wsc, wmn, blocks, buf, tile_rows);
            else if (cols == 16)
                rows_i8(q, d, ds, k, mc, 1, 4, packed, wsc, wmn, blocks, buf, tile_rows);
            else
                rows_i8(q, d, ds, k, mc, 1, 8, packed, wsc, wmn, blocks, buf, tile_rows);
            epilogue(buf, tile_rows, mc, f0, count, bias, bias_is_f32,
                     (char *)out + rb * out_stride * (out_is_f32 ? 4 : 2), out_stride, out_is_f32);
        }
        }
        free(scratch);
    }
    free(q); free(d); free(ds); free(s);
    return failed ? QUANT_E_MEMORY : QUANT_OK;
}
#else
#define HAVE_QUANT_BATCH 0
#endif
