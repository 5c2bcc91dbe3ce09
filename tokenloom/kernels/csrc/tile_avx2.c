/*
 * Float32 register tiles for x86 CPUs with AVX2 and FMA but without the AVX-512 families (built with
 * quant_avx2.c): the many-row matmul of the GGUF-quantized weights (quant_linear's quant_path 0) and the bf16
 * matmul of unquantized weights (avx2_bf16_linear), where torch's bf16 matmul has no fast kernel (oneDNN's
 * bf16 needs AVX-512: 15-21 GFLOP/s on Zen 3 against 120-140 for its float32 matmul).
 *
 * Weights are widened exactly to float32 (a GGUF row dequantized, a bf16 row shifted), products are exact and
 * sums float32, one accumulator lane per output summed along k in order: a row's result depends neither on
 * the rows beside it nor on the thread count, and |err| <= k 2^-24 sum_i |w_i x_i| (a bf16 output adds its
 * one rounding).
 *
 * Included by quant_gemm.c after quant_avx2.c (its dequantize, store and knobs).
 */
#if HAVE_QUANT_AVX2
#pragma GCC push_options
#pragma GCC optimize("no-associative-math")

#define AVX2_BF16_TILE_M 8 /* bf16-weight rows from which the tile replaces the stream (avx2_bf16_tile_m) */

/* k bf16 values (k % 8 == 0) widened to float32 (exact). */
static inline void avx2_bf16_row(const uint16_t *src, int64_t k, float *dst) {
    for (int64_t i = 0; i < k; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                                      _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i))), 16)));
}

/* The dequantized tile (quant_path 0: float32 x, and bf16 x from quant_tile_m rows): x converted to float32 (exact)
 * and transposed once per call into groups of 8 rows, xt[(g * k + i) * 8 + l] = x[8 g + l][i] (rows past m
 * zero); per work item AVX2_TILE_ROWS weight rows dequantized exactly into a row-major float32 scratch; then
 * register tiles of 4 weight rows x 24 activation rows (12 accumulators) run float32 FMAs along k, each weight
 * value broadcast and each 8 rows of x one vector. Each output is one accumulator lane summed along k in order,
 * so a row's result depends neither on the rows beside it nor on the thread count; the error is float32
 * summation's, |err| <= k 2^-24 sum_i |w_i x_i| (and a bf16 output's rounding). */
#define AVX2_TILE_ROWS 32 /* weight rows per work item (dequantized once, met by every activation row) */
#define AVX2_TILE_KC 128  /* columns per chunk: a chunk of the item's weights and of 24 activation rows fit L1 */

/* Rows 8g .. 8g + 7 of x transposed into xt's group g (8 x 8 blocks transposed in registers). */
static void avx2_pack_group(const void *x, int64_t x_stride, int x_is_f32, int64_t m, int64_t k, int64_t g,
                            float *xt) {
    for (int64_t i0 = 0; i0 < k; i0 += 8) {
        __m256 r[8];
        for (int l = 0; l < 8; ++l) {
            const int64_t row = 8 * g + l;
            if (row >= m)
                r[l] = _mm256_setzero_ps();
            else if (x_is_f32)
                r[l] = _mm256_loadu_ps((const float *)x + row * x_stride + i0);
            else
                r[l] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(
                                               (const __m128i *)((const uint16_t *)x + row * x_stride + i0))), 16));
        }
        __m256 t[8], u[8];
        for (int p = 0; p < 4; ++p) {
            t[2 * p] = _mm256_unpacklo_ps(r[2 * p], r[2 * p + 1]);
            t[2 * p + 1] = _mm256_unpackhi_ps(r[2 * p], r[2 * p + 1]);
        }
        for (int h = 0; h < 2; ++h) { /* rows 4h .. 4h + 3: columns 0-1 / 2-3 of each 128-bit half */
            u[4 * h] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
            u[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xEE);
            u[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
            u[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
        }
        float *dst = xt + (g * k + i0) * 8;
        for (int c = 0; c < 4; ++c) {
            _mm256_storeu_ps(dst + 8 * c, _mm256_permute2f128_ps(u[c], u[4 + c], 0x20));
            _mm256_storeu_ps(dst + 8 * (c + 4), _mm256_permute2f128_ps(u[c], u[4 + c], 0x31));
        }
    }
}

/* Weight rows w + j k, j < J (float32), at columns 0 .. len - 1 against V groups of xt from xt0 (the same
 * columns; J V <= 12 accumulators, at least 8 to cover the FMA latency): the J x 8V sums, continued from
 * sums_t where `more` (a later column chunk; float32 there and back is exact, so the order of each sum is
 * unchanged), stored as sums_t[j * ld + 8 v + l] (weight row j, activation row 8 v + l of the groups). */
static inline __attribute__((always_inline)) void avx2_tile_micro(const float *w, const float *xt0, int64_t k,
                                                                   int64_t len, const int J, const int V, int more,
                                                                   float *sums_t, int64_t ld) {
    __m256 acc[8][3];
    for (int j = 0; j < J; ++j)
        for (int v = 0; v < 3; ++v)
            acc[j][v] = more && v < V ? _mm256_loadu_ps(sums_t + j * ld + 8 * v) : _mm256_setzero_ps();
    const float *x1 = xt0 + 8 * k, *x2 = xt0 + 16 * k;
    for (int64_t i = 0; i < len; ++i) {
        __m256 a0 = _mm256_loadu_ps(xt0 + 8 * i);
        __m256 a1 = V > 1 ? _mm256_loadu_ps(x1 + 8 * i) : a0, a2 = V > 2 ? _mm256_loadu_ps(x2 + 8 * i) : a0;
        /* in registers: left to itself gcc folds each load into every FMA that reads it (J loads of each
         * vector instead of one), and the loads, not the FMAs, then bound the loop */
        __asm__("" : "+x"(a0), "+x"(a1), "+x"(a2));
        for (int j = 0; j < J; ++j) {
            const __m256 b = _mm256_broadcast_ss(w + j * k + i);
            acc[j][0] = _mm256_fmadd_ps(b, a0, acc[j][0]);
            if (V > 1) acc[j][1] = _mm256_fmadd_ps(b, a1, acc[j][1]);
            if (V > 2) acc[j][2] = _mm256_fmadd_ps(b, a2, acc[j][2]);
        }
    }
    for (int j = 0; j < J; ++j)
        for (int v = 0; v < V; ++v) _mm256_storeu_ps(sums_t + j * ld + 8 * v, acc[j][v]);
}

/* The item's `rows` dequantized weight rows (wbuf, a multiple of 8) against xt's groups g .. g + V - 1, column
 * chunk by column chunk (each chunk's weights and activations stay in L1 across the item's register tiles of
 * 4 weight rows, 8 with one group). */
static inline __attribute__((always_inline)) void avx2_tile_groups(const float *wbuf, int64_t rows, const float *xt,
                                                                    int64_t k, int64_t g, const int V,
                                                                    float *sums_t, int64_t m_pad) {
    const int J = V == 1 ? 8 : 4;
    for (int64_t c0 = 0; c0 < k; c0 += AVX2_TILE_KC) {
        const int64_t len = k - c0 < AVX2_TILE_KC ? k - c0 : AVX2_TILE_KC;
        for (int64_t j = 0; j < rows; j += J)
            avx2_tile_micro(wbuf + j * k + c0, xt + (g * k + c0) * 8, k, len, J, V, c0 > 0,
                            sums_t + j * m_pad + 8 * g, m_pad);
    }
}

/* quant_linear's dequantized-tile work on this family, or (t NULL) avx2_bf16_linear's from its tile rows on
 * (arguments already checked). */
static int avx2_tile_linear(const tl_quant_type *t, const uint8_t *w, int64_t n, int64_t k, const void *x,
                            int64_t x_stride, int x_is_f32, int64_t m, const void *bias, int bias_is_f32, void *out,
                            int64_t out_stride, int out_is_f32, int threads) {
    const int64_t groups = (m + 7) / 8, m_pad = 8 * groups, items = (n + AVX2_TILE_ROWS - 1) / AVX2_TILE_ROWS;
    const int span = t != NULL ? avx2_k_span(t->type) : 0; /* quantized: weights and x both in lane order */
    float *xt = malloc(sizeof(float) * (size_t)(m_pad * k));
    if (xt == NULL) return QUANT_E_MEMORY;
    int failed = 0;
    _Pragma("omp parallel num_threads(threads)") {
        /* per thread: the item's dequantized rows (rounded up to whole 8-row tiles), then their [rows, m_pad] sums */
        float *wbuf = malloc(sizeof(float) * (size_t)(AVX2_TILE_ROWS * (k + m_pad)));
        float *sums_t = wbuf == NULL ? NULL : wbuf + AVX2_TILE_ROWS * k;
        if (wbuf == NULL) {
            _Pragma("omp atomic write") failed = 1;
        }
        _Pragma("omp for schedule(static)")
        for (int64_t g = 0; g < groups; ++g) {
            if (span == 0) {
                avx2_pack_group(x, x_stride, x_is_f32, m, k, g, xt);
            } else if (wbuf != NULL) { /* the rows into lane order first (wbuf is free until the items) */
                for (int l = 0; l < 8; ++l) {
                    const int64_t r = 8 * g + l;
                    float *natural = wbuf + 8 * k, *dst = wbuf + l * k;
                    if (r >= m)
                        memset(dst, 0, sizeof(float) * (size_t)k);
                    else if (x_is_f32)
                        avx2_lanes_f32((const float *)x + r * x_stride, dst, k, t->type);
                    else {
                        avx2_bf16_row((const uint16_t *)x + r * x_stride, k, natural);
                        avx2_lanes_f32(natural, dst, k, t->type);
                    }
                }
                avx2_pack_group(wbuf, k, 1, 8, k, 0, xt + g * k * 8);
            }
        }
        _Pragma("omp for schedule(static)")
        for (int64_t item = 0; item < items; ++item) {
            if (wbuf == NULL) continue;
            const int64_t n0 = item * AVX2_TILE_ROWS, count = n - n0 < AVX2_TILE_ROWS ? n - n0 : AVX2_TILE_ROWS;
            const int64_t rows8 = (count + 7) / 8 * 8;
            for (int64_t j = 0; j < count; ++j) {
                const uint8_t *row = t == NULL ? NULL : w + (n0 + j) * (k / t->block * t->block_size);
                if (t != NULL && t->block == 256)
                    avx2_k_dequant_lanes(t->type, row, k, wbuf + j * k);
                else if (t != NULL)
                    avx2_legacy_dequant_lanes(t->type, row, k, wbuf + j * k);
                else
                    avx2_bf16_row((const uint16_t *)w + (n0 + j) * k, k, wbuf + j * k);
            }
            memset(wbuf + count * k, 0, sizeof(float) * (size_t)((rows8 - count) * k));
            int64_t g = 0;
            for (; g + 3 <= groups; g += 3) avx2_tile_groups(wbuf, rows8, xt, k, g, 3, sums_t, m_pad);
            if (groups - g == 2)
                avx2_tile_groups(wbuf, rows8, xt, k, g, 2, sums_t, m_pad);
            else if (groups - g == 1)
                avx2_tile_groups(wbuf, rows8, xt, k, g, 1, sums_t, m_pad);
            avx2_store(sums_t, 1, m_pad, m, n0, count, bias, bias_is_f32, out, out_stride, out_is_f32);
        }
        free(wbuf);
    }
    free(xt);
    return failed ? QUANT_E_MEMORY : QUANT_OK;
}


/* out[i * out_step] = bf16 weight row wr . float32 activation row x + i k, i < R: 8 columns widened at a time,
 * two accumulators a row (even and odd 8-column steps) joined at the end: one order whatever R. */
static inline __attribute__((always_inline)) void avx2_bf16_dot(const uint16_t *wr, int64_t k, const float *x,
                                                                 const int R, float *out, int64_t out_step) {
    __m256 acc[4][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        const __m256 w0 = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(wr + i))), 16));
        const __m256 w1 = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(wr + i + 8))), 16));
        for (int r = 0; r < R; ++r) {
            acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * k + i), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * k + i + 8), acc[r][1]);
        }
    }
    if (i < k) { /* k % 16 == 8 */
        const __m256 w0 = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(wr + i))), 16));
        for (int r = 0; r < R; ++r) acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * k + i), acc[r][0]);
    }
    for (int r = 0; r < R; ++r) out[r * out_step] = avx2_hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}

/* bf16 weight rows [n0, n1) against the float32 activation rows xf [m, k]: sums[r * (n1 - n0) + j - n0]. */
static void avx2_bf16_stream(const uint16_t *w, int64_t k, const float *xf, int64_t m, int64_t n0, int64_t n1,
                             float *sums) {
    const int64_t span = n1 - n0;
    for (int64_t j = n0; j < n1; ++j)
        for (int64_t r = 0; r < m; r += 4) {
            const float *x = xf + r * k;
            float *o = sums + r * span + (j - n0);
            switch (m - r < 4 ? m - r : 4) {
            case 4: avx2_bf16_dot(w + j * k, k, x, 4, o, span); break;
            case 3: avx2_bf16_dot(w + j * k, k, x, 3, o, span); break;
            case 2: avx2_bf16_dot(w + j * k, k, x, 2, o, span); break;
            default: avx2_bf16_dot(w + j * k, k, x, 1, o, span); break;
            }
        }
}
typedef struct {
    const uint16_t *w;
    int64_t k;
    const float *xf;
    int64_t m;
} avx2_bf16_work;

static void avx2_bf16_chunk(const void *work, int64_t n0, int64_t n1, float *sums) {
    const avx2_bf16_work *p = work;
    avx2_bf16_stream(p->w, p->k, p->xf, p->m, n0, n1, sums);
}
#pragma GCC pop_options
#endif

/* Rows from which avx2_bf16_linear takes the tile instead of the stream: read (value < 0) or set it. */
static int avx2_bf16_tile_rows = -1;
KERNEL_API int avx2_bf16_tile_m(int value) {
    if (value >= 0)
        avx2_bf16_tile_rows = value;
    else if (avx2_bf16_tile_rows < 0)
#if HAVE_QUANT_AVX2
        avx2_bf16_tile_rows = AVX2_BF16_TILE_M;
#else
        avx2_bf16_tile_rows = 0;
#endif
    return avx2_bf16_tile_rows;
}

/* out[m, n] (row stride out_stride; bf16, or float32 where out_is_f32) = x[m, k] (bf16, row stride x_stride) .
 * W^T (+ bias[n], bf16 or float32, or NULL), W [n, k] bf16 row-major, k % 8 == 0: the float32 tile from
 * avx2_bf16_tile_m rows, else a stream over W (each weight row widened 8 columns at a time into up to four
 * activation rows, widened once per call). 0, a negative QUANT_E* code, QUANT_E_TYPE where this family is not
 * built (the caller keeps torch's matmul). */
KERNEL_API int avx2_bf16_linear(const uint16_t *x, int64_t x_stride, const uint16_t *w, int64_t n, int64_t k,
                                const void *bias, int bias_is_f32, void *out, int64_t out_stride, int out_is_f32,
                                int64_t m, int threads) {
#if HAVE_QUANT_AVX2
    if (n < 0 || k <= 0 || k % 8 || m < 0 || x_stride < k || out_stride < n) return QUANT_E_SHAPE;
    if (m == 0 || n == 0) return QUANT_OK;
    const int tile_from = avx2_bf16_tile_m(-1);
    if (tile_from > 0 && m >= tile_from)
        return avx2_tile_linear(NULL, (const uint8_t *)w, n, k, x, x_stride, 0, m, bias, bias_is_f32, out,
                                out_stride, out_is_f32, threads);
    float *xf = malloc(sizeof(float) * (size_t)(m * k));
    if (xf == NULL) return QUANT_E_MEMORY;
    for (int64_t r = 0; r < m; ++r) avx2_bf16_row(x + r * x_stride, k, xf + r * k);
    const avx2_bf16_work work = {w, k, xf, m};
    const int rc = avx2_by_chunks(avx2_bf16_chunk, &work, n, m, bias, bias_is_f32, out, out_stride, out_is_f32,
                                  threads);
    free(xf);
    return rc;
#else
    (void)x; (void)x_stride; (void)w; (void)n; (void)k; (void)bias; (void)bias_is_f32; (void)out;
    (void)out_stride; (void)out_is_f32; (void)m; (void)threads;
    return QUANT_E_TYPE;
#endif
}
