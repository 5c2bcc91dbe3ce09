/*
 * What the GGUF-quantized matmul kernels share (csrc/quant_gemm.c drives them; one file per type family
 * supplies the per-type functions).
 *
 * A weight is a [n, k] matrix whose every row is a run of GGUF blocks: n * row_bytes bytes in the file layout
 * (row r at w + r * row_bytes), or the type's own same-size re-layout made once at load by its `repack`
 * function (the K types keep rows whole; the legacy types gather all quants, then all scales: quant_legacy.c).
 *
 * Activations for the small-row (decode) path are quantized once per call, per 32-element block, to int8
 * (symmetric: d = max|x| / 127, q = round(x / d)), in the activations' natural column order; each block also
 * carries the sum of its q (for the types whose weights have an offset: Q4_0's -8, Q4_1's min, the K types'
 * mins). AVX512-VNNI's vpdpbusd multiplies unsigned weight bytes by these signed activation bytes.
 */
#ifndef TOKENLOOM_QUANT_COMMON_H
#define TOKENLOOM_QUANT_COMMON_H

#include <stdint.h>

#define TL_QK 32 /* activation block */

/* GGUF type ids (gguf.constants.GGMLQuantizationType) */
enum { TL_Q4_0 = 2, TL_Q4_1 = 3, TL_Q5_0 = 6, TL_Q5_1 = 7, TL_Q8_0 = 8, TL_Q4_K = 12, TL_Q5_K = 13, TL_Q6_K = 14 };

/* m rows of quantized activations, k columns (k % 32 == 0): row r's quants at q + r * k, its block scales at
 * d + r * (k / 32), its block sums at s + r * (k / 32). `lanes`: the same quants' full spans in the order the Q4
 * kernels' interleaved weights want (quant_legacy.c, `q4_lanes_order`; the bytes after the last full span
 * unwritten), made once per call instead of once per chunk of rows; the Q4 kernels' full spans read only this
 * (their callers must make it), their tail pass and the other types only q.
 * `paired` (one activation row in two int8 terms, quantize_act's remainder as row 1): m == 2 and row 1's block
 * scales are exactly row 0's / 128 (TL_TERM2_SHIFT), so a kernel may sum the pair as one integer dot product,
 * 128 dot(row 0) + dot(row 1) (exact in int32: at most 2^7 * 32 * 255 * 127 per block lane), scaled once by
 * row 0's d / 128; it then writes that sum as row 0's output and 0 as row 1's. A kernel may also ignore the
 * flag: its caller adds the two rows' outputs either way. Zero everywhere else.
 * `pairs` (P > 1, batched decode): the same for P activation rows, m == 2 P, row P + r the second term of row r
 * (its block scales exactly row r's / 128); a kernel may sum each row's two terms as one and then writes that
 * sum as row r's output and 0 as row P + r's, or ignore it (the legacy, K and Q5 kernels take it). 1 with `paired`,
 * else 0. `q8_lanes`: with pairs > 1 for a Q8_0 weight, every row's full spans in the Q8_0 kernels' regrouped
 * order (quant_legacy.c, `q8_lanes_order`), made once per call; NULL everywhere else (those kernels then
 * regroup per tile and keep the terms apart). */
typedef struct {
    const int8_t *q;
    const float *d;
    const int32_t *s;
    int m;
    int64_t k;
    const int8_t *lanes;
    int paired;
    int pairs;
    const int8_t *q8_lanes;
} tl_act_q8;

/* log2 of the ratio of an activation block's first int8 scale to its second term's (quantize_act). */
#define TL_TERM2_SHIFT 7

/* out[r * out_stride + (j - n0)] = sum_i W[j][i] * A[r][i] for rows r < a->m and weight rows j in [n0, n1) of
 * the re-laid-out weight w [n rows, row_bytes each] (float32, before any bias). Called from inside an OpenMP
 * region: single-threaded, no allocation. */
typedef void (*tl_dot_rows_fn)(const uint8_t *w, int64_t n, int64_t row_bytes, int64_t n0, int64_t n1,
                               const tl_act_q8 *a, float *out, int64_t out_stride);

/* Row r (k columns) of the re-laid-out weight w [n rows] dequantized to float32: exactly the gguf package's
 * dequantize. (A type's re-layout may spread a row over the matrix: the functions take the matrix and a row.) */
typedef void (*tl_dequant_row_fn)(const uint8_t *w, int64_t n, int64_t r, int64_t k, float *out);

/* Re-lays out the n rows of data (k columns each) in place for the type's kernels (same size), or NULL when
 * the type keeps the file layout. Returns 0, or -1 when memory runs out. dequant_row must read the result. */
typedef int (*tl_repack_fn)(uint8_t *data, int64_t n, int64_t k);

/* Row r (k columns) of the re-laid-out weight w [n rows] as unsigned quants q[k] in natural column order with,
 * per block b of the type's u8_cols (32 or 16) columns, a scale and a minimum such that the dequantized weight
 * is scale[b] * q + min[b] (exact but for the one rounding the type's own dequantize makes): the many-row int8
 * path's tile (quant_batch.c). */
typedef void (*tl_u8_row_fn)(const uint8_t *w, int64_t n, int64_t r, int64_t k, uint8_t *q, float *scale,
                             float *min);

typedef struct {
    int type;
    int block;      /* elements per block */
    int block_size; /* bytes per block */
    tl_dot_rows_fn dot_rows;
    tl_dequant_row_fn dequant_row;
    tl_repack_fn repack;
    tl_u8_row_fn u8_row; /* NULL: no many-row int8 path for the type */
    int u8_cols;         /* columns per scale and minimum of u8_row: 32, or 16 (Q6_K's sub-blocks) */
} tl_quant_type;

/* Software prefetch of the small-row dot kernels: how many tiles ahead (0: none) each tile asks for the weight
 * bytes the next one reads (quant_prefetch() in quant_gemm.c sets it; benchmarks compare). */
static int tl_quant_prefetch_tiles = 1;

/* Which cache level those prefetches fill: 1 (the default) asks for L2 (prefetcht1), 0 for L1 (prefetcht0;
 * quant_prefetch_l2() in quant_gemm.c sets it; benchmarks compare). On the Zen 4 EPYC, one row of activations
 * on weights in memory: prefetcht0 made the kernels 1.04-1.32x slower per call (Q4_1 / Q4_K / Q6_K / Q8_0,
 * 8192x2048 and 2048x8192, bench/quant_gemm.py --prefetch-l1-ab), a SmolLM2 Q4_1 decode step 2.3% and a ~1B
 * Q4_K_M / Q8_0 step 6-8% slower. An L1
 * fill holds one of the core's few L1 miss buffers until the line arrives, and a stream at ~20 GB/s a core
 * keeps them all busy; an L2 fill does not, and the line is one L2 hit away when the load comes. */
static int tl_quant_prefetch_l2 = 1;

/* A software prefetch of the byte at p for the weight stream (needs <immintrin.h>). */
#define TL_QUANT_PREFETCH(p)                                                                                    \
    do {                                                                                                        \
        if (tl_quant_prefetch_l2)                                                                               \
            _mm_prefetch((const char *)(p), _MM_HINT_T1);                                                       \
        else                                                                                                    \
            _mm_prefetch((const char *)(p), _MM_HINT_T0);                                                       \
    } while (0)

/* Activation rows (the kernel's a->m, both int8 terms counted) up to which the small-row dot kernels read each
 * weight row whole in turn (the row-sequential stream) rather than in tiles of rows side by side
 * (quant_seq_m() in quant_gemm.c sets it; benchmarks compare; 0: never). */
static int tl_quant_seq_max_m = 2;

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
/* Each byte's high nibble as a byte 0..15 (the 4-bit weight types' second quant of a byte): one GF(2) affine
 * transform (GFNI: bits 4-7 to bits 0-3, the rest zero) where the CPU has it, else a shift and a mask. One
 * operation fewer per 64 quant bytes on the ports the dot products need (measured: the Q4_K row stream
 * 1.07-1.1x faster per super-block on a Xeon core). */
static inline __attribute__((always_inline)) __m512i tl_high_nibbles(__m512i x) {
#if defined(__GFNI__)
    return _mm512_gf2p8affine_epi64_epi8(x, _mm512_set1_epi64(0x1020408000000000LL), 0);
#else
    return _mm512_and_si512(_mm512_srli_epi16(x, 4), _mm512_set1_epi8(0x0f));
#endif
}
#endif

#endif
