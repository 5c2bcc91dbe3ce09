/*
 * Paged extend (prefill) attention for the CPU: each request's new tokens attend, causally, to its cached
 * prefix and to each other, reading K/V from the paged KV pool through indptr/indices (no padded copy, no
 * mask tensor).
 *
 * Layout: q/out [T, Hq, D], the new tokens of all requests back to back (request b's q_len[b] tokens start at
 * row q_start[b]; a token's heads contiguous, q_stride elements between tokens, out dense); k/v pool
 * [Hkv, rows, D]; request b's slots in position order are indices[indptr[b] .. indptr[b+1]): its prefix, then
 * its new tokens (already stored by the caller). New token i of request b sits at position prefix_b + i
 * (prefix_b = its slot count - q_len[b]) and sees the keys at positions <= its own.
 *
 * Work: the K rows of every (request, kv head) are first copied (16 x 16 transposes) into blocks of 16 keys
 * laid out by dim pair (one 64-byte vector holds one dim pair of 16 keys), so that a broadcast query dim pair
 * times one vector adds to 16 scores at once (vdpbf16ps: products exact, sums in float32) with no horizontal
 * sums. Work items are
 * (request, kv head, tile of up to EXT_TILE new tokens), latest tiles (most keys) first; a tile's query rows
 * are its tokens x the kv head's query heads. Keys are taken EXT_CHUNK at a time with an online softmax (a
 * running max and sum per row; the weighted sum of V is rescaled when the max grows), so a tile's scratch
 * does not grow with the context. V is packed once per (request, kv head) too, in pairs of keys word by word,
 * and the probabilities are rounded to bf16 before the weighted sum of V (as the decode kernel does), one
 * vdpbf16ps adding two keys' share to 16 dims.
 * A request with one new token (an extend step's decoding rows, a jump-forward's last token) packs nothing:
 * its rows read the pool in place through the decode kernel's path (attend_range_bf16).
 * Soft-cap (Gemma 2, logit_cap > 0): each scaled score s becomes cap * tanh(s / cap) before the softmax.
 *
 * Two arithmetic paths, chosen once per process by the cost of a vdpbf16ps against a vpdpbusd
 * (quant_bf16_dot_cost, the probe that also decides the quantized matmuls' bf16 tile): where vdpbf16ps issues
 * about as fast (AMD Zen 4) it does 32 multiply-adds an instruction, as above; where it is slow (an Intel Xeon:
 * about a quarter of the rate, half an FMA's multiply-adds a cycle) each packed word is split into its two
 * float32 halves (a shift, a mask) as it is used, scores and the weighted sum of V are float32 FMAs, and the
 * probabilities stay float32.
 *
 * bf16 queries and pool at head_dim 64 or 128 on AVX-512 CPUs; extend_attention_supported() tells the caller,
 * which otherwise keeps torch's attention.
 */

#define EXT_TILE 16    /* new tokens per work item */
#define EXT_CHUNK 512  /* keys per online-softmax step */
#define EXT_QK_ROWS 12 /* query rows per pass of the score kernel: 24 accumulators */
#define PASS_ROWS 6    /* query rows per pass over V at head_dim 64 (3 at 128): 24 accumulators */

KERNEL_API int extend_attention_supported(int head_dim, int group) {
    return HAVE_AVX512 && (head_dim == 64 || head_dim == 128) && group >= 1 && group <= MAX_GROUP;
}

/* The arithmetic path: 1 AVX512-BF16 dot products, 2 float32 FMAs. value 1 or 2 sets it, 0 returns to the
 * automatic choice, < 0 reads it (deciding it on first use). */
static int ext_path = 0;
KERNEL_API int extend_attention_path(int value) {
    if (value >= 0)
        ext_path = value;
    else if (ext_path == 0) { /* a benign race: every caller decides the same */
        const double cost = quant_bf16_dot_cost();
        ext_path = HAVE_DPBF16 && !(cost >= BF16_PACE_MAX_COST) ? 1 : 2;
    }
    if (!HAVE_DPBF16 && ext_path == 1) ext_path = 2;
    return ext_path;
}

#if HAVE_AVX512
static const uint16_t EXT_ZERO_ROW[MAX_DIM];

/* r[0..15] (16 rows of 16 dwords) transposed in place: afterwards r[c] holds dword c of every row. */
static inline __attribute__((always_inline)) void ext_transpose16(__m512i *r) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int g = 0; g < 16; g += 4) { /* u[g + j], 128-bit lane k: dword 4 k + j of rows g .. g + 3 */
        u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int j = 0; j < 4; ++j) {
        const __m512i x0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44);
        const __m512i x1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
        const __m512i x2 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
        const __m512i x3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
        r[j] = _mm512_shuffle_i32x4(x0, x1, 0x88);
        r[4 + j] = _mm512_shuffle_i32x4(x0, x1, 0xDD);
        r[8 + j] = _mm512_shuffle_i32x4(x2, x3, 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(x2, x3, 0xDD);
    }
}

/* Keys [0, n) of one head (pool rows idx) into blocks of 16: word p of block j's 16 x (dim / 2) words is dim
 * pair p of key 16 j + (position in the block); keys from n up to the next multiple of 32 are zero. Sixteen
 * keys' rows at a time, 16 dim pairs per 16 x 16 transpose. */
static void ext_pack_keys(const uint16_t *kh, const int64_t *idx, int64_t n, int dim, uint32_t *dst) {
    const int pairs = dim / 2;
    const int64_t padded = (n + 31) / 32 * 32;
    for (int64_t l0 = 0; l0 < padded; l0 += 16) {
        const uint16_t *rows[16];
        for (int t = 0; t < 16; ++t) rows[t] = l0 + t < n ? kh + idx[l0 + t] * dim : EXT_ZERO_ROW;
        uint32_t *block = dst + l0 * pairs;
        for (int c = 0; c < pairs; c += 16) {
            __m512i r[16];
            for (int t = 0; t < 16; ++t) r[t] = _mm512_loadu_si512(rows[t] + 2 * c);
            ext_transpose16(r);
            for (int p = 0; p < 16; ++p) _mm512_storeu_si512(block + (int64_t)(c + p) * 16, r[p]);
        }
    }
}

/* Values [0, n) in pairs of keys: word d of pair j's dim words holds dim d of key 2 j (low half) and of key
 * 2 j + 1 (high half), so that one vdpbf16ps against a broadcast pair of probabilities adds two keys' share
 * to 16 dims; keys from n up to the next multiple of 32 are zero. */
static void ext_pack_values(const uint16_t *vh, const int64_t *idx, int64_t n, int dim, uint32_t *dst) {
    __m512i lo_words, hi_words; /* word i of (x0, x1) interleaved: x0[i], x1[i] for i < 16, then 16 .. 31 */
    uint16_t lo[32], hi[32];
    for (int i = 0; i < 16; ++i) {
        lo[2 * i] = (uint16_t)i, lo[2 * i + 1] = (uint16_t)(32 + i);
        hi[2 * i] = (uint16_t)(16 + i), hi[2 * i + 1] = (uint16_t)(48 + i);
    }
    lo_words = _mm512_loadu_si512(lo);
    hi_words = _mm512_loadu_si512(hi);
    const int64_t padded = (n + 31) / 32 * 32;
    for (int64_t l = 0; l < padded; l += 2) {
        const uint16_t *v0 = l < n ? vh + idx[l] * dim : EXT_ZERO_ROW;
        const uint16_t *v1 = l + 1 < n ? vh + idx[l + 1] * dim : EXT_ZERO_ROW;
        uint32_t *out = dst + l / 2 * dim;
        for (int c = 0; c < dim; c += 32) {
            const __m512i x0 = _mm512_loadu_si512(v0 + c), x1 = _mm512_loadu_si512(v1 + c);
            _mm512_storeu_si512(out + c, _mm512_permutex2var_epi16(x0, lo_words, x1));
            _mm512_storeu_si512(out + c + 16, _mm512_permutex2var_epi16(x0, hi_words, x1));
        }
    }
}

/* The two bf16 halves of 16 packed words as float32: the low halves (shifted up) and the high halves (masked). */
static inline __m512 ext_low(__m512i w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
static inline __m512 ext_high(__m512i w) {
    return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* s[r][l] = scale * q_r . k_(k0 + l) for EXT_QK_ROWS query rows and l < nk rounded up to 32, from the packed
 * keys kt (k0 a multiple of 32). FMA (a constant after inlining): float32 query rows [rows][dim], each packed
 * word split into its two dims, one FMA per dim and 16 keys (CPUs whose vdpbf16ps is slow); else bf16 query
 * rows, one vdpbf16ps per dim pair and 16 keys. */
static inline __attribute__((always_inline)) void ext_scores_g(const void *qrows, int dim, const uint32_t *kt,
                                                               int64_t k0, int64_t nk, float scale, float *s,
                                                               int64_t stride, const int FMA) {
    const int pairs = dim / 2;
    const __m512 sv = _mm512_set1_ps(scale);
    for (int64_t l = 0; l < nk; l += 32) {
        const uint32_t *b0 = kt + (k0 + l) * pairs, *b1 = b0 + 16 * pairs;
        __m512 acc[2 * EXT_QK_ROWS];
        for (int i = 0; i < 2 * EXT_QK_ROWS; ++i) acc[i] = _mm512_setzero_ps();
        for (int p = 0; p < pairs; ++p) {
            const __m512i w0 = _mm512_loadu_si512(b0 + 16 * p), w1 = _mm512_loadu_si512(b1 + 16 * p);
            if (FMA) {
                const float *qf = (const float *)qrows;
                const __m512 e0 = ext_low(w0), o0 = ext_high(w0), e1 = ext_low(w1), o1 = ext_high(w1);
#pragma GCC unroll 12
                for (int r = 0; r < EXT_QK_ROWS; ++r) {
                    const __m512 qe = _mm512_set1_ps(qf[(int64_t)r * dim + 2 * p]);
                    const __m512 qo = _mm512_set1_ps(qf[(int64_t)r * dim + 2 * p + 1]);
                    acc[2 * r] = _mm512_fmadd_ps(qo, o0, _mm512_fmadd_ps(qe, e0, acc[2 * r]));
                    acc[2 * r + 1] = _mm512_fmadd_ps(qo, o1, _mm512_fmadd_ps(qe, e1, acc[2 * r + 1]));
                }
                continue;
            }
#if HAVE_DPBF16
#pragma GCC unroll 12
            for (int r = 0; r < EXT_QK_ROWS; ++r) {
                uint32_t pair;
                memcpy(&pair, (const uint16_t *)qrows + (int64_t)r * dim + 2 * p, sizeof pair);
                const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)pair);
                acc[2 * r] = _mm512_dpbf16_ps(acc[2 * r], qb, (__m512bh)w0);
                acc[2 * r + 1] = _mm512_dpbf16_ps(acc[2 * r + 1], qb, (__m512bh)w1);
            }
#endif
        }
        for (int r = 0; r < EXT_QK_ROWS; ++r) {
            _mm512_storeu_ps(s + (int64_t)r * stride + l, _mm512_mul_ps(acc[2 * r], sv));
            _mm512_storeu_ps(s + (int64_t)r * stride + l + 16, _mm512_mul_ps(acc[2 * r + 1], sv));
        }
    }
}

static void ext_scores_f32(const float *qrows, int dim, const uint32_t *kt, int64_t k0, int64_t nk, float scale,
                           float *s, int64_t stride) {
    ext_scores_g(qrows, dim, kt, k0, nk, scale, s, stride, 1);
}

/* out [R][16 NV] = sum_l p[r][l] v_l over n keys of the packed value pairs vt with float32 probabilities p
 * (zero from n to the next even key) and FMAs, each pair split into its two keys' float32 rows once for all R
 * rows (R * NV <= 24 accumulators, in registers after inlining). */
static inline __attribute__((always_inline)) void ext_pv_f32_g(const uint32_t *vt, int64_t n, const int R,
                                                               const int NV, const float *p, int64_t stride,
                                                               float *out) {
    const int dim = 16 * NV;
    __m512 acc[24];
    for (int i = 0; i < R * NV; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < (n + 1) / 2; ++j) {
        for (int c = 0; c < NV; ++c) {
            const __m512i w = _mm512_loadu_si512(vt + j * dim + 16 * c);
            const __m512 e = ext_low(w), o = ext_high(w);
            for (int r = 0; r < R; ++r) {
                const float *pr = p + (int64_t)r * stride + 2 * j;
                acc[r * NV + c] = _mm512_fmadd_ps(_mm512_set1_ps(pr[1]), o,
                                                  _mm512_fmadd_ps(_mm512_set1_ps(pr[0]), e, acc[r * NV + c]));
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NV; ++c) _mm512_storeu_ps(out + (int64_t)r * dim + 16 * c, acc[r * NV + c]);
}

/* NAME(vt, n, rows, dim, p, stride, acc): KERNEL with the pass's row count and 16-float column count as
 * compile-time constants (head_dim 64: up to PASS_ROWS rows, 128: up to half as many). */
#define DEFINE_EXT_PV(NAME, KERNEL, PT)                                                                       \
    static void NAME(const uint32_t *vt, int64_t n, int rows, int dim, const PT *p, int64_t stride, float *acc) { \
        switch (dim == 64 ? rows : 8 + rows) {                                                                \
        case 1: KERNEL(vt, n, 1, 4, p, stride, acc); return;                                                 \
        case 2: KERNEL(vt, n, 2, 4, p, stride, acc); return;                                                 \
        case 3: KERNEL(vt, n, 3, 4, p, stride, acc); return;                                                 \
        case 4: KERNEL(vt, n, 4, 4, p, stride, acc); return;                                                 \
        case 5: KERNEL(vt, n, 5, 4, p, stride, acc); return;                                                 \
        case 6: KERNEL(vt, n, 6, 4, p, stride, acc); return;                                                 \
        case 9: KERNEL(vt, n, 1, 8, p, stride, acc); return;                                                 \
        case 10: KERNEL(vt, n, 2, 8, p, stride, acc); return;                                                \
        case 11: KERNEL(vt, n, 3, 8, p, stride, acc); return;                                                \
        default: return;                                                                                      \
        }                                                                                                     \
    }

DEFINE_EXT_PV(ext_pv_f32, ext_pv_f32_g, float)
#endif

#if HAVE_DPBF16
static void ext_scores(const uint16_t *qrows, int dim, const uint32_t *kt, int64_t k0, int64_t nk, float scale,
                       float *s, int64_t stride) {
    ext_scores_g(qrows, dim, kt, k0, nk, scale, s, stride, 0);
}

/* out [R][16 NV] = sum_l p[r][l] v_l over n keys of the packed value pairs vt, the probabilities pb in bf16
 * (zero from n to the next even key); R * NV <= 24 accumulators, in registers after inlining. */
static inline __attribute__((always_inline)) void ext_pv_g(const uint32_t *vt, int64_t n, const int R, const int NV,
                                                           const uint16_t *pb, int64_t stride, float *out) {
    const int dim = 16 * NV;
    __m512 acc[24];
    for (int i = 0; i < R * NV; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < (n + 1) / 2; ++j) {
        __m512bh x[8];
        for (int c = 0; c < NV; ++c) x[c] = (__m512bh)_mm512_loadu_si512(vt + j * dim + 16 * c);
        for (int r = 0; r < R; ++r) {
            uint32_t pair;
            memcpy(&pair, pb + (int64_t)r * stride + 2 * j, sizeof pair);
            const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int c = 0; c < NV; ++c) acc[r * NV + c] = _mm512_dpbf16_ps(acc[r * NV + c], x[c], pp);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NV; ++c) _mm512_storeu_ps(out + (int64_t)r * dim + 16 * c, acc[r * NV + c]);
}

DEFINE_EXT_PV(ext_pv, ext_pv_g, uint16_t)
#endif

#if HAVE_AVX512
/* One thread's scratch, sized for EXT_TILE tokens x group rows. */
typedef struct {
    void *qrows;     /* [rows padded to EXT_QK_ROWS][dim]: bf16 (dot-product path) or float32 (FMA path) */
    float *scores;   /* [rows padded][EXT_CHUNK]: scores, then (FMA path) the probabilities */
    uint16_t *probs; /* [rows][EXT_CHUNK]: the bf16 probabilities (dot-product path) */
    float *acc;      /* [rows][dim]: the running weighted sum of V */
    float *part;     /* [rows of one pass over V][dim] */
    float *max, *sum, *rescale; /* [rows] */
} ExtScratch;

static void ext_scratch_free(ExtScratch *w) {
    free(w->qrows);
    free(w->scores);
    free(w->probs);
    free(w->acc);
    free(w->part);
    free(w->max);
    free(w->sum);
    free(w->rescale);
}

static int ext_scratch_alloc(ExtScratch *w, int group, int dim) {
    const int64_t rows = (int64_t)EXT_TILE * group, padded = (rows + EXT_QK_ROWS - 1) / EXT_QK_ROWS * EXT_QK_ROWS;
    w->qrows = alloc_floats(padded * dim);
    w->scores = alloc_floats(padded * EXT_CHUNK);
    w->probs = (uint16_t *)aligned_alloc(64, (size_t)rows * EXT_CHUNK * 2);
    w->acc = alloc_floats(rows * dim);
    w->part = alloc_floats((int64_t)PASS_ROWS * dim);
    w->max = alloc_floats(padded);
    w->sum = alloc_floats(padded);
    w->rescale = alloc_floats(padded);
    if (w->qrows && w->scores && w->probs && w->acc && w->part && w->max && w->sum && w->rescale) {
        memset(w->qrows, 0, sizeof(float) * (size_t)padded * dim); /* padding rows stay finite */
        return 1;
    }
    ext_scratch_free(w);
    return 0;
}

/* exp(x) for 16 floats: x = n ln 2 + r with |r| <= ln 2 / 2 (ln 2 split in two for an exact n ln 2), e^r by
 * its Taylor polynomial to r^7 (truncation below 1e-8 relative), times 2^n by vscalefps; within 2 ulp of expf,
 * 0 below -87.3. gcc's vectorized expf here was libmvec's 8-float AVX2 routine, called per 8 floats with the
 * loop's state spilled around it: the row softmax took ~20% of a 2048-token prefill's attention. */
static inline __m512 ext_exp(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 5040.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

static inline __mmask16 ext_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u));
}

/* Row r's scores s[0, n) (n >= 1) with the row's running state: soft-cap, new max, exp, sum. The
 * probabilities go to pb[0, n) as bf16 with zeros on to `width` (a multiple of 32) or, pb NULL, stay in s with
 * zeros on to `width`. Returns the factor the row's running V sum must be scaled by. */
static float ext_softmax_row(float *s, int64_t n, int64_t width, float cap, float *max, float *sum, uint16_t *pb) {
    if (cap > 0.f)
        for (int64_t l = 0; l < n; ++l) s[l] = cap * tanhf(s[l] / cap);
    __m512 m0 = _mm512_set1_ps(*max), m1 = m0;
    int64_t l = 0;
    for (; l + 32 <= n; l += 32) {
        m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + l));
        m1 = _mm512_max_ps(m1, _mm512_loadu_ps(s + l + 16));
    }
    for (; l < n; l += 16) m0 = _mm512_mask_max_ps(m0, ext_mask(n - l), m0, _mm512_loadu_ps(s + l));
    const float mx = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
    const float rescale = *max == -INFINITY ? 0.f : expf(*max - mx);
    const __m512 mv = _mm512_set1_ps(mx);
    __m512 t0 = _mm512_setzero_ps(), t1 = t0;
    for (l = 0; l < width; l += 32) {
        const __mmask16 k0 = ext_mask(n - l), k1 = ext_mask(n - l - 16);
        const __m512 e0 = _mm512_maskz_mov_ps(k0, ext_exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(k0, s + l), mv)));
        const __m512 e1 = _mm512_maskz_mov_ps(k1, ext_exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(k1, s + l + 16), mv)));
        t0 = _mm512_add_ps(t0, e0);
        t1 = _mm512_add_ps(t1, e1);
#if HAVE_DPBF16
        if (pb != NULL) {
            _mm512_storeu_si512(pb + l, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
            continue;
        }
#endif
        _mm512_storeu_ps(s + l, e0);
        _mm512_storeu_ps(s + l + 16, e1);
    }
    *sum = *sum * rescale + _mm512_reduce_add_ps(_mm512_add_ps(t0, t1));
    *max = mx;
    return rescale;
}

/* One work item: new tokens [t0, t0 + nt) of a request (prefix cached positions before them, their query
 * rows at q) against kv head h, whose packed keys and values are kt and vt; writes their rows of out.
 * fma: the float32 path. */
static void ext_tile(const uint16_t *q, int64_t q_stride, const void *kt, const void *vt, int64_t prefix,
                     int64_t t0, int nt, int h, int group, int dim, float scale, float cap, int fma, ExtScratch *w,
                     uint16_t *out, int64_t out_stride) {
    const int rows = nt * group, per_pv = PASS_ROWS * 64 / dim;
    for (int r = 0; r < rows; ++r) {
        const uint16_t *src = q + (t0 + r / group) * q_stride + ((int64_t)h * group + r % group) * dim;
        if (fma)
            for (int d = 0; d < dim; ++d) ((float *)w->qrows)[(int64_t)r * dim + d] = bf16_to_f32(src[d]);
        else
            memcpy((uint16_t *)w->qrows + (int64_t)r * dim, src, sizeof(uint16_t) * (size_t)dim);
        w->max[r] = -INFINITY;
        w->sum[r] = 0.f;
    }
    memset(w->acc, 0, sizeof(float) * (size_t)rows * dim);
#define EXT_LIMIT(r) (prefix + t0 + (r) / group + 1) /* keys row r sees */
    const int64_t keys = EXT_LIMIT(rows - 1);
    for (int64_t c0 = 0; c0 < keys; c0 += EXT_CHUNK) {
        const int64_t nk = keys - c0 < EXT_CHUNK ? keys - c0 : EXT_CHUNK;
        for (int r0 = 0; r0 < rows; r0 += EXT_QK_ROWS) {
            const int last = r0 + EXT_QK_ROWS - 1 < rows ? r0 + EXT_QK_ROWS - 1 : rows - 1;
            int64_t need = EXT_LIMIT(last) - c0;
            if (need <= 0) continue;
            need = need < nk ? need : nk;
            float *s = w->scores + (int64_t)r0 * EXT_CHUNK;
            if (fma)
                ext_scores_f32((const float *)w->qrows + (int64_t)r0 * dim, dim, (const uint32_t *)kt, c0, need,
                               scale, s, EXT_CHUNK);
#if HAVE_DPBF16
            else
                ext_scores((const uint16_t *)w->qrows + (int64_t)r0 * dim, dim, (const uint32_t *)kt, c0, need,
                           scale, s, EXT_CHUNK);
#endif
        }
        const int64_t width = (nk + 31) / 32 * 32;
        for (int r = 0; r < rows; ++r) {
            const int64_t n = EXT_LIMIT(r) - c0;
            if (n <= 0) { /* the row sees no key of this chunk: nothing to add, nothing to rescale */
                w->rescale[r] = 1.f;
                if (fma) memset(w->scores + (int64_t)r * EXT_CHUNK, 0, sizeof(float) * (size_t)width);
                else memset(w->probs + (int64_t)r * EXT_CHUNK, 0, sizeof(uint16_t) * (size_t)width);
                continue;
            }
            w->rescale[r] = ext_softmax_row(w->scores + (int64_t)r * EXT_CHUNK, n < nk ? n : nk, width, cap,
                                            w->max + r, w->sum + r, fma ? NULL : w->probs + (int64_t)r * EXT_CHUNK);
        }
        for (int r0 = 0; r0 < rows; r0 += per_pv) {
            const int count = rows - r0 < per_pv ? rows - r0 : per_pv;
            int64_t n = EXT_LIMIT(r0 + count - 1) - c0;
            if (n <= 0) continue;
            n = n < nk ? n : nk;
            if (fma)
                ext_pv_f32((const uint32_t *)vt + c0 / 2 * dim, n, count, dim, w->scores + (int64_t)r0 * EXT_CHUNK,
                           EXT_CHUNK, w->part);
#if HAVE_DPBF16
            else
                ext_pv((const uint32_t *)vt + c0 / 2 * dim, n, count, dim, w->probs + (int64_t)r0 * EXT_CHUNK,
                       EXT_CHUNK, w->part);
#endif
            for (int i = 0; i < count; ++i) {
                float *a = w->acc + (int64_t)(r0 + i) * dim;
                const float *p = w->part + (int64_t)i * dim, f = w->rescale[r0 + i];
                for (int d = 0; d < dim; ++d) a[d] = a[d] * f + p[d];
            }
        }
    }
#undef EXT_LIMIT
    for (int r = 0; r < rows; ++r) {
        uint16_t *o = out + (t0 + r / group) * out_stride + ((int64_t)h * group + r % group) * dim;
        const float *a = w->acc + (int64_t)r * dim, inv = w->sum[r] > 0.f ? 1.f / w->sum[r] : 0.f;
        for (int d = 0; d < dim; ++d) o[d] = f32_to_bf16(a[d] * inv);
    }
}
#endif

#if HAVE_AVX512
/* A request with one new token: its query heads of kv head h attend its n keys straight from the pool, through
 * the decode kernel's path (packing the K/V would cost more than the scores: the step's decoding rows, or a
 * jump-forward's last token). Returns 0 when its scratch cannot be allocated. */
static int ext_one_token(const uint16_t *q, const uint16_t *kh, const uint16_t *vh, const int64_t *idx, int64_t n,
                         int group, int dim, float scale, float cap, float **scores, int64_t *scores_cap,
                         uint16_t *out) {
    float acc[MAX_GROUP * MAX_DIM] __attribute__((aligned(64)));
    Partial part;
    part.acc = acc;
    part.cap = cap;
    if (!reserve_scores(scores, scores_cap, SCORES_FLOATS(n, group))) return 0;
    attend_range_bf16(q, kh, vh, idx, n, group, dim, scale, *scores, &part);
    for (int g = 0; g < group; ++g) {
        const float inv = part.sum[g] > 0.f ? 1.f / part.sum[g] : 0.f;
        for (int d = 0; d < dim; ++d) out[g * dim + d] = f32_to_bf16(acc[g * dim + d] * inv);
    }
    return 1;
}

/* The calling thread's buffer for a call's packed K/V, kept between calls up to EXT_KEEP_BYTES: fresh pages
 * for every layer's call would be faulted in again each time (a prefill step makes one call per layer). */
#define EXT_KEEP_BYTES ((size_t)64 << 20)
static __thread uint32_t *ext_packed = NULL;
static __thread size_t ext_packed_bytes = 0;

static uint32_t *ext_packed_buffer(size_t bytes) {
    if (bytes > ext_packed_bytes) {
        free(ext_packed);
        ext_packed = (uint32_t *)aligned_alloc(64, bytes);
        ext_packed_bytes = ext_packed != NULL ? bytes : 0;
    }
    return ext_packed;
}

static void ext_packed_release(void) {
    if (ext_packed_bytes > EXT_KEEP_BYTES || ext_packed == NULL) {
        free(ext_packed);
        ext_packed = NULL;
        ext_packed_bytes = 0;
    }
}
#endif

/* Entry point (see the top of this file). Returns 0; -1 when a buffer cannot be allocated; -2 when this CPU
 * or shape has no path here (extend_attention_supported). The output is written only on 0. */
KERNEL_API int paged_extend_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v,
                                           const int64_t *indptr, const int64_t *indices, const int64_t *q_start,
                                           const int64_t *q_len, uint16_t *out, int batch, int num_heads,
                                           int num_kv_heads, int head_dim, int64_t rows, float scale,
                                           float logit_cap, int threads) {
    const int group = num_heads / num_kv_heads;
    if (!extend_attention_supported(head_dim, group) || group * num_kv_heads != num_heads) return -2;
#if HAVE_AVX512
    const int fma = extend_attention_path(-1) == 2;
    const int words = head_dim / 2; /* 32-bit words of a packed key (and of a packed value) */
    int64_t *kt_off = (int64_t *)malloc(sizeof(int64_t) * ((size_t)batch + 1));
    int64_t tiles = 0;
    if (kt_off == NULL) return -1;
    kt_off[0] = 0;
    for (int b = 0; b < batch; ++b) {
        const int64_t n = indptr[b + 1] - indptr[b];
        const int64_t packed = q_len[b] > 1 ? (n + 31) / 32 * 32 : 0; /* one new token reads the pool in place */
        kt_off[b + 1] = kt_off[b] + packed * words * 2 * num_kv_heads; /* K, then V, per kv head */
        tiles += (q_len[b] + EXT_TILE - 1) / EXT_TILE;
    }
    uint32_t *kt = ext_packed_buffer(((size_t)kt_off[batch] * 4 + 63) / 64 * 64 + 64);
    int64_t *items = (int64_t *)malloc(sizeof(int64_t) * 2 * ((size_t)tiles + 1));
    if (kt == NULL || items == NULL) {
        ext_packed_release();
        free(items);
        free(kt_off);
        return -1;
    }
    /* (request, tile) pairs, each request's latest tile (the most keys) first */
    int64_t count = 0;
    for (int b = 0; b < batch; ++b)
        for (int64_t t = (q_len[b] + EXT_TILE - 1) / EXT_TILE - 1; t >= 0; --t) {
            items[2 * count] = b;
            items[2 * count + 1] = t;
            ++count;
        }
    const int64_t out_stride = (int64_t)num_heads * head_dim;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t bh = 0; bh < (int64_t)batch * num_kv_heads; ++bh) {
            const int b = (int)(bh / num_kv_heads), h = (int)(bh % num_kv_heads);
            const int64_t n = indptr[b + 1] - indptr[b], padded = (n + 31) / 32 * 32;
            if (q_len[b] <= 1) continue;
            uint32_t *dst = kt + kt_off[b] + (int64_t)h * padded * words * 2, *vdst = dst + padded * words;
            const uint16_t *kh = k + (int64_t)h * rows * head_dim, *vh = v + (int64_t)h * rows * head_dim;
            ext_pack_keys(kh, indices + indptr[b], n, head_dim, dst);
            ext_pack_values(vh, indices + indptr[b], n, head_dim, vdst);
        }
        ExtScratch w;
        const int ok = ext_scratch_alloc(&w, group, head_dim);
        if (!ok) failed = 1;
        float *scores = NULL; /* the one-token items' scratch */
        int64_t scores_cap = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < count * num_kv_heads; ++it) {
            if (!ok) continue;
            const int64_t *item = items + 2 * (it / num_kv_heads);
            const int b = (int)item[0], h = (int)(it % num_kv_heads);
            const int64_t n = indptr[b + 1] - indptr[b], padded = (n + 31) / 32 * 32, t0 = item[1] * EXT_TILE;
            const int nt = (int)(q_len[b] - t0 < EXT_TILE ? q_len[b] - t0 : EXT_TILE);
            if (q_len[b] == 1) {
                if (!ext_one_token(q + q_start[b] * q_stride + (int64_t)h * group * head_dim,
                                   k + (int64_t)h * rows * head_dim, v + (int64_t)h * rows * head_dim,
                                   indices + indptr[b], n, group, head_dim, scale, logit_cap, &scores, &scores_cap,
                                   out + q_start[b] * out_stride + (int64_t)h * group * head_dim))
                    failed = 1;
                continue;
            }
            const uint32_t *kv = kt + kt_off[b] + (int64_t)h * padded * words * 2;
            ext_tile(q + q_start[b] * q_stride, q_stride, kv, kv + padded * words, n - q_len[b], t0, nt, h, group,
                     head_dim, scale, logit_cap, fma, &w, out + q_start[b] * out_stride, out_stride);
        }
        if (ok) ext_scratch_free(&w);
        free(scores);
    }
    ext_packed_release();
    free(items);
    free(kt_off);
    return failed ? -1 : 0;
#else
    (void)q; (void)q_stride; (void)k; (void)v; (void)indptr; (void)indices; (void)q_start; (void)q_len; (void)out;
    (void)batch; (void)rows; (void)scale; (void)logit_cap; (void)threads;
    return -2;
#endif
}
