/*
 * GGUF-quantized matmul for x86 CPUs with AVX2, FMA and F16C but without the AVX-512 families quant_gemm.c
 * builds otherwise (AMD Zen 2/3, Intel client cores, Xeons without AVX512-BF16): the same entry points, the same
 * types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K); rows stay rows, each re-laid out once at load (the
 * file's size; Q4_K / Q5_K 4 bytes a super-block more, their 6-bit scales unpacked).
 *
 * bf16 x below quant_tile_m rows (quant_path 1: decode): x is quantized per 32-element block to int8 in two
 * terms exactly as quant_gemm.c's decode rows are (d = max|x| / 127, q = round(x / d); the remainder at scale
 * d / 128), so the error bound is the same: |err| <= sum_i |w_i| * d_x(i) / 256 (d_x / 2 with one term,
 * quant_act_residual(0)). The two terms are stored joined, one int16 per element (128 q0 + q1: |q| <= 16320),
 * and each weight block is widened once per four activation rows to 32 int16 and multiplied by vpmaddwd: two
 * multiplies a block and row where vpmaddubsw would take four and their int32 widening (1.2-1.6x faster at 1-4
 * rows on Zen 3, the same integer sums). Q5_K and Q6_K, whose wider quants cost more to widen, take the other
 * form: their bytes against the two terms split back into int8, by vpmaddubsw (kquant_avx2.c: 0.6-0.8x the time
 * at one row). Every type's quants are re-laid out once at load in a lane
 * order in which each int32 lane of the products stays in one block / sub-block, so a span's sums need no
 * horizontal reduction and are scaled in float32 by one multiply-add with vectors of per-lane scales (the
 * weights' times the activation blocks'): kquant_avx2.c (the order; the K types), legacy_avx2.c (Q4_0, Q4_1,
 * Q5_0, Q5_1, Q8_0). The types' offsets (Q4_0's -8, Q5_0's -16, Q4_1's / Q5_1's min, the K types' mins, Q6_K's
 * -32) multiply per-block
 * activation sums prepared once per call. A row's result does not depend on the rows beside it: the one-row
 * and four-row forms make the same sums in the same order.
 * Weight rows are split over the OpenMP threads in chunks; a chunk meets the activation rows 64 at a time (they
 * stay in L2).
 * float32 x, and bf16 x from quant_tile_m rows (quant_path 0: prefill, batched decode): weight rows dequantized
 * exactly to float32 and multiplied with float32 FMAs in register tiles (tile_avx2.c), exact products
 * (Zen 3, two threads, bench/quant_gemm.py --int8: against the int16 terms 1.2-1.6x faster at 64-256 rows;
 * with those in lane order, level at 16-32 rows and 0.5-0.8x at 8-12; 120-133 GFLOP/s at 256 rows in a
 * quiet phase). The K and legacy types' tiles read the weights dequantized in lane order and the activation
 * rows put into the same order, so every product meets its partner.
 * Dequantize (embedding rows, the tile, the reference) is the gguf package's arithmetic, bit for bit.
 *
 * Included by quant_gemm.c (it uses its knobs and error codes); HAVE_QUANT_AVX2 is 0 where the AVX-512 families
 * are built or the CPU lacks AVX2.
 */
#if !HAVE_QUANT_GEMM && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HAVE_QUANT_AVX2 1
#include <immintrin.h>

/* No reassociation (-ffast-math allows it): each output's sum keeps one order at every row count and thread
 * count, so a row's result does not depend on the rows computed beside it. */
#pragma GCC push_options
#pragma GCC optimize("no-associative-math")

#define AVX2_ROW_CHUNK 16 /* weight rows per work item */
#define AVX2_ACT_CHUNK 64 /* activation rows a chunk of weight rows meets at a time */
#define AVX2_ACT_SPLIT 16 /* activation rows from which their quantizing is split over the threads */
#define AVX2_TILE_M 16    /* bf16 rows from which the float32 tile replaces the int8 terms (quant_tile_m) */

/* Quantized activations, the two int8 terms joined into one int16 per element, q = 128 q0 + q1 (q0 alone with
 * one term; |q| <= 128 * 127 + 64): row r at q + r * k; per (row, block) at r * nb + b the scale of q, dc
 * (d / 128 with two terms, d with one), and the block's quant sum at that scale, xs = dc * sum(q): what the
 * offsets multiply. */
typedef struct {
    const int16_t *q;
    const float *dc;
    const float *xs;
    const int32_t *s16; /* Q6_K: per row k / 16 sums of q (kquant_avx2.c) */
    const int8_t *q8;   /* the K types: per row 2 k int8, q as two terms in lane order (kquant_avx2.c) */
    int64_t m, k;
} avx2_act;

static inline __attribute__((always_inline)) float avx2_h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline float avx2_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline int32_t avx2_hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

/* Two vectors of 8 int32 (each within int16's range) -> their 16 values as int16, in order. */
static inline __m256i avx2_pack_i16(__m256i a, __m256i b) {
    return _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
}

/* Rows r0 .. r1 - 1 of x [m, k] (bf16, or float32 where x_is_f32) quantized (see the file comment) into q, dc,
 * xs laid out as avx2_act. */
static void avx2_quantize_rows(const void *x, int64_t x_stride, int x_is_f32, int64_t k, int terms, int16_t *q,
                               float *dc, float *xs, int64_t r0, int64_t r1) {
    const int64_t nb = k / TL_QK;
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            __m256 v[4];
            const int64_t at = r * x_stride + 32 * b;
            for (int i = 0; i < 4; ++i)
                v[i] = x_is_f32 ? _mm256_loadu_ps((const float *)x + at + 8 * i)
                                : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
                                      _mm_loadu_si128((const __m128i *)((const uint16_t *)x + at + 8 * i))), 16));
            const __m256 mx =
                _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                              _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
            const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            __m256i qi[4];
            for (int i = 0; i < 4; ++i) /* round to nearest (even), the MXCSR default */
                qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
            float dcb = scale;
            if (terms == 2) {
                const float inv2 = (float)(1 << TL_TERM2_SHIFT) * inv;
                dcb = scale * (1.0f / (1 << TL_TERM2_SHIFT));
                for (int i = 0; i < 4; ++i) {
                    const __m256 rest = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(qi[i]), _mm256_set1_ps(scale), v[i]);
                    const __m256i qr = _mm256_cvtps_epi32(_mm256_mul_ps(rest, _mm256_set1_ps(inv2)));
                    qi[i] = _mm256_add_epi32(_mm256_slli_epi32(qi[i], TL_TERM2_SHIFT), qr);
                }
            }
            _mm256_storeu_si256((__m256i *)(q + r * k + 32 * b), avx2_pack_i16(qi[0], qi[1]));
            _mm256_storeu_si256((__m256i *)(q + r * k + 32 * b + 16), avx2_pack_i16(qi[2], qi[3]));
            const int32_t sum =
                avx2_hsum_i32(_mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3])));
            dc[r * nb + b] = dcb;
            xs[r * nb + b] = dcb * (float)sum;
        }
}

/* Q4_K / Q5_K: the 6-bit scales (bytes 0-7) and mins (bytes 8-15) of the eight sub-blocks, from the 12 packed
 * bytes u (scales 0-3 and mins 0-3: the low six bits of u[0..3] and u[4..7]; scales / mins 4-7: the low / high
 * nibbles of u[8..11] plus the top two bits of u[0..3] / u[4..7]), in vector registers: 16 bytes loaded (the 4
 * past the 12 are the super-block's first quants, masked off). Against the scalar unpack it replaced (the same
 * bytes): Q4_K one row 0.92x the time (one thread from cache; two threads from memory 0.91-0.92x), Q5_K 0.98x. */
static inline __attribute__((always_inline)) __m128i avx2_k4_scales(const uint8_t *packed) {
    const __m128i u = _mm_loadu_si128((const __m128i *)packed);
    /* bytes 0-7: u[0..7] & 63; 8-11: u[8..11] & 15; 12-15: u[8..11] >> 4 */
    const __m128i spread = _mm_shuffle_epi8(u, _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 8, 9, 10, 11));
    const __m128i low =
        _mm_and_si128(spread, _mm_setr_epi8(63, 63, 63, 63, 63, 63, 63, 63, 15, 15, 15, 15, 0, 0, 0, 0));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(spread, 4),
                                       _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15));
    /* bytes 8-15: the top two bits of u[0..7], at bits 4-5 (bytes 0-7: zero) */
    const __m128i top = _mm_and_si128(_mm_srli_epi16(_mm_slli_si128(u, 8), 2), _mm_set1_epi8(0x30));
    const __m128i v = _mm_or_si128(_mm_or_si128(low, high), top); /* sc0-3 mn0-3 sc4-7 mn4-7 */
    return _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15));
}

/* Re-laid-out Q4_K / Q5_K super-blocks (kquant_avx2.c): f16 d and dmin, the eight 6-bit scales and the eight
 * mins unpacked to a byte each (16 bytes where the file packs 12), then the quants. */
#define AVX2_Q4K_BYTES 148
#define AVX2_Q5K_BYTES 180
#define AVX2_K4_QUANTS 20 /* offset of the quants (Q5_K: its fifth bits, then the nibbles at 52) */

/* Q4_K / Q5_K re-laid-out super-block blk: its eight sub-blocks' scales (d times the 6-bit scale) and min steps
 * (dmin times the 6-bit min); d and dmin converted together (one vcvtph2ps). */
static inline __attribute__((always_inline)) void avx2_k4_scale_min(const uint8_t *blk, __m256 *dw, __m256 *dm) {
    const __m128i sm = _mm_loadu_si128((const __m128i *)(blk + 4));
    int32_t both;
    memcpy(&both, blk, 4);
    const __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128(both)); /* lane 0 d, lane 1 dmin */
    *dw = _mm256_mul_ps(_mm256_broadcastss_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)));
    *dm = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(d)),
                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))));
}

/* The 64-byte lines of [p, p + bytes) prefetched (TL_QUANT_PREFETCH: into L2 by default). */
static inline void avx2_prefetch_bytes(const uint8_t *p, int64_t bytes) {
    const uintptr_t first = (uintptr_t)p & ~(uintptr_t)63, end = (uintptr_t)p + (uintptr_t)bytes;
    for (uintptr_t line = first; line < end; line += 64) TL_QUANT_PREFETCH((const char *)line);
}

#include "kquant_avx2.c" /* the K types, in the sub-block-per-lane layout */
#include "legacy_avx2.c" /* the legacy types, in the same lane order */

static const tl_quant_type AVX2_TYPES[] = {
    {TL_Q4_0, 32, 18, NULL, NULL, avx2_q4_0_repack, NULL, 32},
    {TL_Q4_1, 32, 20, NULL, NULL, avx2_q4_1_repack, NULL, 32},
    {TL_Q8_0, 32, 34, NULL, NULL, avx2_q8_0_repack, NULL, 32},
    {TL_Q5_0, 32, 22, NULL, NULL, avx2_q5_0_repack, NULL, 32},
    {TL_Q5_1, 32, 24, NULL, NULL, avx2_q5_1_repack, NULL, 32},
    {TL_Q4_K, 256, AVX2_Q4K_BYTES, NULL, NULL, avx2_q4_k_repack, NULL, 32},
    {TL_Q5_K, 256, AVX2_Q5K_BYTES, NULL, NULL, avx2_q5_k_repack, NULL, 32},
    {TL_Q6_K, 256, 210, NULL, NULL, avx2_q6_k_repack, NULL, 16},
};

static const tl_quant_type *tl_avx2_type(int type) {
    for (size_t i = 0; i < sizeof AVX2_TYPES / sizeof AVX2_TYPES[0]; ++i)
        if (AVX2_TYPES[i].type == type) return &AVX2_TYPES[i];
    return NULL;
}

/* Dequantize, exact: the gguf package's operations and roundings (each product and sum rounded on its own, never
 * fused: hence fp-contract off for these two functions, whatever -ffast-math allows elsewhere). */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

/* Row r of w (type t, k columns, the AVX2 row layout) dequantized to float32 in file order: in lane order first
 * (a stack buffer up to 4096 columns), then put back. */
static void avx2_dequant_row(const tl_quant_type *t, const uint8_t *w, int64_t r, int64_t k, float *out) {
    const uint8_t *row = w + r * (k / t->block * t->block_size);
    float local[4096], *lanes = k <= 4096 ? local : malloc(sizeof(float) * (size_t)k);
    if (lanes == NULL) { /* no memory for the buffer: NaN, never garbage that looks like weights */
        for (int64_t i = 0; i < k; ++i) out[i] = __builtin_nanf("");
        return;
    }
    if (t->block == 256)
        avx2_k_dequant_lanes(t->type, row, k, lanes);
    else
        avx2_legacy_dequant_lanes(t->type, row, k, lanes);
    avx2_natural_f32(lanes, out, k, t->type);
    if (lanes != local) free(lanes);
}
#pragma GCC pop_options

/* The weight stream's software prefetch distance per tl_quant_prefetch_tiles, bytes: each row of at most
 * AVX2_PREFETCH_ROW_MAX bytes, as it starts, asks for the bytes this far past its own into L2 (a thread's rows
 * lie one after another in memory). Zen 3, two threads, weights from memory (bench/quant_gemm.py --prefetch-ab,
 * against no prefetch): Q8_0 one row 1.23-1.60x faster (3072x576, 576x1536, 2048x2048), four rows 1.07-1.22x;
 * Q4_1 1.0-1.37x, Q6_K 2048x2048 1.12x, Q4_K level; rows longer than a few KiB (Q6_K / Q4_K at k = 8192) were
 * 0.84x / level with it: their long runs the hardware prefetchers follow alone. */
#define AVX2_PREFETCH_AHEAD 2048
#define AVX2_PREFETCH_ROW_MAX 4096
/* Longer rows prefetch as they go instead: each span (a super-block, 8 legacy blocks) as the dot product reaches
 * it asks for the span this many bytes on into L2. Zen 3, two threads, weights from memory, 2048x8192 one row
 * (bench/quant_gemm.py --prefetch-ab, two runs): Q4_K / Q5_K / Q6_K 0.83-0.88x the time without, Q4_0 0.89-0.91x,
 * Q8_0 level; four rows 0.92-0.99x. On rows up to 4 KiB (2048 wide) the same in-row prefetch was level to 1.1x
 * slower than the row-start one above. */
#define AVX2_PREFETCH_IN_ROW 2048

/* bf16 x rows through the int8 terms: sums[r][j - n0] for weight rows j of [n0, n1), all activation rows. */
static void avx2_int8_rows(const tl_quant_type *t, const uint8_t *w, int64_t k, const avx2_act *a, int64_t n0,
                           int64_t n1, float *sums) {
    const int64_t row_bytes = k / t->block * t->block_size, span = n1 - n0;
    const int64_t ahead = row_bytes <= AVX2_PREFETCH_ROW_MAX ? (int64_t)tl_quant_prefetch_tiles * AVX2_PREFETCH_AHEAD
                                                              : 0;
    const int64_t in_row = row_bytes > AVX2_PREFETCH_ROW_MAX ? (int64_t)tl_quant_prefetch_tiles * AVX2_PREFETCH_IN_ROW
                                                             : 0;
    for (int64_t r0 = 0; r0 < a->m; r0 += AVX2_ACT_CHUNK) {
        const int64_t r1 = a->m - r0 < AVX2_ACT_CHUNK ? a->m : r0 + AVX2_ACT_CHUNK;
        for (int64_t j = n0; j < n1; ++j) {
            const uint8_t *row = w + j * row_bytes;
            if (ahead > 0 && r0 == 0) avx2_prefetch_bytes(row + ahead, row_bytes);
            for (int64_t r = r0; r < r1; r += 4) {
                float o[4] = {0.f, 0.f, 0.f, 0.f};
                const int rows = r1 - r < 4 ? (int)(r1 - r) : 4;
                const int64_t pf = r == 0 ? in_row : 0; /* the row's first pass streams it from memory */
#define AVX2_ROWS(T, DOT)                                                                                      \
    switch (rows) {                                                                                            \
    case 4: DOT(T, 4); break;                                                                                  \
    case 3: DOT(T, 3); break;                                                                                  \
    case 2: DOT(T, 2); break;                                                                                  \
    default: DOT(T, 1); break;                                                                                 \
    }
#define AVX2_LEGACY_DOT(T, MR) avx2_legacy_dot(T, row, k, a, r, MR, o, pf)
#define AVX2_Q4K_DOT(T, MR) avx2_q4k_dot(row, k, a, r, MR, o, pf)
/* Q5_K / Q6_K up to three rows in one pass, four as two passes of two (four rows' int16 sums per term spill;
 * against two rows at a time, three rows in one pass 0.85-0.92x the time, four as three and one 1.04-1.08x) */
#define AVX2_BYTE_ROWS(DOT, MR)                                                                                \
    if (MR == 4) {                                                                                             \
        DOT(row, k, a, r, 2, o, pf);                                                                           \
        DOT(row, k, a, r + 2, 2, o + 2, 0);                                                                    \
    } else                                                                                                     \
        DOT(row, k, a, r, MR, o, pf)
#define AVX2_Q5K_DOT(T, MR) AVX2_BYTE_ROWS(avx2_q5k_dot, MR)
#define AVX2_Q6_DOT(T, MR) AVX2_BYTE_ROWS(avx2_q6_dot, MR)
                switch (t->type) {
                case TL_Q4_0: AVX2_ROWS(TL_Q4_0, AVX2_LEGACY_DOT) break;
                case TL_Q4_1: AVX2_ROWS(TL_Q4_1, AVX2_LEGACY_DOT) break;
                case TL_Q8_0: AVX2_ROWS(TL_Q8_0, AVX2_LEGACY_DOT) break;
                case TL_Q5_0: AVX2_ROWS(TL_Q5_0, AVX2_LEGACY_DOT) break;
                case TL_Q5_1: AVX2_ROWS(TL_Q5_1, AVX2_LEGACY_DOT) break;
                case TL_Q4_K: AVX2_ROWS(TL_Q4_K, AVX2_Q4K_DOT) break;
                case TL_Q5_K: AVX2_ROWS(TL_Q5_K, AVX2_Q5K_DOT) break;
                default: AVX2_ROWS(TL_Q6_K, AVX2_Q6_DOT) break;
                }
#undef AVX2_LEGACY_DOT
#undef AVX2_Q4K_DOT
#undef AVX2_Q5K_DOT
#undef AVX2_BYTE_ROWS
#undef AVX2_Q6_DOT
#undef AVX2_ROWS
                for (int i = 0; i < rows; ++i) sums[(r + i) * span + (j - n0)] = o[i];
            }
        }
    }
}

/* out rows of weight rows n0 .. n0 + count - 1 from sums (row r, feature j at sums[r * rs + j * js]): plus the
 * bias, rounded once to bf16 or stored as float32. */
static void avx2_store(const float *sums, int64_t rs, int64_t js, int64_t m, int64_t n0, int64_t count,
                       const void *bias, int bias_is_f32, void *out, int64_t out_stride, int out_is_f32) {
    for (int64_t r = 0; r < m; ++r)
        for (int64_t j = 0; j < count; ++j) {
            float v = sums[r * rs + j * js];
            if (bias != NULL)
                v += bias_is_f32 ? ((const float *)bias)[n0 + j] : bf16_to_f32(((const uint16_t *)bias)[n0 + j]);
            if (out_is_f32)
                ((float *)out)[r * out_stride + n0 + j] = v;
            else
                ((uint16_t *)out)[r * out_stride + n0 + j] = f32_to_bf16(v);
        }
}

/* The sums of output features [n0, n1) for every activation row: sums[r * (n1 - n0) + j - n0]. */
typedef void (*avx2_rows_fn)(const void *work, int64_t n0, int64_t n1, float *sums);

/* out[m, n] from `rows`, run over chunks of AVX2_ROW_CHUNK output features split over the threads, each chunk's
 * sums stored at once (bias, output dtype): QUANT_OK or QUANT_E_MEMORY. */
static int avx2_by_chunks(avx2_rows_fn rows, const void *work, int64_t n, int64_t m, const void *bias,
                          int bias_is_f32, void *out, int64_t out_stride, int out_is_f32, int threads) {
    const int64_t chunks = (n + AVX2_ROW_CHUNK - 1) / AVX2_ROW_CHUNK;
    int failed = 0;
    _Pragma("omp parallel num_threads(threads)") {
        float local[AVX2_ACT_SPLIT * AVX2_ROW_CHUNK];
        const int own = m > AVX2_ACT_SPLIT; /* else the sums fit the stack */
        float *sums = own ? malloc(sizeof(float) * (size_t)(m * AVX2_ROW_CHUNK)) : local;
        if (sums == NULL) {
            _Pragma("omp atomic write") failed = 1;
        }
        _Pragma("omp for schedule(static)")
        for (int64_t c = 0; c < chunks; ++c) {
            if (sums == NULL) continue;
            const int64_t n0 = c * AVX2_ROW_CHUNK, n1 = n - n0 < AVX2_ROW_CHUNK ? n : n0 + AVX2_ROW_CHUNK;
            rows(work, n0, n1, sums);
            avx2_store(sums, n1 - n0, 1, m, n0, n1 - n0, bias, bias_is_f32, out, out_stride, out_is_f32);
        }
        if (own) free(sums);
    }
    return failed ? QUANT_E_MEMORY : QUANT_OK;
}

typedef struct {
    const tl_quant_type *t;
    const uint8_t *w;
    int64_t k;
    const avx2_act *a;
} avx2_int8_work;

static void avx2_int8_chunk(const void *work, int64_t n0, int64_t n1, float *sums) {
    const avx2_int8_work *p = work;
    avx2_int8_rows(p->t, p->w, p->k, p->a, n0, n1, sums);
}

/* quant_linear's int8 work on this family (quant_path 1: bf16 x; float32 x where x_is_f32, quant_moe.c's few
 * rows between the projections; arguments already checked). */
static int avx2_linear(const tl_quant_type *t, const uint8_t *w, int64_t n, int64_t k, const void *x,
                       int64_t x_stride, int x_is_f32, int64_t m, const void *bias, int bias_is_f32, void *out,
                       int64_t out_stride, int out_is_f32, int threads) {
    const int64_t nb = k / TL_QK;
    const int terms = quant_act_residual_on ? 2 : 1;
    /* one allocation: dc and xs (floats), Q6_K's per-16 sums, the int16 quants, then the K types' int8 terms */
    const int64_t n16 = t->type == TL_Q6_K ? m * k / 16 : 0, n8 = avx2_k_group(t->type) == 4 ? 2 * m * k : 0;
    float *dc = malloc(sizeof(float) * (size_t)(2 * m * nb) + sizeof(int32_t) * (size_t)n16 +
                       sizeof(int16_t) * (size_t)(m * k) + (size_t)n8);
    if (dc == NULL) return QUANT_E_MEMORY;
    int32_t *s16 = (int32_t *)(dc + 2 * m * nb);
    int16_t *q = (int16_t *)(s16 + n16);
    int8_t *q8 = (int8_t *)(q + m * k);
    if (m < AVX2_ACT_SPLIT || threads < 2) { /* decode rows: no thread team for so little */
        avx2_quantize_rows(x, x_stride, x_is_f32, k, terms, q, dc, dc + m * nb, 0, m);
        for (int64_t r = 0; r < m; ++r) avx2_lanes_act(t->type, q + r * k, k, s16 + r * (k / 16), q8 + 2 * r * k);
    } else {
        _Pragma("omp parallel for schedule(static) num_threads(threads)")
        for (int64_t r = 0; r < m; ++r) {
            avx2_quantize_rows(x, x_stride, x_is_f32, k, terms, q, dc, dc + m * nb, r, r + 1);
            avx2_lanes_act(t->type, q + r * k, k, s16 + r * (k / 16), q8 + 2 * r * k);
        }
    }
    const avx2_act a = {q, dc, dc + m * nb, s16, q8, m, k};
    const avx2_int8_work work = {t, w, k, &a};
    const int rc = avx2_by_chunks(avx2_int8_chunk, &work, n, m, bias, bias_is_f32, out, out_stride, out_is_f32,
                                  threads);
    free(dc);
    return rc;
}
#pragma GCC pop_options
#else
#define HAVE_QUANT_AVX2 0
#endif
