/*
 * bf16 linear layers for a few rows (decode at small batch): out[M, N] = x[M, K] . W[N, K]^T (+ bias).
 *
 * At M <= 8 a linear layer is a stream over its weight: every weight byte is used M times, so the time is the
 * weight's bytes over the memory bandwidth. This kernel streams W once, 16 output rows at a time, with
 * AVX512-BF16 dot products (exact products, float32 sums) and one batched horizontal reduction per 16 outputs;
 * output rows are split over OpenMP threads (torch's libgomp). Results are rounded once to bf16.
 *
 * Requires AVX512-BF16 and K % 32 == 0; `small_gemm_supported()` says whether this build has the kernel.
 */
#include "bf16_common.h"
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_KERNEL 1
#else
#define HAVE_KERNEL 0
#endif

#define MAX_M 8
#define MAX_K 16384
#define ROWS 16 /* output features per work item */

KERNEL_API int small_gemm_supported(int *max_m, int *max_k) {
    *max_m = MAX_M;
    *max_k = MAX_K;
    return HAVE_KERNEL;
}

#if HAVE_KERNEL
/* Output rows r0 .. r0 + RB - 1 (RB = 1 or 2, a constant after inlining) of one block of 16 weight rows, in
 * two halves of 8 weight rows so that every weight vector loaded serves both x rows from registers. Output
 * t of row r accumulates chunks 0, 1, ... in order whatever RB is, so a row's result does not depend on
 * how many rows share the call. */
static inline __attribute__((always_inline)) void block_rows(const uint16_t *const *rows, const uint16_t *x,
                                                             int64_t x_stride, int r0, const int RB,
                                                             int64_t chunks, __m512 bias, __mmask16 mask,
                                                             uint16_t *out, int64_t n, int64_t n0) {
    __m512 acc[2][ROWS];
    for (int j = 0; j < RB; ++j)
        for (int t = 0; t < ROWS; ++t) acc[j][t] = _mm512_setzero_ps();
    for (int half = 0; half < 2; ++half) {
        for (int64_t c = 0; c < chunks; ++c) {
            __m512bh xv[2];
            for (int j = 0; j < RB; ++j) xv[j] = (__m512bh)_mm512_loadu_si512(x + (r0 + j) * x_stride + 32 * c);
            for (int t = 0; t < ROWS / 2; ++t) {
                const int tt = half * (ROWS / 2) + t;
                const __m512bh wv = (__m512bh)_mm512_loadu_si512(rows[tt] + 32 * c);
                for (int j = 0; j < RB; ++j)
                    acc[j][REDUCE16_SLOT(tt)] = _mm512_dpbf16_ps(acc[j][REDUCE16_SLOT(tt)], xv[j], wv);
            }
        }
    }
    for (int j = 0; j < RB; ++j) {
        const __m512 y = _mm512_add_ps(reduce16(acc[j]), bias);
        _mm256_mask_storeu_epi16(out + (r0 + j) * n + n0, mask, (__m256i)_mm512_cvtneps_pbh(y));
    }
}
#endif

/* Returns 0, or -1 when the shape is outside what the kernel handles (nothing is written then). */
KERNEL_API int linear_small_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias,
                                 uint16_t *out, int m, int64_t n, int64_t k, int threads) {
#if HAVE_KERNEL
    if (m < 1 || m > MAX_M || k % 32 != 0 || k > MAX_K) return -1;
    const int64_t chunks = k / 32, blocks = (n + ROWS - 1) / ROWS;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t n0 = blk * ROWS;
        const int valid = n - n0 < ROWS ? (int)(n - n0) : ROWS;
        const __mmask16 mask = (__mmask16)((1u << valid) - 1u);
        const uint16_t *rows[ROWS];
        for (int t = 0; t < ROWS; ++t) rows[t] = w + (n0 + (t < valid ? t : 0)) * k;
        if (blk + 2 < blocks) { /* the rows two blocks ahead are one contiguous stretch of W */
            const char *ahead = (const char *)(w + (n0 + 2 * ROWS) * k);
            for (int64_t o = 0; o < ROWS * k * 2; o += 256) _mm_prefetch(ahead + o, _MM_HINT_T1);
        }
        __m512 b = _mm512_setzero_ps();
        if (bias != NULL) { /* masked: a tail block must not read past the bias */
            const __m256i raw = _mm256_maskz_loadu_epi16(mask, bias + n0);
            b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
        }
        int r = 0;
        for (; r + 2 <= m; r += 2) block_rows(rows, x, x_stride, r, 2, chunks, b, mask, out, n, n0);
        if (r < m) block_rows(rows, x, x_stride, r, 1, chunks, b, mask, out, n, n0);
    }
    return 0;
#else
    (void)x; (void)x_stride; (void)w; (void)bias; (void)out; (void)m; (void)n; (void)k; (void)threads;
    return -1;
#endif
}
