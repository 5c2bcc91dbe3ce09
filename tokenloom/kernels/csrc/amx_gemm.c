/*
 * bf16 linear layers on the AMX tile unit: out[M, N] = x[M, K] . W[N, K]^T (+ bias), float32 sums, one rounding.
 *
 * Why: in decode a linear layer's cost is moving its weight in from memory, and oneDNN's matmul at 16-256 rows
 * reads weights far below the memory bandwidth. Here the weight is packed once (amx_pack_weight) into the
 * layout TDPBF16PS takes for its B operand, block after block, so a call streams it once, front to back:
 *   block j (output features 16j .. 16j+15), K step s (inputs 32s .. 32s+31): one 1 KB tile whose row r holds,
 *   for each feature c, the pair W[16j + c][32s + 2r], W[16j + c][32s + 2r + 1].
 * N is padded with zero features to a multiple of 32 and K with zeros to a multiple of 32.
 *
 * The kernel: x is copied once into a zero-padded scratch (rows to a multiple of 16, K to the packed K). Pairs
 * of feature blocks (32 outputs) are split over OpenMP threads in contiguous ranges; for a pair, every group of
 * 32 (or a last 16) rows accumulates 2x2 (or 1x2) output tiles over K and writes them out (+ bias, rounded to
 * bf16 once). The next pair's weight is prefetched into L2 while the current one is computed, spread over
 * all its row groups, and each tile into L1 two K steps before it is loaded. An output element sums its K
 * steps in order, so its value does not depend on M, the row group or the thread count. amx_linear_bf16_f32
 * stores the float32 sums unrounded (the LM head).
 *
 * Requires AMX-BF16 and the kernel's permission (amx_gemm_supported() says both); tile configuration as in
 * amx_common.h. TOKENLOOM_DISABLE_AMX=1 turns it off.
 */
#include "amx_common.h"
#include "bf16_common.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define AMX_TILE_ELEMS 512 /* bf16 elements in one 16 x 64-byte tile */

static int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

/* Elements of the packed copy of a weight [n, k]. */
KERNEL_API int64_t amx_packed_numel(int64_t n, int64_t k) { return round_up(n, 32) * round_up(k, 32); }

KERNEL_API int amx_gemm_supported(void) {
#if HAVE_AMX
    static int usable = -1; /* decided once per process (every call checks it) */
    if (usable < 0) {
        const char *off = getenv("TOKENLOOM_DISABLE_AMX");
        usable = !(off != NULL && off[0] == '1') && amx_permitted();
    }
    return usable;
#else
    return 0;
#endif
}

/* Pack W [n, k] (row stride w_stride) into `packed` (amx_packed_numel elements). */
KERNEL_API void amx_pack_weight(const uint16_t *w, int64_t w_stride, int64_t n, int64_t k, uint16_t *packed) {
    const int64_t kp = round_up(k, 32), np = round_up(n, 32), steps = kp / 32;
    memset(packed, 0, sizeof(uint16_t) * (size_t)(np * kp));
    for (int64_t f = 0; f < n; ++f) {
        const int64_t j = f / 16, c = f % 16;
        for (int64_t i = 0; i < k; ++i) {
            const int64_t s = i / 32, r = (i % 32) / 2, p = i % 2;
            packed[(j * steps + s) * AMX_TILE_ELEMS + r * 32 + c * 2 + p] = w[f * w_stride + i];
        }
    }
}

#if HAVE_AMX
/* Prefetch cache lines [first, first + count) of the next feature pair (`lines` in all) into L2. Every K
 * step of every row group issues its share, so the stream keeps going for the whole of the pair's compute.
 * One pair ahead measured best (bench: 2 or 4 pairs ahead, or into L1, were 2-8% slower; none at all was
 * 0-18% slower). */
static inline void prefetch_lines(const uint16_t *ahead, int64_t first, int count, int64_t lines) {
    if (ahead == NULL) return;
    const char *p = (const char *)ahead;
    for (int l = 0; l < count && first + l < lines; ++l) _mm_prefetch(p + 64 * (first + l), _MM_HINT_T1);
}

/* Tiles are read this many K steps after prefetch_tile asked for them: the L2 prefetch above brings a pair
 * within reach, this brings the next tiles into L1, because a tile load whose rows miss L1 stalls the tile
 * unit. Over the model's weights, with builds alternating in one process (docs/benchmarks.md): 1-4 rows
 * 19 -> 15 ms, 64 rows 38 -> 32 ms; 1 to 4 steps ahead measured alike. */
#define TILE_PREFETCH_STEPS 2

/* Ask for one 1 KB tile (16 lines) in L1. */
static inline void prefetch_tile(const uint16_t *tile) {
    for (int line = 0; line < 16; ++line) _mm_prefetch((const char *)tile + 64 * line, _MM_HINT_T0);
}

/* Outputs of `rows` rows x 32 features from fp32 tile results c[row][32] (+ bias), masked to n: rounded to
 * bf16 into `out`, or kept float32 in `out_f32` when that is set. */
static inline void store_rows(const float *c, int rows, const __m512 bias[2], __mmask16 mask[2], uint16_t *out,
                              float *out_f32, int64_t out_stride) {
    for (int r = 0; r < rows; ++r)
        for (int h = 0; h < 2; ++h) {
            const __m512 y = _mm512_add_ps(_mm512_loadu_ps(c + r * 32 + h * 16), bias[h]);
            if (out_f32 != NULL)
                _mm512_mask_storeu_ps(out_f32 + r * out_stride + h * 16, mask[h], y);
            else
                _mm256_mask_storeu_epi16(out + r * out_stride + h * 16, mask[h], (__m256i)_mm512_cvtneps_pbh(y));
        }
}

/* Feature pair `pair` (32 outputs) for every row group of the padded input xa [mp, kp]. */
static void pair_tiles(const uint16_t *xa, int64_t m, int64_t kp, const uint16_t *b0, const uint16_t *ahead,
                       const uint16_t *bias, int64_t n, int64_t f0, uint16_t *out, float *out_f32,
                       int64_t out_stride) {
    const int64_t steps = kp / 32;
    const uint16_t *b1 = b0 + steps * AMX_TILE_ELEMS;
    const int64_t lines = steps * 32, groups = (m + 31) / 32; /* a pair's K step is 2 KB = 32 lines */
    const int per_step = (int)((32 + groups - 1) / groups);
    float c[32 * 32] __attribute__((aligned(64)));
    __m512 bv[2];
    __mmask16 mask[2];
    for (int h = 0; h < 2; ++h) {
        const int64_t lo = f0 + 16 * h;
        const int valid = n - lo >= 16 ? 16 : (n - lo > 0 ? (int)(n - lo) : 0);
        mask[h] = (__mmask16)((1u << valid) - 1u);
        bv[h] = _mm512_setzero_ps();
        if (bias != NULL && valid > 0)
            bv[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                _mm256_maskz_loadu_epi16(mask[h], bias + lo)), 16));
    }
    for (int64_t m0 = 0; m0 < m; m0 += 32) {
        const uint16_t *a = xa + m0 * kp; /* tile-ordered: group m0/16's K steps, then group m0/16 + 1's */
        const int64_t issued = (m0 / 32) * steps * per_step; /* lines prefetched by the earlier groups */
        if (m - m0 > 16) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t s = 0; s < steps; ++s) {
                prefetch_lines(ahead, issued + s * per_step, per_step, lines);
                if (s + TILE_PREFETCH_STEPS < steps) {
                    prefetch_tile(a + (s + TILE_PREFETCH_STEPS) * AMX_TILE_ELEMS);
                    prefetch_tile(a + (steps + s + TILE_PREFETCH_STEPS) * AMX_TILE_ELEMS);
                    prefetch_tile(b0 + (s + TILE_PREFETCH_STEPS) * AMX_TILE_ELEMS);
                    prefetch_tile(b1 + (s + TILE_PREFETCH_STEPS) * AMX_TILE_ELEMS);
                }
                _tile_loadd(4, a + s * AMX_TILE_ELEMS, 64);
                _tile_loadd(5, a + (steps + s) * AMX_TILE_ELEMS, 64);
                _tile_loadd(6, b0 + s * AMX_TILE_ELEMS, 64);
                _tile_loadd(7, b1 + s * AMX_TILE_ELEMS, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, c, 128);
            _tile_stored(1, c + 16, 128);
            _tile_stored(2, c + 16 * 32, 128);
            _tile_stored(3, c + 16 * 32 + 16, 128);
            const int64_t at = m0 * out_stride + f0;
            store_rows(c, m - m0 >= 32 ? 32 : (int)(m - m0), bv, mask, out_f32 ? NULL : out + at,
                       out_f32 ? out_f32 + at : NULL, out_stride);
        } else {
            _tile_zero(0);
            _tile_zero(1);
            for (int64_t s = 0; s < steps; ++s) {
                prefetch_lines(ahead, issued + s * per_step, per_step, lines);
                if (s + TILE_PREFETCH_STEPS < steps) { /* 16 rows of x stay in L1: only the weight's tiles */
                    prefetch_tile(b0 + (s + TILE_PREFETCH_STEPS) * AMX_TILE_ELEMS);
                    prefetch_tile(b1 + (s + TILE_PREFETCH_STEPS) * AMX_TILE_ELEMS);
                }
                _tile_loadd(4, a + s * AMX_TILE_ELEMS, 64);
                _tile_loadd(6, b0 + s * AMX_TILE_ELEMS, 64);
                _tile_loadd(7, b1 + s * AMX_TILE_ELEMS, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
            }
            _tile_stored(0, c, 128);
            _tile_stored(1, c + 16, 128);
            const int64_t at = m0 * out_stride + f0;
            store_rows(c, (int)(m - m0), bv, mask, out_f32 ? NULL : out + at, out_f32 ? out_f32 + at : NULL,
                       out_stride);
        }
    }
}

/* Zero-padded copy of x [m, k] (row stride x_stride) in tile order: for each group of 16 rows, its K steps'
 * 16 x 32 blocks one after another (each a contiguous tile). Per calling thread, grown as needed. */
static __thread uint16_t *amx_xa = NULL;
static __thread int64_t amx_xa_cap = 0;

static const uint16_t *padded_input(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, int64_t kp) {
    const int64_t mp = round_up(m, 16);
    if (mp * kp > amx_xa_cap) {
        free(amx_xa);
        amx_xa = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * (size_t)(mp * kp));
        amx_xa_cap = amx_xa != NULL ? mp * kp : 0;
        if (amx_xa == NULL) return NULL;
    }
    const int64_t steps = kp / 32;
    memset(amx_xa, 0, sizeof(uint16_t) * (size_t)(mp * kp));
    for (int64_t r = 0; r < m; ++r) {
        uint16_t *dst = amx_xa + (r / 16) * steps * AMX_TILE_ELEMS + (r % 16) * 32;
        for (int64_t s = 0; s * 32 < k; ++s)
            memcpy(dst + s * AMX_TILE_ELEMS, x + r * x_stride + s * 32,
                   sizeof(uint16_t) * (size_t)(k - s * 32 >= 32 ? 32 : k - s * 32));
    }
    return amx_xa;
}
#endif

/* Every feature pair for the m rows of x; exactly one of out / out_f32 is set. Returns 0, or -1 when the
 * kernel is unavailable or its scratch cannot be allocated (nothing written then). */
static int amx_linear(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias,
                      uint16_t *out, float *out_f32, int64_t out_stride, int64_t m, int64_t n, int64_t k,
                      int threads) {
#if HAVE_AMX
    if (m < 1 || n < 1 || k < 1 || !amx_gemm_supported()) return -1;
    const int64_t kp = round_up(k, 32), pairs = round_up(n, 32) / 32, pair_elems = 2 * (kp / 32) * AMX_TILE_ELEMS;
    const uint16_t *xa = padded_input(x, x_stride, m, k, kp);
    if (xa == NULL) return -1;
    if (threads > pairs) threads = (int)pairs;
    _Pragma("omp parallel num_threads(threads)")
    {
        amx_configure();
        _Pragma("omp for schedule(static)")
        for (int64_t p = 0; p < pairs; ++p) {
            const uint16_t *b0 = packed + p * pair_elems;
            pair_tiles(xa, m, kp, b0, p + 1 < pairs ? b0 + pair_elems : NULL, bias, n, 32 * p, out, out_f32,
                       out_stride);
        }
        _tile_release();
    }
    return 0;
#else
    (void)x; (void)x_stride; (void)packed; (void)bias; (void)out; (void)out_f32; (void)out_stride; (void)m;
    (void)n; (void)k; (void)threads;
    return -1;
#endif
}

/* bf16 outputs. Returns 0, or -1 when the kernel is unavailable or out of memory (nothing written then). */
KERNEL_API int amx_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias,
                               uint16_t *out, int64_t out_stride, int64_t m, int64_t n, int64_t k, int threads) {
    return amx_linear(x, x_stride, packed, bias, out, NULL, out_stride, m, n, k, threads);
}

/* float32 outputs (the LM head's logits), otherwise as amx_linear_bf16. */
KERNEL_API int amx_linear_bf16_f32(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                                   const uint16_t *bias, float *out, int64_t out_stride, int64_t m, int64_t n,
                                   int64_t k, int threads) {
    return amx_linear(x, x_stride, packed, bias, NULL, out, out_stride, m, n, k, threads);
}
