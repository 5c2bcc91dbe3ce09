/*
 * Paged decode attention over an fp8 KV pool (`--kv-cache-dtype fp8_e4m3 | fp8_e5m2`): the kernels of
 * paged_attention.c (same work items, chunking, cascade, fused K/V write, softmax and merge), instantiated
 * with 1-byte K/V elements and float32 or bf16 queries/outputs. Built inside kernels.c after
 * paged_attention.c, whose macros it instantiates.
 *
 * Storage: plain casts with scale 1.0 (torch.float8_e4m3fn / torch.float8_e5m2), rounded to nearest even and
 * saturated at the largest finite value (+-448 / +-57344), the bytes cache/kv_pool.py's `set_kv` writes;
 * f32_to_fp8 below is checked against torch's cast over every bf16 value (tests/unit/test_paged_attention_fp8.py).
 *
 * Reading: this CPU has no fp8 conversion instruction, so a row is widened in registers through fp16, which
 * _mm512_cvtph_ps converts exactly (subnormals included):
 *   e5m2 is the top byte of an fp16 (same exponent width and bias): fp16 bits = byte << 8.
 *   e4m3 (bias 7) placed as fp16 bits sign << 15 | (byte & 0x7F) << 7 is the value times 2^-8 (fp16 bias 15),
 *   subnormals included; the 2^8 is folded into the query scale (K) and into the weighted sum (V), both exact
 *   power-of-two multiplications, so the scores equal those from the exactly widened rows.
 * Paths: bf16 queries at head_dim 64/128 widen the rows to bf16 by table (AVX512-VBMI byte lookups) in a
 * per-thread scratch and run the AVX512-BF16 path (range_fp8_dpbf16; its probabilities rounded to bf16 as the
 * bf16 pool's are); float32 queries use the 16-float vector path (rows widened to float32 in registers); CPUs
 * with AVX2 and no AVX-512 paged_attention.c's AVX2 range at any head_dim divisible by 8 (rows widened 8 at a
 * time by F16C, the same way: Zen 3, SmolLM2's 30 layers, attention 0.25-0.27x the time of the scalar path it
 * replaces); other head dims the scalar path. Scores, softmax and sums are float32 everywhere; there is no AMX
 * fp8 path.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* --- conversions -------------------------------------------------------------------------------------- */

/* float32 -> fp8 with EXP exponent bits, MAN mantissa bits, exponent bias BIAS: round to nearest even,
 * saturate at MAX_CODE (the largest finite magnitude's code); NaN -> NAN_CODE (never stored in practice). */
static inline uint8_t f32_to_fp8(float x, int man, int bias, uint32_t max_code, uint32_t nan_code) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint32_t sign = (u >> 24) & 0x80u, a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint8_t)(sign | nan_code);
    const int e = (int)(a >> 23) - 127; /* unbiased exponent of x (-127 for zero and float32 subnormals) */
    uint32_t code;
    if (e < 1 - bias) { /* below the smallest normal: a multiple of 2^(1 - bias - man), rounded to even */
        float m;
        const float af = fabsf(x) * ldexpf(1.f, bias - 1 + man);
        m = nearbyintf(af); /* default rounding mode: to nearest even */
        code = (uint32_t)m; /* may round up to 1 << man: the smallest normal's code */
    } else {
        const int drop = 23 - man;
        const uint32_t rounded = a + ((1u << (drop - 1)) - 1u) + ((a >> drop) & 1u);
        const int64_t c = (int64_t)(rounded >> drop) - ((int64_t)(127 - bias) << man);
        code = c > (int64_t)max_code ? max_code : (uint32_t)c;
    }
    if (code > max_code) code = max_code;
    return (uint8_t)(sign | code);
}

static inline uint8_t f32_to_e4m3(float x) { return f32_to_fp8(x, 3, 7, 0x7Eu, 0x7Fu); }
static inline uint8_t f32_to_e5m2(float x) { return f32_to_fp8(x, 2, 15, 0x7Bu, 0x7Fu); }

/* fp8 -> float32 for the scalar path, exact (filled at library load). */
static float E4M3_TABLE[256], E5M2_TABLE[256];

__attribute__((constructor(101))) static void fill_fp8_tables(void) {
    for (int b = 0; b < 256; ++b) {
        const float s = (b & 0x80) ? -1.f : 1.f;
        const int e4 = (b >> 3) & 0xF, m3 = b & 7, e5 = (b >> 2) & 0x1F, m2 = b & 3;
        E4M3_TABLE[b] = s * (e4 == 0 ? ldexpf((float)m3, -9) : ldexpf(1.f + m3 / 8.f, e4 - 7));
        if ((b & 0x7F) == 0x7F) E4M3_TABLE[b] = NAN;
        E5M2_TABLE[b] = e5 == 31 ? (m2 ? NAN : s * INFINITY)
                                 : s * (e5 == 0 ? ldexpf((float)m2, -16) : ldexpf(1.f + m2 / 4.f, e5 - 15));
    }
}

static inline float load_e4m3(const uint8_t *p, int d) { return E4M3_TABLE[p[d]]; }
static inline float load_e5m2(const uint8_t *p, int d) { return E5M2_TABLE[p[d]]; }

/* The step's new K/V row (float32 or bf16 activations) stored as fp8 bytes. */
#define DEFINE_FP8_STORE(NAME, T, QLOAD, ENC)                                                                  \
static inline void NAME(uint8_t *dst, const T *src, int n) {                                                   \
    for (int d = 0; d < n; ++d) dst[d] = ENC(QLOAD(src, d));                                                   \
}
DEFINE_FP8_STORE(store_e4m3_f32, float, load_f32, f32_to_e4m3)
DEFINE_FP8_STORE(store_e4m3_bf16, uint16_t, load_bf16, f32_to_e4m3)
DEFINE_FP8_STORE(store_e5m2_f32, float, load_f32, f32_to_e5m2)
DEFINE_FP8_STORE(store_e5m2_bf16, uint16_t, load_bf16, f32_to_e5m2)

/* --- the attention ranges --------------------------------------------------------------------------- */

DEFINE_SCALAR_RANGE(range_scalar_f32_e4m3, float, load_f32, uint8_t, load_e4m3)
DEFINE_SCALAR_RANGE(range_scalar_bf16_e4m3, uint16_t, load_bf16, uint8_t, load_e4m3)
DEFINE_SCALAR_RANGE(range_scalar_f32_e5m2, float, load_f32, uint8_t, load_e5m2)
DEFINE_SCALAR_RANGE(range_scalar_bf16_e5m2, uint16_t, load_bf16, uint8_t, load_e5m2)

#if HAVE_AVX512
/* 16 fp8 bytes -> 16 floats through fp16 (see the file comment); e4m3 comes out scaled by 2^-8. */
static inline __m512 vload_e5m2(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 8));
}
static inline __m512 vload_e4m3_scaled(const uint8_t *p) {
    /* sign-extended byte << 7: bit 15 = sign, bit 14 = a copy of the sign (cleared), bits 7..13 = magnitude */
    const __m256i w = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)), 7);
    return _mm512_cvtph_ps(_mm256_and_si256(w, _mm256_set1_epi16((short)0xBF80)));
}
#define E4M3_MUL 256.f

DEFINE_VECTOR_RANGE(range_vector_f32_e4m3, float, vload_f32, uint8_t, vload_e4m3_scaled, E4M3_MUL)
DEFINE_VECTOR_RANGE(range_vector_bf16_e4m3, uint16_t, vload_bf16, uint8_t, vload_e4m3_scaled, E4M3_MUL)
DEFINE_VECTOR_RANGE(range_vector_f32_e5m2, float, vload_f32, uint8_t, vload_e5m2, 1.f)
DEFINE_VECTOR_RANGE(range_vector_bf16_e5m2, uint16_t, vload_bf16, uint8_t, vload_e5m2, 1.f)
#endif

#if HAVE_DPBF16 && defined(__AVX512VBMI__)
#define HAVE_FP8_DPBF16 1
/* bf16 queries at head_dim 64/128: the work item's K and V rows are widened to bf16 (exact: every fp8 value
 * is a bf16 value) by table lookups into a per-thread scratch, FP8_PIECE rows at a time, and the
 * AVX512-BF16 path (range_dpbf16) attends them there, from L1/L2. The pieces' partial softmax states are
 * merged as chunks are. Memory traffic: the fp8 bytes once; compute: the bf16 path's plus the widening. */
#define FP8_PIECE 512

static __thread uint16_t *fp8_rows = NULL; /* [2][FP8_PIECE][MAX_DIM] bf16: K rows, then V rows */
static __thread int64_t *fp8_iota = NULL;  /* 0, 1, ..., FP8_PIECE - 1 */

/* fp8 -> bf16 by table (every fp8 value is exactly a bf16 value): the low and high bytes of the bf16 of each
 * 7-bit magnitude, [format: 0 e4m3, 1 e5m2][magnitude]; vpermi2b (AVX512-VBMI) looks 64 bytes up at once and
 * ignores the index's top bit, the sign, which is then or-ed into the high byte. */
static uint8_t BF16_LO[2][128] __attribute__((aligned(64))), BF16_HI[2][128] __attribute__((aligned(64)));

__attribute__((constructor(102))) static void fill_bf16_tables(void) { /* after fill_fp8_tables */
    for (int m = 0; m < 128; ++m)
        for (int f = 0; f < 2; ++f) {
            const float x = f ? E5M2_TABLE[m] : E4M3_TABLE[m];
            uint32_t u;
            memcpy(&u, &x, sizeof u);
            BF16_LO[f][m] = (uint8_t)(u >> 16);
            BF16_HI[f][m] = (uint8_t)(u >> 24);
        }
}

/* Widen m rows (of the slots in idx) to bf16 rows in dst. The input bytes are first permuted so that the
 * in-lane byte interleave (unpacklo/hi) leaves the 64 bf16 values in their natural order. */
static inline void widen_rows(const uint8_t *base, const int64_t *idx, int64_t m, int dim, int e4m3, uint16_t *dst) {
    const int f = e4m3 ? 0 : 1;
    const __m512i lo0 = _mm512_load_si512(BF16_LO[f]), lo1 = _mm512_load_si512(BF16_LO[f] + 64);
    const __m512i hi0 = _mm512_load_si512(BF16_HI[f]), hi1 = _mm512_load_si512(BF16_HI[f] + 64);
    const __m512i sign = _mm512_set1_epi8((char)0x80);
    uint8_t order[64] __attribute__((aligned(64)));
    for (int j = 0; j < 4; ++j)
        for (int t = 0; t < 8; ++t) {
            order[16 * j + t] = (uint8_t)(8 * j + t);
            order[16 * j + 8 + t] = (uint8_t)(32 + 8 * j + t);
        }
    const __m512i perm = _mm512_load_si512(order);
    for (int64_t t = 0; t < m; ++t) {
        if (t + PREFETCH_AHEAD < m) prefetch_row(base + idx[t + PREFETCH_AHEAD] * dim, dim);
        const uint8_t *row = base + idx[t] * dim;
        for (int c = 0; c < dim; c += 64) {
            const __m512i x = _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(row + c));
            const __m512i lo = _mm512_permutex2var_epi8(lo0, x, lo1);
            const __m512i hi = _mm512_or_si512(_mm512_permutex2var_epi8(hi0, x, hi1), _mm512_and_si512(x, sign));
            _mm512_storeu_si512(dst + t * dim + c, _mm512_unpacklo_epi8(lo, hi));
            _mm512_storeu_si512(dst + t * dim + c + 32, _mm512_unpackhi_epi8(lo, hi));
        }
    }
}

/* Fold `b` into `a` (the flash-decoding merge of two partial states of the same query rows). */
static void merge_partial(Partial *a, const Partial *b, int group, int dim) {
    for (int g = 0; g < group; ++g) {
        const float m = a->max[g] > b->max[g] ? a->max[g] : b->max[g];
        const float wa = a->sum[g] > 0.f ? expf(a->max[g] - m) : 0.f, wb = b->sum[g] > 0.f ? expf(b->max[g] - m) : 0.f;
        for (int d = 0; d < dim; ++d) a->acc[g * dim + d] = wa * a->acc[g * dim + d] + wb * b->acc[g * dim + d];
        a->sum[g] = wa * a->sum[g] + wb * b->sum[g];
        a->max[g] = m;
    }
}

static int range_fp8_dpbf16(const uint16_t *q, const uint8_t *kh, const uint8_t *vh, const int64_t *idx, int64_t n,
                            int group, int dim, float scale, float *scores, Partial *part, int e4m3) {
    if (dim != 64 && dim != 128) return 0;
    if (fp8_rows == NULL) {
        fp8_rows = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * 2 * FP8_PIECE * MAX_DIM);
        fp8_iota = (int64_t *)aligned_alloc(64, sizeof(int64_t) * FP8_PIECE);
        if (fp8_rows == NULL || fp8_iota == NULL) {
            free(fp8_rows);
            free(fp8_iota);
            fp8_rows = NULL;
            fp8_iota = NULL;
            return 0; /* the vector path needs no scratch */
        }
        for (int i = 0; i < FP8_PIECE; ++i) fp8_iota[i] = i;
    }
    uint16_t *krows = fp8_rows, *vrows = fp8_rows + FP8_PIECE * MAX_DIM;
    float piece_acc[MAX_GROUP * MAX_DIM] __attribute__((aligned(64)));
    for (int64_t l0 = 0; l0 < n; l0 += FP8_PIECE) {
        const int64_t m = n - l0 < FP8_PIECE ? n - l0 : FP8_PIECE;
        widen_rows(kh, idx + l0, m, dim, e4m3, krows);
        widen_rows(vh, idx + l0, m, dim, e4m3, vrows);
        Partial piece;
        piece.acc = l0 == 0 ? part->acc : piece_acc;
        piece.cap = part->cap; /* every piece's scores soft-capped as the whole item's are */
        if (!range_dpbf16(q, krows, vrows, fp8_iota, m, group, dim, scale, scores, l0 == 0 ? part : &piece))
            return 0; /* cannot happen for dim 64/128 and group <= MAX_GROUP; the caller then takes another path */
        if (l0 > 0) merge_partial(part, &piece, group, dim);
    }
    return 1;
}
#define DPBF16_CALL_bf16_e4m3 range_fp8_dpbf16(q, kh, vh, idx, n, group, dim, scale, scores, part, 1)
#define DPBF16_CALL_bf16_e5m2 range_fp8_dpbf16(q, kh, vh, idx, n, group, dim, scale, scores, part, 0)
#else
#define DPBF16_CALL_bf16_e4m3 0
#define DPBF16_CALL_bf16_e5m2 0
#endif
#define DPBF16_CALL_f32_e4m3 0
#define DPBF16_CALL_f32_e5m2 0

#if HAVE_AVX2_RANGE && defined(__F16C__)
/* 8 fp8 bytes -> 8 floats through fp16 by F16C's vcvtph2ps (see the file comment); e4m3 comes out scaled by
 * 2^-8, which paged_attention.c's AVX2 range folds into the query scale and the weighted sums (E4M3_MUL). */
static inline __m256 v8_e5m2(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)), 8));
}
static inline __m256 v8_e4m3_scaled(const uint8_t *p) {
    const __m128i w = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p)), 7);
    return _mm256_cvtph_ps(_mm_and_si128(w, _mm_set1_epi16((short)0xBF80)));
}
#define AVX2_E4M3_MUL 256.f

DEFINE_AVX2_RANGE(range_avx2_f32_e4m3, float, load_f32, uint8_t, v8_e4m3_scaled, AVX2_E4M3_MUL)
DEFINE_AVX2_RANGE(range_avx2_bf16_e4m3, uint16_t, load_bf16, uint8_t, v8_e4m3_scaled, AVX2_E4M3_MUL)
DEFINE_AVX2_RANGE(range_avx2_f32_e5m2, float, load_f32, uint8_t, v8_e5m2, 1.f)
DEFINE_AVX2_RANGE(range_avx2_bf16_e5m2, uint16_t, load_bf16, uint8_t, v8_e5m2, 1.f)
#define AVX2_CALL_f32_e4m3 (range_avx2_f32_e4m3(q, kh, vh, idx, n, group, dim, scale, scores, part), 1)
#define AVX2_CALL_bf16_e4m3 (range_avx2_bf16_e4m3(q, kh, vh, idx, n, group, dim, scale, scores, part), 1)
#define AVX2_CALL_f32_e5m2 (range_avx2_f32_e5m2(q, kh, vh, idx, n, group, dim, scale, scores, part), 1)
#define AVX2_CALL_bf16_e5m2 (range_avx2_bf16_e5m2(q, kh, vh, idx, n, group, dim, scale, scores, part), 1)
#else
#define AVX2_CALL_f32_e4m3 0
#define AVX2_CALL_bf16_e4m3 0
#define AVX2_CALL_f32_e5m2 0
#define AVX2_CALL_bf16_e5m2 0
#endif
DEFINE_RANGE(attend_range_f32_e4m3, float, uint8_t, f32_e4m3)
DEFINE_RANGE(attend_range_bf16_e4m3, uint16_t, uint8_t, bf16_e4m3)
DEFINE_RANGE(attend_range_f32_e5m2, float, uint8_t, f32_e5m2)
DEFINE_RANGE(attend_range_bf16_e5m2, uint16_t, uint8_t, bf16_e5m2)

DEFINE_KERNEL(paged_decode_attention_f32_e4m3, float, uint8_t, attend_range_f32_e4m3, finish_f32, store_e4m3_f32)
DEFINE_KERNEL(paged_decode_attention_bf16_e4m3, uint16_t, uint8_t, attend_range_bf16_e4m3, finish_bf16,
              store_e4m3_bf16)
DEFINE_KERNEL(paged_decode_attention_f32_e5m2, float, uint8_t, attend_range_f32_e5m2, finish_f32, store_e5m2_f32)
DEFINE_KERNEL(paged_decode_attention_bf16_e5m2, uint16_t, uint8_t, attend_range_bf16_e5m2, finish_bf16,
              store_e5m2_bf16)

/* Whole tensors converted with the same rounding as the kernels' K/V write (for tests and the pool). */
KERNEL_API void fp8_encode_f32(const float *src, uint8_t *dst, int64_t n, int e5m2) {
    for (int64_t i = 0; i < n; ++i) dst[i] = e5m2 ? f32_to_e5m2(src[i]) : f32_to_e4m3(src[i]);
}

/* Whether bf16 queries at head_dim 64/128 take the AVX512-BF16 path, whose probabilities are rounded to bf16
 * before the weighted sum of V, over a bf16 pool (fp8 = 0) or an fp8 one (1); elsewhere they stay float32. */
KERNEL_API int paged_attention_rounds_probs(int fp8) {
#if HAVE_DPBF16 && defined(__AVX512VBMI__)
    return 1;
#else
    return fp8 ? 0 : HAVE_DPBF16;
#endif
}
