/*
 * The one-term int8 tile of the AVX2 family (quant_path 3), opt-in: bf16 x from quant_i8_tile_m rows on against
 * Q4_0, Q4_1, Q4_K and Q5_K weights, by vpmaddubsw (32 unsigned-quant by int8 products an instruction) instead of
 * the float32 tile's FMAs (8 an instruction). Without VNNI this is AVX2's densest multiply: a quant (0..31) times
 * an activation (-127..127) summed in pairs stays exact in int16, and the pair sums of up to 8 (Q4) or 4 (Q5_K)
 * vectors add up in int16 below 32768 before one vpmaddwd widens them.
 *
 * Activations: each row quantized once per call per 32-element block to one int8 term (d = max|x| / 127, q =
 * round(x / d): llama.cpp's Q8 activations), so |err| <= sum_i |w_i| d(i) / 2, the order of the bf16 rounding x
 * already carries at the block's largest element. Weights: per work item of AVX2_TILE_ROWS rows, their quants
 * unpacked once from the lane order (kquant_avx2.c, legacy_avx2.c) into bytes, 8 lanes a vector with lane j
 * holding 4 consecutive elements of block j, and per span of 8 blocks a vector of 8 scales and one of 8 offsets
 * (Q4_0's -8 d, Q4_1's m, the K types' -dmin m); rows of whole spans only (k % 256 == 0: a legacy row's tail
 * of nb % 8 blocks keeps the float32 tile, where a tail span of its own measured slower). The activation rows are
 * put into the same order (an 8 x 8 transpose of 4-byte quads per span), with per span a vector of their block
 * scales and one of their block sums (d sum q). A register tile of AVX2_I8_R activation rows x one weight row
 * keeps one accumulator a pair, lane j its sum over block j: per span (Q5_K: per half) one vpmaddwd, one
 * conversion and one multiply-add by the weight and activation scales, the offsets one more, the 8 lanes
 * summed at the end. Every output's sums follow one order whatever the rows beside it and the thread count.
 * Zen 3, two threads, against the float32 tile (bench/quant_gemm.py --i8-tile-ab): Q4_0 / Q4_1 / Q4_K 1.6-2.2x
 * at 32-256 rows on 1B shapes and SmolLM2's 576x1536, Q5_K 1.3-1.5x; Q6_K (16-element scales, int16 sums of two
 * vectors) measured 0.9-1.2x and Q8_0 (signed quants) is not taken: both stay on the float32 tile.
 *
 * Included by quant_gemm.c after tile_avx2.c.
 */
#if HAVE_QUANT_AVX2

/* Off by default (quant_i8_tile_m 0; TOKENLOOM_QUANT_I8_TILE_M=32 turns it on): the one int8 term adds ~1% relative
 * noise to each activation row (bf16 alone 0.2%), which on the default SmolLM2-135M Q4_1 file moved perplexity
 * against the file in float32 from +0.08% to +0.13% and greedy agreement from 0.84 to 0.72, and turned its answer
 * to "What is the capital of France?" from Paris to something else: too high a price for a default. */
#define AVX2_I8_TILE_M 0
#define AVX2_I8_R 5       /* activation rows of a register tile */
#define AVX2_I8_J 1       /* weight rows of a register tile */
#define AVX2_I8_KC 2048   /* elements of a chunk of the activation rows (in L1 while an item's rows pass) */

/* Q8_0's signed quants would need their signs moved onto the activations; Q6_K's 16-element scales and int16
 * sums of two vectors left this tile level with the float32 one (0.9-1.2x); Q5_0 / Q5_1 are not unpacked here. */
static inline int avx2_i8_supported(int type, int64_t k) {
    return type != TL_Q8_0 && type != TL_Q6_K && type != TL_Q5_0 && type != TL_Q5_1 && k % 256 == 0;
}

/* 16 bytes of Q4 nibbles (a legacy or Q4_K chunk c: low nibbles lane-order vector 2c, high ones 2c + 1) as one
 * byte vector whose int32 lane j holds elements 4c .. 4c + 3 of block j. */
static inline __m256i avx2_i8_nibble_chunk(const uint8_t *p) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p), m4 = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
    return _mm256_set_m128i(_mm_unpackhi_epi16(lo, hi), _mm_unpacklo_epi16(lo, hi));
}

/* Weight row `row` (k columns, re-laid out) unpacked: per span of 256 elements 8 vectors of 32 bytes at u, and 8
 * scales then 8 offsets at sc. */
static void avx2_i8_unpack_row(int type, const uint8_t *row, int64_t k, uint8_t *u, float *sc) {
    if (type == TL_Q4_K || type == TL_Q5_K) {
        const int bytes = type == TL_Q4_K ? AVX2_Q4K_BYTES : AVX2_Q5K_BYTES;
        for (int64_t s = 0; s < k / 256; ++s) {
            const uint8_t *blk = row + s * bytes;
            __m256 dw, dm;
            avx2_k4_scale_min(blk, &dw, &dm);
            _mm256_storeu_ps(sc + 16 * s, dw);
            _mm256_storeu_ps(sc + 16 * s + 8, _mm256_sub_ps(_mm256_setzero_ps(), dm));
            uint8_t *dst = u + s * 256;
            if (type == TL_Q4_K) {
                for (int c = 0; c < 8; ++c)
                    _mm256_storeu_si256((__m256i *)(dst + 32 * c), avx2_i8_nibble_chunk(blk + AVX2_K4_QUANTS + 16 * c));
            } else {
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + AVX2_K4_QUANTS));
                for (int c = 0; c < 4; ++c) {
                    __m256i w0, w1;
                    avx2_q5_vectors(blk, c, qh, &w0, &w1);
                    _mm256_storeu_si256((__m256i *)(dst + 64 * c), w0);
                    _mm256_storeu_si256((__m256i *)(dst + 64 * c + 32), w1);
                }
            }
        }
        return;
    }
    const int bs = avx2_legacy_bytes(type); /* Q4_0, Q4_1: whole spans of 8 blocks (k % 256 == 0) */
    for (int64_t s = 0; s < k / 256; ++s) {
        const uint8_t *span = row + s * 8 * bs, *scales = span + 128;
        for (int c = 0; c < 8; ++c)
            _mm256_storeu_si256((__m256i *)(u + s * 256 + 32 * c), avx2_i8_nibble_chunk(span + 16 * c));
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)scales));
        _mm256_storeu_ps(sc + 16 * s, d);
        const __m256 offset = type == TL_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 16)))
                                              : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
        _mm256_storeu_ps(sc + 16 * s + 8, offset);
    }
}

/* Activation row q (k one-term int16 quants, file order; per 32-block scale dc and sum xs = d sum q) put into
 * the weights' order: per span its 8 x 8 quads transposed (vector t, lane j: quad t of block j) at a, its 8 block
 * scales then 8 block sums at sc. */
static void avx2_i8_act_row(const int16_t *q, const float *dc, const float *xs, int64_t k, int8_t *a, float *sc) {
    for (int64_t s = 0; s < k / 256; ++s) {
        __m256 r[8], t[8], v[8];
        for (int j = 0; j < 8; ++j) { /* block j's 32 quants as bytes, in order */
            const __m256i lo = _mm256_loadu_si256((const __m256i *)(q + 256 * s + 32 * j));
            const __m256i hi = _mm256_loadu_si256((const __m256i *)(q + 256 * s + 32 * j + 16));
            r[j] = _mm256_castsi256_ps(_mm256_permute4x64_epi64(_mm256_packs_epi16(lo, hi), 0xD8));
        }
        for (int p = 0; p < 4; ++p) {
            t[2 * p] = _mm256_unpacklo_ps(r[2 * p], r[2 * p + 1]);
            t[2 * p + 1] = _mm256_unpackhi_ps(r[2 * p], r[2 * p + 1]);
        }
        for (int h = 0; h < 2; ++h) {
            v[4 * h] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
            v[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xEE);
            v[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
            v[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
        }
        for (int c = 0; c < 4; ++c) {
            _mm256_storeu_ps((float *)(a + 256 * s + 32 * c), _mm256_permute2f128_ps(v[c], v[4 + c], 0x20));
            _mm256_storeu_ps((float *)(a + 256 * s + 32 * (c + 4)), _mm256_permute2f128_ps(v[c], v[4 + c], 0x31));
        }
        _mm256_storeu_ps(sc + 16 * s, _mm256_loadu_ps(dc + 8 * s));
        _mm256_storeu_ps(sc + 16 * s + 8, _mm256_loadu_ps(xs + 8 * s));
    }
}

/* The R x J register tile: activation rows a + r as (bytes; scales at asc + r ascs) against unpacked weight
 * rows u + j us (scales at wsc + j wscs) over spans s0 .. s1 - 1 of V vectors;
 * acc_f[(r * J + j) * 8 ..] the pair's per-lane sums, continued and stored back. */
static inline __attribute__((always_inline)) void avx2_i8_micro(const uint8_t *u, int64_t us, const float *wsc,
                                                                 int64_t wscs, const int8_t *a, int64_t as,
                                                                 const float *asc, int64_t ascs, int64_t s0,
                                                                 int64_t s1, const int V, const int DEPTH, const int R,
                                                                 const int J, float *acc_f) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 f[AVX2_I8_R][AVX2_I8_J];
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < J; ++j) f[r][j] = _mm256_loadu_ps(acc_f + 8 * (r * J + j));
    for (int64_t s = s0; s < s1; ++s) {
        const int64_t at = s * V * 32;
        for (int g = 0; g < V; g += DEPTH) {
            __m256i acc[AVX2_I8_R][AVX2_I8_J];
            for (int r = 0; r < R; ++r)
                for (int j = 0; j < J; ++j) acc[r][j] = _mm256_setzero_si256();
            _Pragma("GCC unroll 1") /* unrolled, gcc hoists every product ahead of the sums and spills them */
            for (int t = g; t < g + DEPTH; ++t) {
                __m256i wv[AVX2_I8_J];
                for (int j = 0; j < J; ++j)
                    wv[j] = _mm256_loadu_si256((const __m256i *)(u + j * us + at + 32 * t));
                for (int r = 0; r < R; ++r) {
                    const __m256i av = _mm256_loadu_si256((const __m256i *)(a + r * as + at + 32 * t));
                    for (int j = 0; j < J; ++j)
                        acc[r][j] = _mm256_add_epi16(acc[r][j], _mm256_maddubs_epi16(wv[j], av));
                }
            }
            for (int r = 0; r < R; ++r) {
                const __m256 ad = _mm256_loadu_ps(asc + r * ascs + 16 * s);
                for (int j = 0; j < J; ++j) {
                    const __m256 step = _mm256_mul_ps(_mm256_loadu_ps(wsc + j * wscs + 16 * s), ad);
                    f[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(acc[r][j], ones)), step, f[r][j]);
                }
            }
        }
        for (int r = 0; r < R; ++r) {
            const __m256 sums = _mm256_loadu_ps(asc + r * ascs + 16 * s + 8);
            for (int j = 0; j < J; ++j)
                f[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(wsc + j * wscs + 16 * s + 8), sums, f[r][j]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < J; ++j) _mm256_storeu_ps(acc_f + 8 * (r * J + j), f[r][j]);
}

/* An item's `rows` unpacked weight rows (a multiple of AVX2_I8_J) against the activation rows, m_pad of them (a
 * multiple of AVX2_I8_R), AVX2_I8_R at a time over chunks of AVX2_I8_KC elements (a chunk of the R rows stays
 * in L1 while the item's rows pass): sums_t[r * AVX2_TILE_ROWS + j]. */
static inline __attribute__((always_inline)) void avx2_i8_item(const uint8_t *u, const float *wsc, int64_t rows,
                                                                const int8_t *a, const float *asc, int64_t m_pad,
                                                                int64_t kp, int64_t spans, const int V, const int DEPTH,
                                                                float *sums_t) {
    const int64_t chunk = AVX2_I8_KC / (V * 32);
    float acc_f[AVX2_TILE_ROWS * AVX2_I8_R * 8];
    for (int64_t r = 0; r < m_pad; r += AVX2_I8_R) {
        memset(acc_f, 0, sizeof(float) * (size_t)(rows * AVX2_I8_R * 8));
        for (int64_t s0 = 0; s0 < spans; s0 += chunk) {
            const int64_t s1 = s0 + chunk < spans ? s0 + chunk : spans;
            for (int64_t j = 0; j < rows; j += AVX2_I8_J)
                avx2_i8_micro(u + j * kp, kp, wsc + j * spans * 16, spans * 16, a + r * kp, kp, asc + r * spans * 16,
                              spans * 16, s0, s1, V, DEPTH, AVX2_I8_R, AVX2_I8_J, acc_f + j * AVX2_I8_R * 8);
        }
        for (int64_t j = 0; j < rows; j += AVX2_I8_J)
            for (int rr = 0; rr < AVX2_I8_R; ++rr)
                for (int jj = 0; jj < AVX2_I8_J; ++jj)
                    sums_t[(r + rr) * AVX2_TILE_ROWS + j + jj] =
                        avx2_hsum(_mm256_loadu_ps(acc_f + j * AVX2_I8_R * 8 + 8 * (rr * AVX2_I8_J + jj)));
    }
}

/* quant_linear's one-term int8 tile (arguments already checked; bf16 x; a type avx2_i8_supported takes). */
static int avx2_i8_tile_linear(const tl_quant_type *t, const uint8_t *w, int64_t n, int64_t k, const uint16_t *x,
                               int64_t x_stride, int64_t m, const void *bias, int bias_is_f32, void *out,
                               int64_t out_stride, int out_is_f32, int threads) {
    const int type = t->type;
    const int64_t spans = k / 256, kp = k, nb = k / TL_QK;
    const int64_t m_pad = (m + AVX2_I8_R - 1) / AVX2_I8_R * AVX2_I8_R;
    const int64_t items = (n + AVX2_TILE_ROWS - 1) / AVX2_TILE_ROWS, row_bytes = k / t->block * t->block_size;
    int16_t *q = malloc(sizeof(int16_t) * (size_t)(m * k));
    float *dc = malloc(sizeof(float) * (size_t)(2 * m * nb));
    int8_t *a = malloc((size_t)(m_pad * kp));
    float *asc = malloc(sizeof(float) * (size_t)(m_pad * spans * 16));
    if (q == NULL || dc == NULL || a == NULL || asc == NULL) {
        free(q); free(dc); free(a); free(asc);
        return QUANT_E_MEMORY;
    }
    int failed = 0;
    _Pragma("omp parallel num_threads(threads)") {
        _Pragma("omp for schedule(static)")
        for (int64_t r = 0; r < m_pad; ++r) {
            if (r < m) {
                avx2_quantize_rows(x, x_stride, 0, k, 1, q, dc, dc + m * nb, r, r + 1);
                avx2_i8_act_row(q + r * k, dc + r * nb, dc + m * nb + r * nb, k, a + r * kp, asc + r * spans * 16);
            } else {
                memset(a + r * kp, 0, (size_t)kp);
                memset(asc + r * spans * 16, 0, sizeof(float) * (size_t)(spans * 16));
            }
        }
        uint8_t *u = malloc((size_t)(AVX2_TILE_ROWS * kp));
        float *wsc = malloc(sizeof(float) * (size_t)(AVX2_TILE_ROWS * (spans * 16 + m_pad)));
        if (u == NULL || wsc == NULL) {
            _Pragma("omp atomic write") failed = 1;
        }
        float *sums_t = wsc == NULL ? NULL : wsc + AVX2_TILE_ROWS * spans * 16;
        _Pragma("omp for schedule(static)")
        for (int64_t item = 0; item < items; ++item) {
            if (u == NULL || wsc == NULL) continue;
            const int64_t n0 = item * AVX2_TILE_ROWS, count = n - n0 < AVX2_TILE_ROWS ? n - n0 : AVX2_TILE_ROWS;
            const int64_t rows = (count + AVX2_I8_J - 1) / AVX2_I8_J * AVX2_I8_J;
            for (int64_t j = 0; j < count; ++j)
                avx2_i8_unpack_row(type, w + (n0 + j) * row_bytes, k, u + j * kp, wsc + j * spans * 16);
            for (int64_t j = count; j < rows; ++j) {
                memset(u + j * kp, 0, (size_t)kp);
                memset(wsc + j * spans * 16, 0, sizeof(float) * (size_t)(spans * 16));
            }
            if (type == TL_Q5_K) /* its quants up to 31: the int16 sums hold four vectors */
                avx2_i8_item(u, wsc, rows, a, asc, m_pad, kp, spans, 8, 4, sums_t);
            else
                avx2_i8_item(u, wsc, rows, a, asc, m_pad, kp, spans, 8, 8, sums_t);
            avx2_store(sums_t, AVX2_TILE_ROWS, 1, m, n0, count, bias, bias_is_f32, out, out_stride, out_is_f32);
        }
        free(u);
        free(wsc);
    }
    free(q); free(dc); free(a); free(asc);
    return failed ? QUANT_E_MEMORY : QUANT_OK;
}
#endif
