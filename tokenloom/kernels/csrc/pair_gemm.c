/*
 * bf16 GEMM with float32 outputs on AVX512-BF16, for the LM head: logits[M, N] = x[M, K] . W[N, K]^T, the
 * exact bf16 products summed in float32 and stored unrounded (logits rounded to bf16 tie often enough to
 * flip greedy choices; see docs/benchmarks.md, issue 16).
 *
 * Why a kernel of its own: oneDNN's bf16 matmul (through torch) can only write bf16, and the streaming
 * kernel (small_gemm.c, one horizontal reduction per output) is 4x slower than oneDNN at 64 rows. Here the
 * weight is packed once (pair_pack_weight) so that one 64-byte vector holds, for 16 consecutive output
 * features, the pair of weights of one K pair:
 *     packed[(block * pairs + p) * 32 + 2 * c + e] = W[16 * block + c][2 * p + e]   (zero-padded in N and K)
 * and TDPBF16PS's AVX-512 sibling VDPBF16PS multiplies it by the broadcast pair x[r][2p], x[r][2p + 1] into
 * the 16 features' accumulators. A work item is a group of GROUP_BLOCKS feature blocks (64 outputs): for each
 * band of up to BAND_ROWS rows it keeps BAND_ROWS x GROUP_BLOCKS accumulators in registers over all of K, so
 * no horizontal sum is needed, and the group's weights (GROUP_BLOCKS x K x 32 bytes) stay in L2 while every
 * band reads them; the weight is read from memory once per call. Groups are split over OpenMP threads.
 * An output sums its K pairs in order, so its value does not depend on M, the band or the thread count.
 *
 * Requires AVX512-BF16 (pair_gemm_supported() says whether this build has it).
 */
#include "bf16_common.h"
#include <stdint.h>
#include <string.h>

#define PAIR_BLOCK 16  /* output features per vector */
#define GROUP_BLOCKS 4 /* feature blocks per work item: 64 outputs */
#define BAND_ROWS 6    /* rows per register band: 6 x 4 = 24 accumulators */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define HAVE_PAIR_GEMM 1
#else
#define HAVE_PAIR_GEMM 0
#endif

KERNEL_API int pair_gemm_supported(void) { return HAVE_PAIR_GEMM; }

/* Elements (bf16) of the packed copy of a weight [n, k]. */
KERNEL_API int64_t pair_packed_numel(int64_t n, int64_t k) {
    return (n + PAIR_BLOCK - 1) / PAIR_BLOCK * PAIR_BLOCK * ((k + 1) / 2 * 2);
}

/* Pack W [n, k] (row stride w_stride) into `packed` (pair_packed_numel elements). */
KERNEL_API void pair_pack_weight(const uint16_t *w, int64_t w_stride, int64_t n, int64_t k, uint16_t *packed) {
    const int64_t pairs = (k + 1) / 2, blocks = (n + PAIR_BLOCK - 1) / PAIR_BLOCK;
    memset(packed, 0, sizeof(uint16_t) * (size_t)(blocks * pairs * 2 * PAIR_BLOCK));
    for (int64_t f = 0; f < n; ++f) {
        const int64_t block = f / PAIR_BLOCK, c = f % PAIR_BLOCK;
        for (int64_t i = 0; i < k; ++i)
            packed[(block * pairs + i / 2) * 2 * PAIR_BLOCK + 2 * c + i % 2] = w[f * w_stride + i];
    }
}

#if HAVE_PAIR_GEMM
/* Rows r0 .. r0 + NR - 1 times the group's first NB feature blocks (NR, NB <= GROUP_BLOCKS: constants once inlined;
 * x rows are read as 32-bit pairs, K being even). */
static inline __attribute__((always_inline)) void band(const uint16_t *x, int64_t x_stride, int64_t r0,
                                                       const int NR, const uint16_t *group, int64_t pairs,
                                                       const int NB, float *out, int64_t out_stride, int64_t f0,
                                                       int64_t n) {
    __m512 acc[BAND_ROWS][GROUP_BLOCKS];
    for (int r = 0; r < NR; ++r)
        for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
    const uint32_t *xr[BAND_ROWS];
    for (int r = 0; r < NR; ++r) xr[r] = (const uint32_t *)(x + (r0 + r) * x_stride);
    for (int64_t p = 0; p < pairs; ++p) {
        __m512bh b[GROUP_BLOCKS];
        for (int j = 0; j < NB; ++j)
            b[j] = (__m512bh)_mm512_loadu_si512(group + ((int64_t)j * pairs + p) * 2 * PAIR_BLOCK);
        for (int r = 0; r < NR; ++r) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)xr[r][p]);
            for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, b[j]);
        }
    }
    for (int j = 0; j < NB; ++j) {
        const int64_t lo = f0 + (int64_t)j * PAIR_BLOCK;
        const int valid = n - lo >= PAIR_BLOCK ? PAIR_BLOCK : (int)(n - lo);
        const __mmask16 mask = (__mmask16)((1u << valid) - 1u);
        for (int r = 0; r < NR; ++r) _mm512_mask_storeu_ps(out + (r0 + r) * out_stride + lo, mask, acc[r][j]);
    }
}

/* Every band of rows for one group of NB feature blocks. */
static inline __attribute__((always_inline)) void group_rows(const uint16_t *x, int64_t x_stride, int64_t m,
                                                             const uint16_t *group, int64_t pairs, const int NB,
                                                             float *out, int64_t out_stride, int64_t f0,
                                                             int64_t n) {
    int64_t r = 0;
    for (; r + BAND_ROWS <= m; r += BAND_ROWS)
        band(x, x_stride, r, BAND_ROWS, group, pairs, NB, out, out_stride, f0, n);
    switch (m - r) { /* the last band's rows, each a constant so the accumulators stay in registers */
    case 5: band(x, x_stride, r, 5, group, pairs, NB, out, out_stride, f0, n); break;
    case 4: band(x, x_stride, r, 4, group, pairs, NB, out, out_stride, f0, n); break;
    case 3: band(x, x_stride, r, 3, group, pairs, NB, out, out_stride, f0, n); break;
    case 2: band(x, x_stride, r, 2, group, pairs, NB, out, out_stride, f0, n); break;
    case 1: band(x, x_stride, r, 1, group, pairs, NB, out, out_stride, f0, n); break;
    default: break;
    }
}
#endif

/* out[m, n] (row stride out_stride) = x[m, k] (k even, rows 4-byte aligned) . W^T with W packed by
 * pair_pack_weight. Returns 0, or -1 when this build lacks the kernel or the shape is unsupported. */
KERNEL_API int pair_linear_bf16_f32(const uint16_t *x, int64_t x_stride, const uint16_t *packed, float *out,
                                    int64_t out_stride, int64_t m, int64_t n, int64_t k, int threads) {
#if HAVE_PAIR_GEMM
    if (m < 1 || n < 1 || k < 2 || k % 2 != 0) return -1;
    const int64_t pairs = k / 2, blocks = (n + PAIR_BLOCK - 1) / PAIR_BLOCK;
    const int64_t groups = (blocks + GROUP_BLOCKS - 1) / GROUP_BLOCKS, block_elems = pairs * 2 * PAIR_BLOCK;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t b0 = g * GROUP_BLOCKS;
        const uint16_t *group = packed + b0 * block_elems;
        if (g + 1 < groups) { /* the next group's first K pairs, so its stream starts without a stall */
            const char *ahead = (const char *)(group + GROUP_BLOCKS * block_elems);
            for (int64_t o = 0; o < 4096; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T1);
        }
        const int64_t f0 = b0 * PAIR_BLOCK;
        switch (blocks - b0 >= GROUP_BLOCKS ? GROUP_BLOCKS : blocks - b0) {
        case 4: group_rows(x, x_stride, m, group, pairs, 4, out, out_stride, f0, n); break;
        case 3: group_rows(x, x_stride, m, group, pairs, 3, out, out_stride, f0, n); break;
        case 2: group_rows(x, x_stride, m, group, pairs, 2, out, out_stride, f0, n); break;
        default: group_rows(x, x_stride, m, group, pairs, 1, out, out_stride, f0, n); break;
        }
    }
    return 0;
#else
    (void)x; (void)x_stride; (void)packed; (void)out; (void)out_stride; (void)m; (void)n; (void)k; (void)threads;
    return -1;
#endif
}
