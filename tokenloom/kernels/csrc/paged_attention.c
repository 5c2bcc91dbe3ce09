/*
 * Paged decode attention for the CPU: one query token per request, reading each request's K/V rows straight
 * from the paged KV pool (no gathered copy), so every KV byte is read once per step.
 *
 * Layout: q/out [B, Hq, D]; k/v pool [Hkv, rows, D]; request b's slots are indices[indptr[b] .. indptr[b+1]).
 * The new token's K/V ([B, Hkv, D], stored at out_loc[b]) may be written into the pool by the same call, so
 * a decode layer needs one native call instead of two index_copy_ plus the attention.
 *
 * Work items are (request, kv head, chunk of the request's tokens). A request is split into chunks only when
 * there are too few (request, kv head) pairs to keep every thread busy; the chunks' partial softmax states
 * (max, sum, weighted V) are then merged exactly as flash-decoding does. Scores, softmax and the weighted sum
 * are computed in float32; bf16 inputs are widened exactly and the output is rounded to nearest even.
 *
 * Paths, fastest first: bf16 at head_dim 64 on the AMX tile unit (range_amx64; TOKENLOOM_DISABLE_AMX=1
 * turns it off); bf16 at head_dim 64/128 with AVX512-BF16 dot products; 16-float AVX-512 vectors with the
 * query held in registers; a portable scalar loop. All compute the same thing (float32 scores, softmax and
 * sums; the bf16 paths round the probabilities to bf16 before the weighted sum of V).
 *
 * Cascade: given a shared-prefix plan (plan_shared_prefixes), a prefix several requests share is attended
 * once for all their query rows, and merged with each request's own suffix like a chunk.
 *
 * Soft-cap (Gemma 2, `logit_cap` > 0): every path's scaled scores become cap * tanh(s / cap) in softmax_rows,
 * the one place all of them pass before the softmax.
 */
#include "amx_common.h"
#include "bf16_common.h"
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif

#define MAX_GROUP 16
#define MAX_DIM 256
#define MIN_CHUNK 256 /* never split a request into chunks shorter than this */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 32 /* rows prefetched ahead in the vector path */
#endif
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 2 /* 16-row blocks prefetched ahead in the bf16 dot-product path */
#endif
#define MAX_CHUNKS 64 /* parts a long request's own slots are split into */

/* A call whose requests' K and V rows come to at most this many bytes asks for all of them at its start, each
 * thread for its share of every request's tokens, into its L2 (0: never; attn_bulk_prefetch() sets it for
 * benchmarks). At batch 1 a decode step's weight stream has evicted the layer's K/V by the time attention
 * runs, and the per-row prefetch a few rows ahead leaves the kernel waiting on memory latency row by row
 * (SmolLM2, context ~300: ~28 us a layer against ~12 with the K/V already in L2); asked for all at once, the
 * rows arrive in parallel. SmolLM2 Q4_1 decode step at batch 1 (`bench/ab_decode.py`, lockstep): context 256
 * 0.993x, 300 0.966x, 400 0.953x, 480 0.950x; with a 1 MiB limit, 600 (460 KiB) 0.978x and 1000 (768 KiB)
 * 0.999x, and a harness at 1000 ran 1.04x slower: past a few hundred KiB the rows push each other (and the
 * next weights) out of L2. */
static int64_t attn_bulk_bytes = 512 * 1024;

KERNEL_API int64_t attn_bulk_prefetch(int64_t bytes) {
    if (bytes >= 0) attn_bulk_bytes = bytes;
    return attn_bulk_bytes;
}

/* prefetcht1 of every 64-byte line of one K or V row (asm: see prefetch_row below) */
static inline void bulk_prefetch_row(const void *row, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) {
#if defined(__x86_64__)
        __asm__ volatile("prefetcht1 %0" : : "m"(*((const char *)row + o)));
#else
        __builtin_prefetch((const char *)row + o, 0, 2);
#endif
    }
}

/* This thread's share (thread `id` of `nt`: the same fraction of every request's tokens, as the chunks split
 * them) of the call's K and V rows, prefetched into L2. */
static void bulk_prefetch_kv(const char *k, const char *v, int64_t head_bytes, int64_t row_bytes,
                             const int64_t *indptr, const int64_t *indices, int batch, int num_kv_heads, int id,
                             int nt) {
    for (int b = 0; b < batch; ++b) {
        const int64_t *ix = indices + indptr[b], len = indptr[b + 1] - indptr[b];
        const int64_t lo = len * id / nt, hi = len * (id + 1) / nt;
        for (int h = 0; h < num_kv_heads; ++h)
            for (int64_t i = lo; i < hi; ++i) {
                bulk_prefetch_row(k + h * head_bytes + ix[i] * row_bytes, row_bytes);
                bulk_prefetch_row(v + h * head_bytes + ix[i] * row_bytes, row_bytes);
            }
    }
}


static inline float load_f32(const float *p, int d) { return p[d]; }
static inline float load_bf16(const uint16_t *p, int d) { return bf16_to_f32(p[d]); }
static inline void store_f32(float *p, int d, float x) { p[d] = x; }
static inline void store_bf16(uint16_t *p, int d, float x) { p[d] = f32_to_bf16(x); }

/* Partial attention state of one (request, kv head, chunk): per query head of the group, the running max
 * score, the sum of exp(score - max) and the exp-weighted sum of V rows (not yet divided by the sum).
 * `cap` is an input the work item's caller sets: the soft-cap of its scores (0: none; see softmax_rows). */
typedef struct {
    float max[MAX_GROUP];
    float sum[MAX_GROUP];
    float *acc; /* [group][head_dim] */
    float cap;
} Partial;

/* Softmax over `scores` [group][n] in place (exp(s - max)), filling part->max / part->sum. Every path's
 * scaled scores (q.k * scale) pass through here before anything else reads them, so the soft-cap of Gemma 2
 * (`attn_logit_softcapping`: s -> cap * tanh(s / cap), after the scaling and before the softmax, as
 * transformers' Gemma2 eager attention does) is applied here once for all paths, cascade prefixes included.
 * tanhf is glibc's, not an approximation of ours: under -ffast-math gcc vectorizes the loop with libmvec's
 * tanhf (glibc >= 2.35; measured within 1.03 ulp of tanh over [-10, 10]), else it calls the scalar one. */
static void softmax_rows(float *scores, int64_t n, int group, Partial *part) {
    const float cap = part->cap;
    for (int g = 0; g < group; ++g) {
        float *s = scores + (int64_t)g * n;
        if (cap > 0.f)
            for (int64_t l = 0; l < n; ++l) s[l] = cap * tanhf(s[l] / cap);
        float mx = -INFINITY;
        for (int64_t l = 0; l < n; ++l) mx = s[l] > mx ? s[l] : mx;
        float sum = 0.f;
        for (int64_t l = 0; l < n; ++l) {
            const float e = expf(s[l] - mx);
            s[l] = e;
            sum += e;
        }
        part->max[g] = mx;
        part->sum[g] = sum;
    }
}

/* Portable path: any head_dim <= MAX_DIM, any group <= MAX_GROUP. */
#define DEFINE_SCALAR_RANGE(NAME, T, QLOAD, TKV, LOAD)                                                         \
static void NAME(const T *q, const TKV *kh, const TKV *vh, const int64_t *idx, int64_t n, int group, int dim,  \
                 float scale, float *scores, Partial *part) {                                                  \
    float qf[MAX_GROUP][MAX_DIM], row[MAX_DIM];                                                                \
    for (int g = 0; g < group; ++g)                                                                            \
        for (int d = 0; d < dim; ++d) qf[g][d] = QLOAD(q + (int64_t)g * dim, d) * scale;                      \
    for (int64_t l = 0; l < n; ++l) {                                                                          \
        const TKV *kp = kh + idx[l] * dim;                                                                     \
        for (int d = 0; d < dim; ++d) row[d] = LOAD(kp, d);                                                    \
        for (int g = 0; g < group; ++g) {                                                                      \
            float s = 0.f;                                                                                     \
            for (int d = 0; d < dim; ++d) s += qf[g][d] * row[d];                                              \
            scores[(int64_t)g * n + l] = s;                                                                    \
        }                                                                                                      \
    }                                                                                                          \
    softmax_rows(scores, n, group, part);                                                                      \
    memset(part->acc, 0, sizeof(float) * (size_t)group * dim);                                                 \
    for (int64_t l = 0; l < n; ++l) {                                                                          \
        const TKV *vp = vh + idx[l] * dim;                                                                     \
        for (int d = 0; d < dim; ++d) row[d] = LOAD(vp, d);                                                    \
        for (int g = 0; g < group; ++g) {                                                                      \
            const float p = scores[(int64_t)g * n + l];                                                        \
            float *acc = part->acc + (int64_t)g * dim;                                                         \
            for (int d = 0; d < dim; ++d) acc[d] += p * row[d];                                                \
        }                                                                                                      \
    }                                                                                                          \
}

DEFINE_SCALAR_RANGE(range_scalar_f32, float, load_f32, float, load_f32)
DEFINE_SCALAR_RANGE(range_scalar_bf16, uint16_t, load_bf16, uint16_t, load_bf16)

#if defined(__x86_64__)
/* Bring a K/V row of `bytes` into L1 ahead of use (paged slots need not be contiguous, so the hardware
 * prefetcher cannot always guess the next row). Written as asm: gcc 12 -O3 compiled the _mm_prefetch form out
 * of the vector and AVX512-BF16 paths (range_dpbf16 had no prefetch instruction at all; only range_amx64
 * kept its own), and a decode step's attention was bound by the V loads' misses (bench/attention_layout.py:
 * 64 x 320 tokens, 34 -> 29 ms per step without AMX). */
static inline void prefetch_row(const void *row, int bytes) {
    for (int o = 0; o < bytes; o += 64) __asm__ volatile("prefetcht0 %0" : : "m"(*((const char *)row + o)));
}
static inline void prefetch_row_l2(const void *row, int bytes) {
    for (int o = 0; o < bytes; o += 64) __asm__ volatile("prefetcht1 %0" : : "m"(*((const char *)row + o)));
}
#endif

#if !HAVE_AVX512 && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2_RANGE 1
/* AVX2 path (CPUs without AVX-512), head_dim a multiple of 8: the scaled query rows in float32; K rows widened
 * 8 at a time into an L1 buffer, each group member's 8 dot products reduced to one vector of 8 scores; then
 * the softmax; P.V up to four query rows at a time (avx2_pv: each V row widened once per four). KV_MUL: a
 * power of two the widened rows come out divided by (paged_attention_fp8.c's e4m3), folded into the query
 * scale and the weighted sums (exact: the same scores and sums as from the exactly widened rows). */
static inline __m256 v8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 v8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* Lane j: the sum of v[j]'s 8 lanes. */
static inline __m256 v8_sum8(const __m256 *v) {
    const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* avx2_pv: P.V of query rows g0 .. g0 + GB - 1 (one kv head's group members), head_dim 8 nv: CW accumulators per member
 * in registers (GB CW <= 12), each V row's CW vectors widened once for all GB members; out[g][d] the sums over
 * the keys in order (the same FMA chain per output whatever GB and CW). */
#define DEFINE_AVX2_PV(NAME, TKV, VLOAD, KV_MUL)                                                               \
static inline __attribute__((always_inline)) void NAME(const TKV *vh, const int64_t *idx, int64_t n,           \
                                                       const float *scores, int g0, const int GB,              \
                                                       const int CW, int nv, float *out) {                     \
    const int dim = 8 * nv;                                                                                    \
    for (int c0 = 0; c0 < nv; c0 += CW) {                                                                      \
        const int cn = nv - c0 < CW ? nv - c0 : CW;                                                            \
        __m256 acc[4][8];                                                                                      \
        for (int g = 0; g < GB; ++g)                                                                           \
            for (int c = 0; c < CW; ++c) acc[g][c] = _mm256_setzero_ps();                                      \
        for (int64_t l = 0; l < n; ++l) {                                                                      \
            if (sizeof(TKV) > 1 && c0 == 0 && l + PREFETCH_AHEAD < n)                                          \
                prefetch_row(vh + idx[l + PREFETCH_AHEAD] * dim, dim * (int)sizeof(TKV));                      \
            const TKV *vp = vh + idx[l] * dim + 8 * c0;                                                        \
            __m256 pl[4];                                                                                      \
            for (int g = 0; g < GB; ++g) pl[g] = _mm256_set1_ps(scores[(int64_t)(g0 + g) * n + l]);            \
            for (int c = 0; c < CW; ++c) {                                                                     \
                if (c >= cn) break;                                                                            \
                const __m256 v = VLOAD(vp + 8 * c);                                                            \
                for (int g = 0; g < GB; ++g) acc[g][c] = _mm256_fmadd_ps(pl[g], v, acc[g][c]);                 \
            }                                                                                                  \
        }                                                                                                      \
        for (int g = 0; g < GB; ++g)                                                                           \
            for (int c = 0; c < cn; ++c)                                                                       \
                _mm256_storeu_ps(out + (int64_t)(g0 + g) * dim + 8 * (c0 + c),                                 \
                                 (KV_MUL) == 1.f ? acc[g][c] : _mm256_mul_ps(acc[g][c], _mm256_set1_ps(KV_MUL))); \
    }                                                                                                          \
}

#define DEFINE_AVX2_RANGE(NAME, T, QLOAD, TKV, VLOAD, KV_MUL)                                                  \
DEFINE_AVX2_PV(NAME##_pv, TKV, VLOAD, KV_MUL)                                                                  \
static void NAME(const T *q, const TKV *kh, const TKV *vh, const int64_t *idx, int64_t n, int group, int dim,  \
                 float scale, float *scores, Partial *part) {                                                  \
    const int nv = dim / 8;                                                                                    \
    float qf[MAX_GROUP * MAX_DIM] __attribute__((aligned(32)));                                                \
    float krow[8][MAX_DIM] __attribute__((aligned(32)));                                                       \
    for (int g = 0; g < group; ++g)                                                                            \
        for (int d = 0; d < dim; ++d) qf[g * dim + d] = QLOAD(q + (int64_t)g * dim, d) * (scale * (KV_MUL));    \
    for (int64_t l0 = 0; l0 < n; l0 += 8) {                                                                    \
        const int cnt = n - l0 < 8 ? (int)(n - l0) : 8;                                                        \
        for (int64_t l = l0 + PREFETCH_AHEAD; sizeof(TKV) > 1 && l < l0 + PREFETCH_AHEAD + 8 && l < n; ++l)   \
            prefetch_row(kh + idx[l] * dim, dim * (int)sizeof(TKV));                                           \
        for (int j = 0; j < 8; ++j) /* rows past the last key zero: their scores are never stored */           \
            for (int c = 0; c < nv; ++c)                                                                       \
                _mm256_store_ps(krow[j] + 8 * c,                                                               \
                                j < cnt ? VLOAD(kh + idx[l0 + j] * dim + 8 * c) : _mm256_setzero_ps());        \
        for (int g = 0; g < group; ++g) {                                                                      \
            /* the 8 keys' sums side by side (8 independent FMA chains, each still in c order) */              \
            __m256 dots[8];                                                                                    \
            for (int j = 0; j < 8; ++j) dots[j] = _mm256_setzero_ps();                                         \
            for (int c = 0; c < nv; ++c) {                                                                     \
                const __m256 qv = _mm256_load_ps(qf + g * dim + 8 * c);                                        \
                for (int j = 0; j < 8; ++j) dots[j] = _mm256_fmadd_ps(qv, _mm256_load_ps(krow[j] + 8 * c), dots[j]); \
            }                                                                                                  \
            float got[8] __attribute__((aligned(32)));                                                         \
            _mm256_store_ps(got, v8_sum8(dots));                                                               \
            memcpy(scores + (int64_t)g * n + l0, got, sizeof(float) * (size_t)cnt);                           \
        }                                                                                                      \
    }                                                                                                          \
    softmax_rows(scores, n, group, part);                                                                      \
    for (int g0 = 0; g0 < group; g0 += 4) { /* four members at a time, 3-8 vectors of their sums at once */    \
        switch (group - g0 < 4 ? group - g0 : 4) {                                                             \
        case 1: NAME##_pv(vh, idx, n, scores, g0, 1, 8, nv, part->acc); break;                                 \
        case 2: NAME##_pv(vh, idx, n, scores, g0, 2, 6, nv, part->acc); break;                                 \
        case 3: NAME##_pv(vh, idx, n, scores, g0, 3, 4, nv, part->acc); break;                                 \
        default: NAME##_pv(vh, idx, n, scores, g0, 4, 3, nv, part->acc); break;                                \
        }                                                                                                      \
    }                                                                                                          \
}

DEFINE_AVX2_RANGE(range_avx2_f32, float, load_f32, float, v8_f32, 1.f)
DEFINE_AVX2_RANGE(range_avx2_bf16, uint16_t, load_bf16, uint16_t, v8_bf16, 1.f)
#else
#define HAVE_AVX2_RANGE 0
#endif

#if HAVE_AVX512

static inline __m512 vload_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 vload_bf16(const uint16_t *p) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

/* Vector path for head_dim = 16 * NV (NV a compile-time constant after inlining: 4 or 8). The query rows
 * (scaled) and the V accumulators stay in registers; each K/V row is widened once and used by the whole
 * group. The next rows are prefetched since paged slots need not be contiguous. */
#define DEFINE_VECTOR_RANGE(NAME, T, QLOAD, TKV, VLOAD, KV_MUL)                                                 \
static inline __attribute__((always_inline)) void NAME(const T *q, const TKV *kh, const TKV *vh,              \
                                                       const int64_t *idx, int64_t n, int group, const int nv,  \
                                                       float scale, float *scores, Partial *part) {             \
    const int dim = nv * 16;                                                                                   \
    __m512 qv[MAX_GROUP][8];                                                                                   \
    const __m512 sv = _mm512_set1_ps(scale * (KV_MUL));                                                        \
    for (int g = 0; g < group; ++g)                                                                            \
        for (int c = 0; c < nv; ++c) qv[g][c] = _mm512_mul_ps(QLOAD(q + (int64_t)g * dim + 16 * c), sv);     \
    for (int64_t l = 0; l < n; ++l) {                                                                          \
        if (l + PREFETCH_AHEAD < n) prefetch_row(kh + idx[l + PREFETCH_AHEAD] * dim, dim * (int)sizeof(TKV));  \
        const TKV *kp = kh + idx[l] * dim;                                                                     \
        __m512 kv[8];                                                                                          \
        for (int c = 0; c < nv; ++c) kv[c] = VLOAD(kp + 16 * c);                                               \
        for (int g = 0; g < group; ++g) {                                                                      \
            __m512 s = _mm512_mul_ps(qv[g][0], kv[0]);                                                         \
            for (int c = 1; c < nv; ++c) s = _mm512_fmadd_ps(qv[g][c], kv[c], s);                              \
            scores[(int64_t)g * n + l] = _mm512_reduce_add_ps(s);                                              \
        }                                                                                                      \
    }                                                                                                          \
    softmax_rows(scores, n, group, part);                                                                      \
    __m512 acc[MAX_GROUP][8];                                                                                  \
    for (int g = 0; g < group; ++g)                                                                            \
        for (int c = 0; c < nv; ++c) acc[g][c] = _mm512_setzero_ps();                                          \
    for (int64_t l = 0; l < n; ++l) {                                                                          \
        if (l + PREFETCH_AHEAD < n) prefetch_row(vh + idx[l + PREFETCH_AHEAD] * dim, dim * (int)sizeof(TKV));  \
        const TKV *vp = vh + idx[l] * dim;                                                                     \
        __m512 vv[8];                                                                                          \
        for (int c = 0; c < nv; ++c) vv[c] = VLOAD(vp + 16 * c);                                               \
        for (int g = 0; g < group; ++g) {                                                                      \
            const __m512 p = _mm512_set1_ps(scores[(int64_t)g * n + l]);                                       \
            for (int c = 0; c < nv; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);                     \
        }                                                                                                      \
    }                                                                                                          \
    const __m512 mv = _mm512_set1_ps(KV_MUL);                                                                  \
    for (int g = 0; g < group; ++g)                                                                            \
        for (int c = 0; c < nv; ++c)                                                                           \
            _mm512_storeu_ps(part->acc + (int64_t)g * dim + 16 * c,                                            \
                             (KV_MUL) == 1.f ? acc[g][c] : _mm512_mul_ps(acc[g][c], mv));                     \
}

DEFINE_VECTOR_RANGE(range_vector_f32, float, vload_f32, float, vload_f32, 1.f)
DEFINE_VECTOR_RANGE(range_vector_bf16, uint16_t, vload_bf16, uint16_t, vload_bf16, 1.f)
#endif

#if HAVE_AVX512 && defined(__AVX512BF16__)
#define HAVE_DPBF16 1
/* bf16 x bf16 dot products with AVX512-BF16 (vdpbf16ps: products exact, sums in float32). */

static const uint16_t ZERO_ROW[MAX_DIM];

/* scores[g][l] = scale * q_g . k_l for the n slots of idx, 16 slots at a time; head_dim = 32 * NC. */
static inline __attribute__((always_inline)) void qk_dpbf16(const uint16_t *q, const uint16_t *kh,
                                                            const int64_t *idx, int64_t n, const int G,
                                                            const int NC, float scale, float *scores) {
    const int dim = 32 * NC;
    __m512bh qb[MAX_GROUP][4];
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < NC; ++c) qb[g][c] = (__m512bh)_mm512_loadu_si512(q + (int64_t)g * dim + 32 * c);
    const __m512 sv = _mm512_set1_ps(scale);
    for (int64_t l0 = 0; l0 < n; l0 += 16) {
        const int m = n - l0 < 16 ? (int)(n - l0) : 16;
        const uint16_t *rows[16];
        for (int t = 0; t < 16; ++t) rows[t] = kh + idx[l0 + (t < m ? t : 0)] * dim;
        for (int t = 0; t < 16 && l0 + 16 * PREFETCH_BLOCKS + t < n; ++t)
            prefetch_row(kh + idx[l0 + 16 * PREFETCH_BLOCKS + t] * dim, dim * 2);
        for (int g = 0; g < G; ++g) {
            __m512 acc[16];
            for (int t = 0; t < 16; ++t) {
                __m512 a = _mm512_setzero_ps();
                for (int c = 0; c < NC; ++c)
                    a = _mm512_dpbf16_ps(a, qb[g][c], (__m512bh)_mm512_loadu_si512(rows[t] + 32 * c));
                acc[REDUCE16_SLOT(t)] = a;
            }
            _mm512_mask_storeu_ps(scores + (int64_t)g * n + l0, (__mmask16)((1u << m) - 1u),
                                  _mm512_mul_ps(reduce16(acc), sv));
        }
    }
}

/* acc[g] = sum_l p[g][l] * v_l with the probabilities rounded to bf16 (pairs of slots per instruction: two
 * V rows are interleaved word by word, so lane i of the low/high halves holds a permuted dim, undone at the
 * end). pb: bf16 probabilities [G][stride], zero past n. G * 2 * NC <= PV_MAX_ACC: one flat array of
 * accumulators indexed by compile-time constants after inlining, so that gcc keeps them in registers. With
 * an [8][8] array gcc stored every accumulator to the stack on every pair of slots: a work item (320 slots,
 * one thread) took up to 2.2x longer (head_dim 64: G = 3 1.7x, G = 4 2.2x, G = 1-2 level; head_dim 128:
 * 1.6-2.2x), and SmolLM2's whole attention call at batch 1, context 320 1.6x longer (the same sums in the
 * same order: results bit-identical). */
#define PV_MAX_ACC 24
static inline __attribute__((always_inline)) void pv_dpbf16(const uint16_t *vh, const int64_t *idx, int64_t n,
                                                            const int G, const int NC, const uint16_t *pb,
                                                            int64_t stride, float *out) {
    const int dim = 32 * NC, per_row = 2 * NC;
    __m512 acc[PV_MAX_ACC];
    for (int i = 0; i < G * per_row; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t l = 0; l < n; l += 2) {
        for (int t = 0; t < 2 && l + 16 * PREFETCH_BLOCKS + t < n; ++t)
            prefetch_row(vh + idx[l + 16 * PREFETCH_BLOCKS + t] * dim, dim * 2);
        const uint16_t *r0 = vh + idx[l] * dim, *r1 = l + 1 < n ? vh + idx[l + 1] * dim : ZERO_ROW;
        __m512i lo[4], hi[4];
        for (int c = 0; c < NC; ++c) {
            const __m512i x0 = _mm512_loadu_si512(r0 + 32 * c), x1 = _mm512_loadu_si512(r1 + 32 * c);
            lo[c] = _mm512_unpacklo_epi16(x0, x1);
            hi[c] = _mm512_unpackhi_epi16(x0, x1);
        }
        for (int g = 0; g < G; ++g) {
            uint32_t pair;
            memcpy(&pair, pb + (int64_t)g * stride + l, sizeof pair);
            const __m512bh p = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int c = 0; c < NC; ++c) {
                const int i = g * per_row + 2 * c;
                acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)lo[c], p);
                acc[i + 1] = _mm512_dpbf16_ps(acc[i + 1], (__m512bh)hi[c], p);
            }
        }
    }
    /* lane L of lo holds dims 8L..8L+3 of its 32-dim chunk, lane L of hi dims 8L+4..8L+7 */
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < NC; ++c) {
            const int i = g * per_row + 2 * c;
            float *o = out + (int64_t)g * dim + 32 * c;
            _mm512_storeu_ps(o, _mm512_permutex2var_ps(acc[i], first, acc[i + 1]));
            _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(acc[i], second, acc[i + 1]));
        }
}

/* Round the softmax numerators [G][n] to bf16 rows of `stride` (a multiple of 32), zero past n. */
static void probs_to_bf16(const float *scores, int64_t n, int group, uint16_t *pb, int64_t stride) {
    for (int g = 0; g < group; ++g) {
        const float *s = scores + (int64_t)g * n;
        for (int64_t l = 0; l < stride; l += 32) {
            const int64_t m0 = n - l, m1 = n - l - 16;
            const __mmask16 k0 = m0 >= 16 ? 0xFFFF : (m0 <= 0 ? 0 : (__mmask16)((1u << m0) - 1u));
            const __mmask16 k1 = m1 >= 16 ? 0xFFFF : (m1 <= 0 ? 0 : (__mmask16)((1u << m1) - 1u));
            const __m512 a = _mm512_maskz_loadu_ps(k0, s + l), b = _mm512_maskz_loadu_ps(k1, s + l + 16);
            _mm512_storeu_si512(pb + (int64_t)g * stride + l, (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
    }
}

static inline __attribute__((always_inline)) void range_dpbf16_g(const uint16_t *q, const uint16_t *kh,
                                                                 const uint16_t *vh, const int64_t *idx,
                                                                 int64_t n, const int G, const int NC,
                                                                 float scale, float *scores, Partial *part) {
    qk_dpbf16(q, kh, idx, n, G, NC, scale, scores);
    softmax_rows(scores, n, G, part);
    const int64_t stride = (n + 31) / 32 * 32;
    uint16_t *pb = (uint16_t *)(scores + (int64_t)G * n + 16 - ((int64_t)G * n) % 16);
    probs_to_bf16(scores, n, G, pb, stride);
    /* as many query rows per pass over V as fit PV_MAX_ACC accumulators (6 at head_dim 64, 3 at 128); a row's
     * sum does not depend on the pass it is in. Written as one loop over passes: gcc 12 put the accumulators
     * back on the stack when the full passes and the rest were two separate calls. */
    const int per = PV_MAX_ACC / (2 * NC);
    for (int g0 = 0; g0 < G; g0 += per)
        pv_dpbf16(vh, idx, n, G - g0 < per ? G - g0 : per, NC, pb + (int64_t)g0 * stride, stride,
                  part->acc + g0 * 32 * NC);
}

#if HAVE_AMX
/*
 * AMX path (head_dim 64, bf16): the tile unit does the dot products. Every tile is 16 rows x 64 bytes:
 *   QK, per 16 keys:  tmm0 (S[key][row], fp32) += tmm1 (K rows, 32 dims) . tmm2|tmm3 (Q^T, dim pairs x rows)
 *   PV, per 32 keys:  tmm4..7 (O[row][16 permuted dims], fp32) += tmm0 (P[row][32 keys]) . tmm1 (V key pairs)
 * Query rows are padded to 16 (unused rows hold anything finite; a tile row only feeds its own output row).
 * K rows come straight from the pool when 16 slots are consecutive (decode slots are handed out in runs),
 * else they are copied into a scratch block first. V rows are interleaved in pairs as pv_dpbf16 does.
 */
/* Per-thread scratch of the AMX path: P rows padded to 16, one K block, V pair blocks, tile outputs. */
static __thread uint16_t *amx_p = NULL;
static __thread int64_t amx_p_cap = 0;

/* One work item on the tile unit; 0 (nothing computed) when its scratch cannot be allocated. */
static int range_amx64(const uint16_t *q, const uint16_t *kh, const uint16_t *vh, const int64_t *idx, int64_t n,
                       int group, float scale, float *scores, Partial *part) {
    enum { D = 64 };
    uint16_t qt[2][16][32] __attribute__((aligned(64))); /* Q^T in pairs: [half][dim pair][row * 2 + j] */
    uint16_t kblk[16][D] __attribute__((aligned(64)));
    uint16_t vblk[4][16][32] __attribute__((aligned(64)));
    float sblk[16][16] __attribute__((aligned(64)));
    float oblk[4][16][16] __attribute__((aligned(64)));
    const int64_t stride = (n + 31) / 32 * 32;
    if (16 * stride > amx_p_cap) {
        free(amx_p);
        amx_p = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * (size_t)(16 * stride));
        amx_p_cap = amx_p != NULL ? 16 * stride : 0;
        if (amx_p == NULL) return 0;
        memset(amx_p, 0, sizeof(uint16_t) * (size_t)(16 * stride));
    }
    memset(qt, 0, sizeof qt);
    for (int g = 0; g < group; ++g)
        for (int d = 0; d < D; ++d) qt[d / 32][(d % 32) / 2][g * 2 + d % 2] = q[g * D + d];
    _tile_loadd(2, qt[0], 64);
    _tile_loadd(3, qt[1], 64);
    const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(16));
    const __m512 sv = _mm512_set1_ps(scale);
    for (int64_t l0 = 0; l0 < n; l0 += 16) {
        const int m = n - l0 < 16 ? (int)(n - l0) : 16;
        for (int t = 0; t < 16 && l0 + 16 * PREFETCH_BLOCKS + t < n; ++t)
            prefetch_row(kh + idx[l0 + 16 * PREFETCH_BLOCKS + t] * D, D * 2);
        /* the same keys' V rows into L2 now, so the PV passes below find them there (alternating builds in one
         * process: attention over 30 layers at 64 x 256 and 16 x 1024 4-12% faster) */
        for (int t = 0; t < m; ++t) prefetch_row_l2(vh + idx[l0 + t] * D, D * 2);
        int consecutive = m == 16;
        for (int t = 1; t < m && consecutive; ++t) consecutive = idx[l0 + t] == idx[l0] + t;
        const uint16_t *kbase = kh + idx[l0] * D;
        if (!consecutive) {
            for (int t = 0; t < 16; ++t) memcpy(kblk[t], kh + idx[l0 + (t < m ? t : 0)] * D, D * 2);
            kbase = &kblk[0][0];
        }
        _tile_zero(0);
        _tile_loadd(1, kbase, D * 2);
        _tile_dpbf16ps(0, 1, 2);
        _tile_loadd(1, kbase + 32, D * 2);
        _tile_dpbf16ps(0, 1, 3);
        _tile_stored(0, sblk, 64);
        const __mmask16 keep = (__mmask16)((1u << m) - 1u);
        for (int g = 0; g < group; ++g) {
            const __m512 col = _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(g)), &sblk[0][0], 4);
            _mm512_mask_storeu_ps(scores + (int64_t)g * n + l0, keep, _mm512_mul_ps(col, sv));
        }
    }
    softmax_rows(scores, n, group, part);
    probs_to_bf16(scores, n, group, amx_p, stride);
    _tile_zero(4); /* tile numbers are encoded in the instruction: no loops */
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t l0 = 0; l0 < n; l0 += 32) {
        for (int p = 0; p < 16; ++p) {
            const int64_t a = l0 + 2 * p, b = a + 1;
            if (a + 16 * PREFETCH_BLOCKS < n) prefetch_row(vh + idx[a + 16 * PREFETCH_BLOCKS] * D, D * 2);
            if (b + 16 * PREFETCH_BLOCKS < n) prefetch_row(vh + idx[b + 16 * PREFETCH_BLOCKS] * D, D * 2);
            const uint16_t *r0 = a < n ? vh + idx[a] * D : ZERO_ROW, *r1 = b < n ? vh + idx[b] * D : ZERO_ROW;
            for (int c = 0; c < 2; ++c) {
                const __m512i x0 = _mm512_loadu_si512(r0 + 32 * c), x1 = _mm512_loadu_si512(r1 + 32 * c);
                _mm512_store_si512(vblk[2 * c][p], _mm512_unpacklo_epi16(x0, x1));
                _mm512_store_si512(vblk[2 * c + 1][p], _mm512_unpackhi_epi16(x0, x1));
            }
        }
        _tile_loadd(0, amx_p + l0, stride * 2);
        _tile_loadd(1, vblk[0], 64);
        _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(1, vblk[1], 64);
        _tile_dpbf16ps(5, 0, 1);
        _tile_loadd(1, vblk[2], 64);
        _tile_dpbf16ps(6, 0, 1);
        _tile_loadd(1, vblk[3], 64);
        _tile_dpbf16ps(7, 0, 1);
    }
    _tile_stored(4, oblk[0], 64);
    _tile_stored(5, oblk[1], 64);
    _tile_stored(6, oblk[2], 64);
    _tile_stored(7, oblk[3], 64);
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int g = 0; g < group; ++g)
        for (int c = 0; c < 2; ++c) {
            const __m512 lo = _mm512_load_ps(oblk[2 * c][g]), hi = _mm512_load_ps(oblk[2 * c + 1][g]);
            float *o = part->acc + (int64_t)g * D + 32 * c;
            _mm512_storeu_ps(o, _mm512_permutex2var_ps(lo, first, hi));
            _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(lo, second, hi));
        }
    return 1;
}

/* Whether this thread has the tile configuration loaded for the current kernel call. */
static __thread int amx_on = 0;

/* The AMX path applies to bf16 with head_dim 64, when the kernel granted the tile state and
 * TOKENLOOM_DISABLE_AMX is not set (checked once). */
static int amx_usable(int elem_bytes, int head_dim) {
    static int disabled = -1;
    if (disabled < 0) disabled = getenv("TOKENLOOM_DISABLE_AMX") != NULL && getenv("TOKENLOOM_DISABLE_AMX")[0] == '1';
    return elem_bytes == 2 && head_dim == 64 && !disabled && amx_permitted();
}
static void amx_begin(void) { amx_configure(); amx_on = 1; }
static void amx_end(void) { _tile_release(); amx_on = 0; }
#else
static int amx_usable(int elem_bytes, int head_dim) { (void)elem_bytes; (void)head_dim; return 0; }
static void amx_begin(void) {}
static void amx_end(void) {}
#endif

#define DP_CASE(G)                                                                                             \
    case G:                                                                                                    \
        if (nc == 2) range_dpbf16_g(q, kh, vh, idx, n, G, 2, scale, scores, part);                            \
        else range_dpbf16_g(q, kh, vh, idx, n, G, 4, scale, scores, part);                                     \
        return 1;

/* The AVX512-BF16 path for head_dim 64/128 and up to 16 query rows; returns 0 when it does not apply. */
static int range_dpbf16(const uint16_t *q, const uint16_t *kh, const uint16_t *vh, const int64_t *idx, int64_t n,
                        int group, int dim, float scale, float *scores, Partial *part) {
    const int nc = dim / 32;
    if (dim != 64 && dim != 128) return 0;
#if HAVE_AMX
    if (amx_on && dim == 64 && range_amx64(q, kh, vh, idx, n, group, scale, scores, part)) return 1;
#endif
    switch (group) {
        DP_CASE(1) DP_CASE(2) DP_CASE(3) DP_CASE(4) DP_CASE(5) DP_CASE(6) DP_CASE(7) DP_CASE(8)
        DP_CASE(9) DP_CASE(10) DP_CASE(11) DP_CASE(12) DP_CASE(13) DP_CASE(14) DP_CASE(15) DP_CASE(16)
        default: return 0;
    }
}
#else
#define HAVE_DPBF16 0
static int amx_usable(int elem_bytes, int head_dim) { (void)elem_bytes; (void)head_dim; return 0; }
static void amx_begin(void) {}
static void amx_end(void) {}
#endif

/* One (request, kv head, chunk) work item, dispatched to the fastest path for this head_dim. */
#define DEFINE_RANGE(NAME, T, TKV, SUFFIX)                                                                     \
static void NAME(const T *q, const TKV *kh, const TKV *vh, const int64_t *idx, int64_t n, int group, int dim,  \
                 float scale, float *scores, Partial *part) {                                                  \
    if (n <= 0) {                                                                                              \
        for (int g = 0; g < group; ++g) { part->max[g] = -INFINITY; part->sum[g] = 0.f; }                      \
        memset(part->acc, 0, sizeof(float) * (size_t)group * dim);                                             \
        return;                                                                                                \
    }                                                                                                          \
    if (DPBF16_CALL_##SUFFIX) return;                                                                         \
    if (HAVE_AVX512 && dim == 64) { VECTOR_CALL(range_vector_##SUFFIX, 4); return; }                           \
    if (HAVE_AVX512 && dim == 128) { VECTOR_CALL(range_vector_##SUFFIX, 8); return; }                          \
    if (HAVE_AVX2_RANGE && dim % 8 == 0 && AVX2_CALL_##SUFFIX) return;                                         \
    range_scalar_##SUFFIX(q, kh, vh, idx, n, group, dim, scale, scores, part);                                 \
}

#if HAVE_DPBF16
#define DPBF16_CALL_bf16 range_dpbf16(q, kh, vh, idx, n, group, dim, scale, scores, part)
#else
#define DPBF16_CALL_bf16 0
#endif
#define DPBF16_CALL_f32 0
#if HAVE_AVX512
#define VECTOR_CALL(FN, NV) FN(q, kh, vh, idx, n, group, NV, scale, scores, part)
#else
#define VECTOR_CALL(FN, NV) (void)0
#endif
#if HAVE_AVX2_RANGE /* bf16 and float32 KV (fp8 KV: paged_attention_fp8.c) */
#define AVX2_CALL_f32 (range_avx2_f32(q, kh, vh, idx, n, group, dim, scale, scores, part), 1)
#define AVX2_CALL_bf16 (range_avx2_bf16(q, kh, vh, idx, n, group, dim, scale, scores, part), 1)
#else
#define AVX2_CALL_f32 0
#define AVX2_CALL_bf16 0
#endif

DEFINE_RANGE(attend_range_f32, float, float, f32)
DEFINE_RANGE(attend_range_bf16, uint16_t, uint16_t, bf16)

/* Combine the chunks' partial states of one query head and write out = sum(acc) / sum(sum). */
#define DEFINE_FINISH(NAME, T, STORE)                                                                          \
static void NAME(const float *maxes, const float *sums, const float *const *accs, int chunks, int dim,         \
                 T *out) {                                                                                     \
    float m = -INFINITY;                                                                                       \
    for (int c = 0; c < chunks; ++c) m = maxes[c] > m ? maxes[c] : m;                                          \
    float total = 0.f, w[MAX_CHUNKS + 1];                                                                      \
    for (int c = 0; c < chunks; ++c) {                                                                         \
        w[c] = sums[c] > 0.f ? expf(maxes[c] - m) : 0.f;                                                       \
        total += w[c] * sums[c];                                                                               \
    }                                                                                                          \
    const float inv = total > 0.f ? 1.f / total : 0.f;                                                         \
    for (int d = 0; d < dim; ++d) {                                                                            \
        float x = 0.f;                                                                                         \
        for (int c = 0; c < chunks; ++c) x += w[c] * accs[c][d];                                               \
        STORE(out, d, x * inv);                                                                                \
    }                                                                                                          \
}

DEFINE_FINISH(finish_f32, float, store_f32)
DEFINE_FINISH(finish_bf16, uint16_t, store_bf16)


/* Buffers on 64-byte boundaries: the compiler's vectorized reductions (softmax sums) peel to alignment, so
 * a sum's rounding would otherwise depend on where the heap put the buffer. */
static float *alloc_floats(int64_t n) {
    const size_t bytes = ((size_t)(n > 0 ? n : 1) * sizeof(float) + 63) / 64 * 64;
    return (float *)aligned_alloc(64, bytes);
}
/* Make *scores hold at least `need` floats (a thread's scratch, grown as items need); 0 when out of memory. */
static int reserve_scores(float **scores, int64_t *cap, int64_t need) {
    if (need <= *cap) return 1;
    free(*scores);
    *scores = alloc_floats(need);
    *cap = *scores != NULL ? need : 0;
    return *scores != NULL;
}

/* Scratch floats per work item of n slots: float scores [group][n], then (bf16 path) bf16 probabilities
 * [group][n rounded up to 32] starting at the next 64-byte boundary. */
#define SCORES_FLOATS(n, group) ((int64_t)(group) * ((n) + ((n) + 31) / 32 * 16) + 32)

/* Suffix length of request b: its slots after the prefix its shared-prefix group attends for it. */
static inline int64_t own_len(const int64_t *indptr, const int64_t *share_len, int b) {
    return indptr[b + 1] - indptr[b] - (share_len != NULL ? share_len[b] : 0);
}

/* Chunks per request: 1 unless (request, kv head) pairs are too few to give each thread ~4 items. */
static int choose_chunks(const int64_t *indptr, const int64_t *share_len, int batch, int num_kv_heads,
                         int threads) {
    int64_t longest = 0;
    for (int b = 0; b < batch; ++b) {
        const int64_t len = own_len(indptr, share_len, b);
        longest = len > longest ? len : longest;
    }
    const int64_t pairs = (int64_t)batch * num_kv_heads, want = 4 * (int64_t)threads;
    if (threads <= 1 || pairs >= want) return 1;
    int64_t chunks = (want + pairs - 1) / pairs;
    const int64_t by_len = longest / MIN_CHUNK;
    if (chunks > by_len) chunks = by_len;
    if (chunks > MAX_CHUNKS) chunks = MAX_CHUNKS;
    return chunks < 1 ? 1 : (int)chunks;
}

/*
 * Shared-prefix ("cascade") plan for one decode step. Requests that share a radix-cache prefix have the same
 * KV slots at the start of their index lists. Requests whose lists begin with the same >= min_shared slots
 * form groups of at most max_members (members x heads per kv head query rows must fit MAX_GROUP); the
 * kernel attends each group's common prefix once for all its members' queries, reading those K/V rows once
 * instead of once per member, and each member then attends only its own suffix; the partial softmax states
 * are merged as the chunks of a split request are.
 *
 * Fills share_len[b] (the prefix b's group attends for it; 0 when b is in no group), group_ptr[0..groups]
 * and members: group g is members[group_ptr[g] .. group_ptr[g+1]), all sharing the first share_len slots of
 * its first member's list. Returns the number of groups (-1 when memory runs out: then no sharing).
 * Room needed: share_len and members [batch], group_ptr [batch / 2 + 1].
 */
typedef struct {
    int64_t first_slot;
    int b;
} SlotKey;

static int compare_slot_keys(const void *x, const void *y) {
    const SlotKey *a = (const SlotKey *)x, *b = (const SlotKey *)y;
    if (a->first_slot != b->first_slot) return a->first_slot < b->first_slot ? -1 : 1;
    return a->b - b->b;
}

KERNEL_API int plan_shared_prefixes(const int64_t *indptr, const int64_t *indices, int batch, int max_members,
                                    int64_t min_shared, int64_t *share_len, int *group_ptr, int *members) {
    for (int b = 0; b < batch; ++b) share_len[b] = 0;
    group_ptr[0] = 0;
    if (max_members < 2 || batch < 2) return 0;
    SlotKey *keys = (SlotKey *)malloc(sizeof(SlotKey) * (size_t)batch);
    if (keys == NULL) return -1;
    int n = 0;
    for (int b = 0; b < batch; ++b)
        if (indptr[b + 1] - indptr[b] >= min_shared) keys[n++] = (SlotKey){indices[indptr[b]], b};
    qsort(keys, (size_t)n, sizeof(SlotKey), compare_slot_keys);
    int groups = 0, used = 0;
    for (int s = 0; s < n;) {
        int e = s + 1;
        while (e < n && keys[e].first_slot == keys[s].first_slot) ++e;
        const int run = e - s, parts = (run + max_members - 1) / max_members; /* balanced sub-groups */
        for (int p = 0; p < parts; ++p) {
            const int g0 = s + run * p / parts, g1 = s + run * (p + 1) / parts;
            if (g1 - g0 < 2) continue;
            const int leader = keys[g0].b;
            const int64_t *lead = indices + indptr[leader];
            int64_t shared = indptr[leader + 1] - indptr[leader];
            for (int j = g0 + 1; j < g1; ++j) {
                const int b = keys[j].b;
                const int64_t *own = indices + indptr[b], len = indptr[b + 1] - indptr[b];
                int64_t common = 0, limit = shared < len ? shared : len;
                while (common < limit && own[common] == lead[common]) ++common;
                shared = common;
            }
            if (shared < min_shared) continue;
            for (int j = g0; j < g1; ++j) {
                members[used++] = keys[j].b;
                share_len[keys[j].b] = shared;
            }
            group_ptr[++groups] = used;
        }
        s = e;
    }
    free(keys);
    return groups;
}

/* Entry point. Query b's heads start at q + b * q_stride (heads contiguous); out is [B, Hq, D]. k_new/v_new/
 * out_loc may be NULL (no KV write); otherwise request b's new K/V heads (contiguous, starting at
 * b * k_new_stride and b * v_new_stride) are stored at pool row out_loc[b] before any attention reads.
 * share_len/group_ptr/members/groups: a plan from plan_shared_prefixes for these indices, or NULL/0.
 * logit_cap > 0 soft-caps every scaled score, s -> logit_cap * tanh(s / logit_cap) (Gemma 2); 0: none.
 * Work items: first (group, kv head) for each shared prefix, then (request, kv head, chunk of its suffix).
 * Returns 0, or -1 when a buffer cannot be allocated (the output is then not written). */
#define DEFINE_KERNEL(NAME, T, TKV, RANGE, FINISH, STORE_KV)                                                  \
KERNEL_API int NAME(const T *q, int64_t q_stride, TKV *k, TKV *v, const int64_t *indptr, const int64_t *indices, \
                    T *out,                                                                                    \
         int batch, int num_heads, int num_kv_heads, int head_dim, int64_t rows, float scale, float logit_cap,  \
         int threads, const T *k_new, int64_t k_new_stride, const T *v_new, int64_t v_new_stride,               \
         const int64_t *out_loc, const int64_t *share_len, const int *group_ptr, const int *members, int groups) { \
    const int group = num_heads / num_kv_heads;                                                                \
    if (groups <= 0) { share_len = NULL; groups = 0; }                                                         \
    if (k_new != NULL) {                                                                                       \
        for (int b = 0; b < batch; ++b)                                                                        \
            for (int h = 0; h < num_kv_heads; ++h) {                                                           \
                const int64_t dst = ((int64_t)h * rows + out_loc[b]) * head_dim;                               \
                STORE_KV(k + dst, k_new + (int64_t)b * k_new_stride + (int64_t)h * head_dim, head_dim);        \
                STORE_KV(v + dst, v_new + (int64_t)b * v_new_stride + (int64_t)h * head_dim, head_dim);        \
            }                                                                                                  \
    }                                                                                                          \
    const int chunks = choose_chunks(indptr, share_len, batch, num_kv_heads, threads);                         \
    const int64_t per_state = (int64_t)group * (2 + head_dim);                                                 \
    const int64_t own_items = (int64_t)batch * num_kv_heads * chunks;                                          \
    const int64_t shared_items = (int64_t)groups * num_kv_heads;                                               \
    /* per item: group maxes + sums, and group x dim accumulators; then one shared state per (b, kv head) */  \
    float *state = alloc_floats((own_items + (groups ? (int64_t)batch * num_kv_heads : 0)) * per_state);      \
    if (state == NULL) return -1;                                                                              \
    float *shared_state = state + own_items * per_state;                                                       \
    int failed = 0;                                                                                            \
    const int use_amx = amx_usable((int)sizeof(TKV), head_dim);                                                 \
    const int64_t kv_row_bytes = (int64_t)head_dim * (int64_t)sizeof(TKV);                                     \
    const int bulk = attn_bulk_bytes > 0 &&                                                                    \
                     (indptr[batch] - indptr[0]) * num_kv_heads * 2 * kv_row_bytes <= attn_bulk_bytes;        \
    _Pragma("omp parallel num_threads(threads)")                                                               \
    {                                                                                                          \
        int64_t cap = 0;                                                                                       \
        float *scores = NULL;                                                                                  \
        if (bulk)                                                                                              \
            bulk_prefetch_kv((const char *)k, (const char *)v, rows * kv_row_bytes, kv_row_bytes, indptr,      \
                             indices, batch, num_kv_heads, omp_get_thread_num(), omp_get_num_threads());       \
        if (use_amx) amx_begin();                                                                              \
        _Pragma("omp for schedule(dynamic, 1)")                                                                \
        for (int64_t item = 0; item < shared_items + own_items; ++item) {                                      \
            if (item < shared_items) { /* a group's common prefix, for all its members' query rows */          \
                const int gi = (int)(item / num_kv_heads), h = (int)(item % num_kv_heads);                    \
                const int first = group_ptr[gi], count = group_ptr[gi + 1] - first;                           \
                const int lead = members[first];                                                               \
                const int64_t n = share_len[lead];                                                             \
                if (!reserve_scores(&scores, &cap, SCORES_FLOATS(n, count * group))) { failed = 1; continue; } \
                T qrows[MAX_GROUP * MAX_DIM] __attribute__((aligned(64)));                                     \
                float acc[MAX_GROUP * MAX_DIM] __attribute__((aligned(64)));                                   \
                for (int j = 0; j < count; ++j)                                                                \
                    memcpy(qrows + (int64_t)j * group * head_dim,                                              \
                           q + (int64_t)members[first + j] * q_stride + (int64_t)h * group * head_dim,         \
                           sizeof(T) * (size_t)group * head_dim);                                              \
                Partial part;                                                                                  \
                part.acc = acc;                                                                                \
                part.cap = logit_cap;                                                                          \
                RANGE(qrows, k + (int64_t)h * rows * head_dim, v + (int64_t)h * rows * head_dim,               \
                      indices + indptr[lead], n, count * group, head_dim, scale, scores, &part);               \
                for (int j = 0; j < count; ++j) {                                                              \
                    float *st = shared_state + ((int64_t)members[first + j] * num_kv_heads + h) * per_state;   \
                    memcpy(st, part.max + j * group, sizeof(float) * group);                                   \
                    memcpy(st + group, part.sum + j * group, sizeof(float) * group);                           \
                    memcpy(st + 2 * group, acc + (int64_t)j * group * head_dim,                                \
                           sizeof(float) * (size_t)group * head_dim);                                          \
                }                                                                                              \
                continue;                                                                                      \
            }                                                                                                  \
            const int64_t own = item - shared_items;                                                           \
            const int c = (int)(own % chunks);                                                                 \
            const int h = (int)((own / chunks) % num_kv_heads);                                                \
            const int b = (int)(own / ((int64_t)chunks * num_kv_heads));                                       \
            const int64_t skip = share_len != NULL ? share_len[b] : 0, len = own_len(indptr, share_len, b);     \
            const int64_t per = (len + chunks - 1) / chunks;                                                   \
            const int64_t lo = c * per < len ? c * per : len, hi = lo + per < len ? lo + per : len;            \
            float *st = state + own * per_state;                                                               \
            Partial part;                                                                                      \
            part.acc = st + 2 * group;                                                                         \
            part.cap = logit_cap;                                                                              \
            if (!reserve_scores(&scores, &cap, SCORES_FLOATS(hi - lo, group))) { failed = 1; continue; }       \
            RANGE(q + (int64_t)b * q_stride + (int64_t)h * group * head_dim,                                   \
                  k + (int64_t)h * rows * head_dim, v + (int64_t)h * rows * head_dim,                          \
                  indices + indptr[b] + skip + lo, hi - lo, group, head_dim, scale, scores, &part);            \
            memcpy(st, part.max, sizeof(float) * group);                                                       \
            memcpy(st + group, part.sum, sizeof(float) * group);                                               \
        }                                                                                                      \
        free(scores);                                                                                          \
        if (use_amx) amx_end();                                                                                \
        _Pragma("omp for schedule(static)")                                                                    \
        for (int64_t bh = 0; bh < (int64_t)batch * num_kv_heads; ++bh) {                                      \
            float maxes[MAX_CHUNKS + 1], sums[MAX_CHUNKS + 1];                                                 \
            const float *accs[MAX_CHUNKS + 1];                                                                 \
            const int64_t b = bh / num_kv_heads, h = bh % num_kv_heads;                                        \
            const int parts = chunks + (share_len != NULL && share_len[b] > 0);                                \
            for (int g = 0; g < group; ++g) {                                                                  \
                for (int c = 0; c < parts; ++c) { /* the own chunks, then the shared prefix's state */         \
                    const float *st = c < chunks ? state + (bh * chunks + c) * per_state                       \
                                                 : shared_state + bh * per_state;                              \
                    maxes[c] = st[g];                                                                          \
                    sums[c] = st[group + g];                                                                   \
                    accs[c] = st + 2 * group + (int64_t)g * head_dim;                                          \
                }                                                                                              \
                FINISH(maxes, sums, accs, parts, head_dim, out + (b * num_heads + h * group + g) * head_dim);  \
            }                                                                                                  \
        }                                                                                                      \
    }                                                                                                          \
    free(state);                                                                                               \
    return failed ? -1 : 0;                                                                                    \
}

/* the new K/V row stored as it is (the pool has the activations' dtype) */
#define COPY_KV_ROW(dst, src, n) memcpy((dst), (src), sizeof(*(dst)) * (size_t)(n))

DEFINE_KERNEL(paged_decode_attention_f32, float, float, attend_range_f32, finish_f32, COPY_KV_ROW)
DEFINE_KERNEL(paged_decode_attention_bf16, uint16_t, uint16_t, attend_range_bf16, finish_bf16, COPY_KV_ROW)

KERNEL_API int kernel_limits(int *max_group, int *max_dim) {
    *max_group = MAX_GROUP;
    *max_dim = MAX_DIM;
    return 0;
}
