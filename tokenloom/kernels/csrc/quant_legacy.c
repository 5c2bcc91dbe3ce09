/*
 * GGUF legacy types Q4_0, Q4_1, Q8_0 (32-element blocks) for csrc/quant_gemm.c: same-size re-layout, exact
 * dequantize, and AVX512-VNNI dot kernels against int8 activations (quant_common.h).
 *
 * File blocks: Q4_0 {f16 d; u8 qs[16]} (qs[j] low nibble = element j, high nibble = element j + 16;
 * w = d * (q - 8)); Q4_1 {f16 d; f16 m; u8 qs[16]} (w = d * q + m); Q8_0 {f16 d; i8 qs[32]} (w = d * q).
 *
 * Re-laid-out matrix of n rows (nb = k / 32 blocks a row, same byte count), quants and scales apart, so that
 * vector loads see only quants or only scales (legacy_view):
 *     Q4_0: qs[n][nb][16] | d[n][nb] (f16)                  (qs: see below)
 *     Q4_1: qs[n][nb][16] | d[n][nb] (f16) | m[n][nb] (f16)
 *     Q8_0: u[n][nb][32]  | d[n][nb] (f16)                  (u = q + 128: vpdpbusd wants unsigned weight bytes)
 * With all quants first, a row's quants start on a 32-byte boundary whenever nb is even (the tensor itself on
 * a 64-byte one): with each row's scales in front of its quants, SmolLM2's k = 576 Q4_1 rows (360 bytes) began
 * their quants at 8-byte offsets, and every 64-byte load split across two cache lines (a load whose halves
 * each stay inside a line costs nothing extra on Zen 4; at an 8-byte offset the same stream ran 1.18x slower).
 * Decode step 0.962x at batch 1 (twice) and 0.982x at batch 64 against the row-by-row layout
 * (`bench/ab_decode.py`, SmolLM2 Q4_1).
 * Q4 quants are interleaved by groups of blocks: every full span of 16 blocks, then at most one group each of
 * 8, 4, 2 and 1 blocks (the binary digits of the rest; k = 576: one span and a group of 2). In a group of g
 * blocks, byte 4 g L + 4 i + t is byte 4 L + t of its block i (L, t = 0..3), so that a 64-byte vector of a span
 * holds one 32-bit lane per block (`q4_block_bytes` reads any group).
 *
 * Dot product, full spans: lane i of the four 64-byte quant vectors of a span belongs to block i, so vpdpbusd
 * over the low nibbles (elements 4 L .. 4 L + 3 of each block) and the high ones (16 + 4 L ..) against the
 * activations in the same order leaves block i's whole integer dot product in lane i: one conversion and one
 * multiply-add with the span's scale vector d_w * d_x per span, no permutes (against the four groups of the
 * file order: decode step 0.977x at batch 1 and ~0.9x at batch 4 on SmolLM2 Q4_1, `bench/ab_decode.py`; many
 * rows unchanged). The caller reorders the activations once per call (tl_act_q8.lanes, q4_lanes_order; the
 * kernels read no other order). The smaller groups after the last span (q4_group_dot) work alike: each lane
 * belongs to one block, and the scale vector repeats the group's g scales across the 16 lanes (broadcast
 * loads); a group of 2 or 1 puts its low and high nibbles in one vector, so k = 576's tail is one vpdpbusd per
 * activation row (it was two 64-byte vpdpbusd on half-empty vectors and a vpermps per group: decode step
 * 0.973x at batch 1, 0.965x at batch 4, `bench/ab_decode.py`). Integer sums are exact, so the order of the
 * vpdpbusd chains does not change a result.
 * Q8_0 quants are interleaved alike in every full span of 16 blocks (the blocks after the last span keep the
 * file order): byte 64 V + 4 i + t of a span is byte 4 V + t of its block i (V = 0..7), so lane i of each of
 * the span's eight 64-byte vectors belongs to block i, the eight vpdpbusd of an activation row chain into one
 * int32 vector, and the span costs one conversion and one multiply-add per output (the file order paid a
 * conversion, a vpermps and a multiply-add per 64 bytes). Q8_0's kernels regroup the activations to match
 * themselves (q8_regroup, once per span and activation row: in the stream's prepared buffer, or per tile), so
 * its callers make no other order (a MoE layer may mix Q4 and Q8_0 experts over one activation order).
 * The weight offset goes through the activation block sums s, on the same span vectors: Q4_0 adds
 * (d_w d_x) * (-8 s), Q4_1 adds m_w * (d_x s), Q8_0 adds (d_w d_x) * (-128 s). A tile is 16 weight rows x 1
 * activation row or 8 x 2 (16 accumulators), ended by one batched horizontal sum (reduce16).
 *
 * A tile reads its NR rows side by side (NR short streams, one row apart), which the hardware prefetchers
 * follow poorly: each load also asks for the same bytes one tile further on (`tl_quant_prefetch_tiles`), the
 * rows the next tile reads. Measured at one row of activations on weights in memory: 1.2-1.7x faster per call
 * (bench/quant_gemm.py --prefetch-ab), a SmolLM2 Q8_0 decode step 9.5 -> 5.7 ms, the ~1B Q8_0 step 68 -> 47 ms.
 * The prefetches fill L2, not L1 (`tl_quant_prefetch_l2`, quant_common.h).
 *
 * Dequantize is exact: every product d * q (11-bit by <= 8-bit integer) is exact in float32, so the results
 * equal the gguf package's bit for bit (with or without FMA contraction).
 */
#include "quant_common.h"
#include "bf16_common.h"
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__F16C__)
#include <immintrin.h>
#define HAVE_QUANT_LEGACY 1
#else
#define HAVE_QUANT_LEGACY 0
#endif

#if HAVE_QUANT_LEGACY
static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* ---- the matrix layout ---- */

/* A re-laid-out legacy matrix of n rows (or a view of it from some row on): row r's quants at q + r * q_stride,
 * its d scales at d + r * s_stride and (Q4_1) its m scales at m + r * s_stride (the header comment). */
typedef struct {
    const uint8_t *q, *d, *m;
    int64_t q_stride, s_stride;
} legacy_mat;

/* The matrix w [n rows of k columns] of kind 0 (Q4_0), 1 (Q4_1) or 2 (Q8_0), viewed from row r (m: the d
 * scales again where the type has no m, so that no pointer leaves the matrix). */
static inline legacy_mat legacy_view(const int kind, const uint8_t *w, int64_t n, int64_t k, int64_t r) {
    const int64_t nb = k / TL_QK, qs = (kind == 2 ? 32 : 16) * nb, ss = 2 * nb;
    const uint8_t *d = w + n * qs + r * ss;
    const legacy_mat v = {w + r * qs, d, kind == 1 ? d + n * ss : d, qs, ss};
    return v;
}

/* The same matrix from `rows` rows further on. */
static inline legacy_mat legacy_advance(const legacy_mat *v, int64_t rows) {
    const legacy_mat u = {v->q + rows * v->q_stride, v->d + rows * v->s_stride, v->m + rows * v->s_stride,
                          v->q_stride, v->s_stride};
    return u;
}

/* ---- re-layout (load time) ---- */

/* Largest row the in-place re-layout handles (its copy lives on the stack; quant_repack checks): k = 61680 for
 * Q8_0, far beyond any model's hidden or intermediate size. */
#define LEGACY_MAX_ROW_BYTES 65536

/* Moves the per-block scale fields (`fields` f16 values at each block's start) to the row's front, field by
 * field, then the quants; `flip` adds 128 to every quant byte (Q8_0: int8 q ^ 0x80 == q + 128 as uint8). */
static void legacy_repack(uint8_t *row, int64_t k, int block_size, int fields, int flip) {
    const int64_t nb = k / TL_QK, qbytes = block_size - 2 * fields;
    uint8_t tmp[LEGACY_MAX_ROW_BYTES];
    if (nb * block_size > LEGACY_MAX_ROW_BYTES) return;
    memcpy(tmp, row, (size_t)(nb * block_size));
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *src = tmp + b * block_size;
        for (int f = 0; f < fields; ++f) memcpy(row + (f * nb + b) * 2, src + 2 * f, 2);
        uint8_t *dst = row + 2 * fields * nb + b * qbytes;
        for (int64_t i = 0; i < qbytes; ++i) dst[i] = (uint8_t)(src[2 * fields + i] ^ (flip ? 0x80 : 0));
    }
}

/* The interleave group of block b in a Q4 row of nb blocks: its first block (returned) and its size *g. The
 * groups are every full span of 16 blocks, then at most one group each of 8, 4, 2 and 1 blocks, largest first
 * (the binary digits of the blocks left after the spans). */
static inline int64_t q4_group_of(int64_t nb, int64_t b, int *g) {
    const int64_t full = nb / 16 * 16;
    *g = 16;
    if (b < full) return b - b % 16;
    int64_t b0 = full;
    for (int size = 8; size >= 1; size /= 2)
        if ((nb - full) & size) {
            *g = size;
            if (b < b0 + size) break;
            b0 += size;
        }
    return b0;
}

/* Interleaves the quants of every group of g Q4 blocks (qs: the row's quants, file order): block i's bytes
 * 4 L .. 4 L + 3 go to the group's bytes 4 g L + 4 i .. (the header comment). */
static void q4_interleave(uint8_t *qs, int64_t nb) {
    uint8_t group[256];
    for (int64_t b0 = 0; b0 < nb;) {
        int g;
        q4_group_of(nb, b0, &g);
        uint8_t *at = qs + 16 * b0;
        for (int i = 0; i < g; ++i)
            for (int L = 0; L < 4; ++L) memcpy(group + 4 * g * L + 4 * i, at + 16 * i + 4 * L, 4);
        memcpy(at, group, (size_t)(16 * g));
        b0 += g;
    }
}

/* Interleaves the quants of every full span of 16 Q8_0 blocks (qs: the row's quants, file order): block i's
 * bytes 4 V .. 4 V + 3 go to the span's bytes 64 V + 4 i .. (the header comment); the rest stay. */
static void q8_interleave(uint8_t *qs, int64_t nb) {
    uint8_t span[512];
    for (int64_t b0 = 0; b0 + 16 <= nb; b0 += 16) {
        uint8_t *at = qs + 32 * b0;
        for (int i = 0; i < 16; ++i)
            for (int V = 0; V < 8; ++V) memcpy(span + 64 * V + 4 * i, at + 32 * i + 4 * V, 4);
        memcpy(at, span, sizeof span);
    }
}

/* Block b's 32 quant bytes in the file's order, from a re-laid-out Q8_0 row's quants `qs` (nb blocks). */
static inline void q8_block_bytes(const uint8_t *qs, int64_t nb, int64_t b, uint8_t out[32]) {
    if (b >= nb / 16 * 16) {
        memcpy(out, qs + 32 * b, 32);
        return;
    }
    const uint8_t *at = qs + 32 * (b - b % 16) + 4 * (b % 16);
    for (int V = 0; V < 8; ++V) memcpy(out + 4 * V, at + 64 * V, 4);
}

/* The whole matrix data [n rows of k columns]: each row re-laid out (legacy_repack; its quants interleaved),
 * then every row's quants gathered at the front and every row's scale fields after them, field by field
 * (legacy_view). -1 when the copy cannot be allocated. */
static int legacy_repack_matrix(uint8_t *data, int64_t n, int64_t k, int block_size, int fields, const int q4) {
    const int64_t nb = k / TL_QK, row_bytes = nb * block_size, scale_bytes = 2 * fields * nb;
    const int64_t quant_bytes = row_bytes - scale_bytes;
    uint8_t *copy = malloc((size_t)(n * row_bytes));
    if (copy == NULL) return -1;
    for (int64_t r = 0; r < n; ++r) {
        uint8_t *row = data + r * row_bytes;
        legacy_repack(row, k, block_size, fields, !q4);
        if (q4)
            q4_interleave(row + scale_bytes, nb);
        else
            q8_interleave(row + scale_bytes, nb);
    }
    memcpy(copy, data, (size_t)(n * row_bytes));
    for (int64_t r = 0; r < n; ++r) {
        memcpy(data + r * quant_bytes, copy + r * row_bytes + scale_bytes, (size_t)quant_bytes);
        for (int f = 0; f < fields; ++f)
            memcpy(data + n * quant_bytes + (f * n + r) * 2 * nb, copy + r * row_bytes + f * 2 * nb, (size_t)(2 * nb));
    }
    free(copy);
    return 0;
}

static int q4_0_repack(uint8_t *data, int64_t n, int64_t k) { return legacy_repack_matrix(data, n, k, 18, 1, 1); }
static int q4_1_repack(uint8_t *data, int64_t n, int64_t k) { return legacy_repack_matrix(data, n, k, 20, 2, 1); }
static int q8_0_repack(uint8_t *data, int64_t n, int64_t k) { return legacy_repack_matrix(data, n, k, 34, 1, 0); }

/* ---- exact dequantize of a re-laid-out row ---- */

/* Block b's 16 quant bytes in the file's order, from a re-laid-out Q4 row's quants `qs` (nb blocks). */
static inline __m128i q4_block_bytes(const uint8_t *qs, int64_t nb, int64_t b) {
    int g;
    const int64_t b0 = q4_group_of(nb, b, &g);
    const uint8_t *at = qs + 16 * b0 + 4 * (b - b0);
    int32_t w[4];
    for (int L = 0; L < 4; ++L) memcpy(w + L, at + 4 * g * L, 4);
    return _mm_loadu_si128((const __m128i *)w);
}

/* 16 nibbles of one half of a Q4 block as float: low (shift 0) or high (shift 4) nibbles of its 16 bytes. */
static inline __m512 q4_half(__m128i bytes, int shift) {
    const __m512i v = _mm512_cvtepu8_epi32(bytes);
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, shift), _mm512_set1_epi32(15)));
}

static void q4_0_dequant(const uint8_t *w, int64_t n, int64_t r, int64_t k, float *out) {
    const int64_t nb = k / TL_QK;
    const legacy_mat R = legacy_view(0, w, n, k, r);
    const uint8_t *qs = R.q;
    const __m512 eight = _mm512_set1_ps(8.0f);
    for (int64_t b = 0; b < nb; ++b) {
        const __m512 d = _mm512_set1_ps(h2f(R.d + 2 * b));
        /* d * (q - 8): q - 8 is exact, the product exact in float32 */
        const __m128i bytes = q4_block_bytes(qs, nb, b);
        _mm512_storeu_ps(out + 32 * b, _mm512_mul_ps(d, _mm512_sub_ps(q4_half(bytes, 0), eight)));
        _mm512_storeu_ps(out + 32 * b + 16, _mm512_mul_ps(d, _mm512_sub_ps(q4_half(bytes, 4), eight)));
    }
}

static void q4_1_dequant(const uint8_t *w, int64_t n, int64_t r, int64_t k, float *out) {
    const int64_t nb = k / TL_QK;
    const legacy_mat R = legacy_view(1, w, n, k, r);
    const uint8_t *qs = R.q;
    for (int64_t b = 0; b < nb; ++b) {
        const __m512 d = _mm512_set1_ps(h2f(R.d + 2 * b)), m = _mm512_set1_ps(h2f(R.m + 2 * b));
        /* d * q is exact, so a fused multiply-add rounds the same as gguf's (d * q) + m */
        const __m128i bytes = q4_block_bytes(qs, nb, b);
        _mm512_storeu_ps(out + 32 * b, _mm512_add_ps(_mm512_mul_ps(d, q4_half(bytes, 0)), m));
        _mm512_storeu_ps(out + 32 * b + 16, _mm512_add_ps(_mm512_mul_ps(d, q4_half(bytes, 4)), m));
    }
}

static void q8_0_dequant(const uint8_t *w, int64_t n, int64_t r, int64_t k, float *out) {
    const int64_t nb = k / TL_QK;
    const legacy_mat R = legacy_view(2, w, n, k, r);
    const uint8_t *qs = R.q;
    const __m512i flip = _mm512_set1_epi32(128);
    for (int64_t b = 0; b < nb; ++b) {
        const __m512 d = _mm512_set1_ps(h2f(R.d + 2 * b));
        uint8_t bytes[32];
        q8_block_bytes(qs, nb, b, bytes);
        for (int h = 0; h < 2; ++h) {
            const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(bytes + 16 * h)));
            _mm512_storeu_ps(out + 32 * b + 16 * h, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(u, flip))));
        }
    }
}

/* ---- dequantize straight to bf16 (the matmul tile of bf16 activations) ---- */

/* bf16 of each weight, as rounding the float32 dequantize would give (round to nearest even). Q4: the
 * block's 16 possible values d * q (+ m) go into a table (exact products, one rounding for + m, as in the
 * float32 path), and one vpermw looks all 32 nibbles up. */
static inline __attribute__((always_inline)) void q4_dequant_bf16(const uint8_t *w, int64_t n, int64_t r, int64_t k,
                                                                  uint16_t *out, const int is_q4_1) {
    const int64_t nb = k / TL_QK;
    const legacy_mat R = legacy_view(is_q4_1, w, n, k, r);
    const uint8_t *qs = R.q;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 q_off = is_q4_1 ? iota : _mm512_sub_ps(iota, _mm512_set1_ps(8.0f));
    const __m256i low = _mm256_set1_epi16(15);
    for (int64_t b = 0; b < nb; ++b) {
        const __m512 d = _mm512_set1_ps(h2f(R.d + 2 * b));
        const __m512 vals = is_q4_1 ? _mm512_add_ps(_mm512_mul_ps(d, q_off), _mm512_set1_ps(h2f(R.m + 2 * b)))
                                    : _mm512_mul_ps(d, q_off);
        const __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(vals));
        const __m256i w16 = _mm256_cvtepu8_epi16(q4_block_bytes(qs, nb, b));
        const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(w16, low)),
                                               _mm256_srli_epi16(w16, 4), 1);
        _mm512_storeu_si512(out + 32 * b, _mm512_permutexvar_epi16(idx, table));
    }
}

static void q4_0_dequant_bf16(const uint8_t *w, int64_t n, int64_t r, int64_t k, uint16_t *out) {
    q4_dequant_bf16(w, n, r, k, out, 0);
}
static void q4_1_dequant_bf16(const uint8_t *w, int64_t n, int64_t r, int64_t k, uint16_t *out) {
    q4_dequant_bf16(w, n, r, k, out, 1);
}

static void q8_0_dequant_bf16(const uint8_t *w, int64_t n, int64_t r, int64_t k, uint16_t *out) {
    const int64_t nb = k / TL_QK;
    const legacy_mat R = legacy_view(2, w, n, k, r);
    const uint8_t *qs = R.q;
    const __m512i flip = _mm512_set1_epi32(128);
    for (int64_t b = 0; b < nb; ++b) {
        const __m512 d = _mm512_set1_ps(h2f(R.d + 2 * b));
        __m512 v[2];
        uint8_t bytes[32];
        q8_block_bytes(qs, nb, b, bytes);
        for (int h = 0; h < 2; ++h) {
            const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(bytes + 16 * h)));
            v[h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(u, flip)));
        }
        _mm512_storeu_si512(out + 32 * b, (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]));
    }
}

/* ---- dot kernels ---- */

/* A tile is NR weight rows x MR activation rows (NR * MR <= 16 outputs, one accumulator each), walked over K in
 * spans of 16 blocks (512 elements). Per span and output, the 16 block scales d_w * d_x are computed once in
 * one vector and parked on the stack; each group of blocks then picks its lanes' scales out of it with one
 * vpermps (the stack copy is its memory operand). The offset term rides on the same vectors. At the end one
 * batched horizontal sum (reduce16) turns the 16 accumulators into 16 outputs. */
#define LEGACY_MAX_OUT 16

/* Per-block scales of a span for every output, and the offset term. kind 0: Q4_0, 1: Q4_1, 2: Q8_0. */
static inline __attribute__((always_inline)) void span_scales(const int kind, const legacy_mat *T,
                                                              const int NR, const int MR, const tl_act_q8 *a,
                                                              int64_t r0, int64_t nb, int64_t b, __mmask16 mask,
                                                              int64_t ahead, __m512 *acc, __m512 *p) {
    __m512 dx[4], tx[4];
    for (int j = 0; j < MR; ++j) {
        const int64_t o = (r0 + j) * nb + b;
        dx[j] = _mm512_maskz_loadu_ps(mask, a->d + o);
        const __m512 s = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(mask, a->s + o));
        /* Q4_1: m_w * (d_x s); Q4_0 / Q8_0: (d_w d_x) * (-8 s or -128 s) */
        tx[j] = kind == 1 ? _mm512_mul_ps(dx[j], s) : _mm512_mul_ps(s, _mm512_set1_ps(kind == 0 ? -8.0f : -128.0f));
    }
    const int64_t ahead_s = ahead / T->q_stride * T->s_stride; /* the same rows ahead in the scales */
    for (int r = 0; r < NR; ++r) {
        const uint8_t *d = T->d + r * T->s_stride, *m = T->m + r * T->s_stride;
        if (ahead) {
            TL_QUANT_PREFETCH(d + 2 * b + ahead_s);
            if (kind == 1) TL_QUANT_PREFETCH(m + 2 * b + ahead_s);
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, d + 2 * b));
        const __m512 mw = kind == 1 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, m + 2 * b)) : dw;
        for (int j = 0; j < MR; ++j) {
            const __m512 pj = _mm512_mul_ps(dw, dx[j]);
            p[r * MR + j] = pj;
            acc[r * MR + j] = _mm512_fmadd_ps(kind == 1 ? mw : pj, tx[j], acc[r * MR + j]);
        }
    }
}

/* The activation bytes of 4-byte unit u of a group of g interleaved Q4 blocks, in the order its kernel reads them
 * (q4_lanes_dot, q4_group_dot): block *i, elements *e .. *e + 3. g >= 4: 64-byte vector v = 2 V + h pairs quant
 * vector V's low (h = 0) or high (h = 1) nibbles, lane by lane; g <= 2: the group's low nibbles, then its high
 * ones, in one vector. */
static inline void q4_act_unit(int g, int u, int *i, int *e) {
    int h, unit; /* unit: the 4-byte quant unit the activations meet */
    if (g >= 4) {
        h = (u / 16) % 2;
        unit = 16 * (u / 32) + u % 16;
    } else {
        h = u / (4 * g);
        unit = u % (4 * g);
    }
    *i = unit % g;
    *e = 16 * h + 4 * (unit / g);
}

/* Activation rows [rows][k] in the interleaved order (tl_act_q8.lanes), group by group (q4_group_of): a full
 * span's 64-byte vector 2 L + h holds, in lane i, elements 16 h + 4 L .. 16 h + 4 L + 3 of block i; the smaller
 * groups as q4_act_unit says. Every Q4 caller of the dot kernels makes it (once per call). */
static void q4_lanes_order(const int8_t *q, int64_t rows, int64_t k, int8_t *out) {
    const int64_t nb = k / TL_QK;
    for (int64_t r = 0; r < rows; ++r) {
        const int8_t *src = q + r * k;
        int8_t *dst = out + r * k;
        int64_t b0 = 0;
        for (; b0 + 16 <= nb; b0 += 16) /* full spans: vector v = 2 L + h, lane i */
            for (int i = 0; i < 16; ++i)
                for (int v = 0; v < 8; ++v)
                    memcpy(dst + 32 * b0 + 64 * v + 4 * i, src + 32 * (b0 + i) + 16 * (v & 1) + 4 * (v >> 1), 4);
        while (b0 < nb) {
            int g, i, e;
            q4_group_of(nb, b0, &g);
            for (int u = 0; u < 8 * g; ++u) {
                q4_act_unit(g, u, &i, &e);
                memcpy(dst + 32 * b0 + 4 * u, src + 32 * (b0 + i) + e, 4);
            }
            b0 += g;
        }
    }
}

/* The span's activation vectors of row r (from `lanes`). */
static inline __attribute__((always_inline)) void q4_lanes_row(const tl_act_q8 *a, int64_t r, int64_t b,
                                                              __m512i *xv) {
    const int8_t *at = a->lanes + r * a->k + 32 * b;
    for (int v = 0; v < 8; ++v) xv[v] = _mm512_loadu_si512(at + 64 * v);
}

/* Lane i: block i's integer dot product over a full span of interleaved quants (src) against MR activation
 * rows' vectors (xv[j], as q4_lanes_order lays them out), into dot[j]; four vpdpbusd chains per activation row
 * keep the unit busy. */
static inline __attribute__((always_inline)) void q4_lanes_dot(const uint8_t *src, const int MR,
                                                              const __m512i *const *xv, int64_t ahead, __m512i *dot) {
    const __m512i low = _mm512_set1_epi8(15);
    __m512i c[4][4];
    for (int j = 0; j < MR; ++j)
        for (int t = 0; t < 4; ++t) c[j][t] = _mm512_setzero_si512();
    for (int L = 0; L < 4; ++L) {
        if (ahead) TL_QUANT_PREFETCH(src + 64 * L + ahead);
        const __m512i q = _mm512_loadu_si512(src + 64 * L);
        const __m512i lo = _mm512_and_si512(q, low), hi = tl_high_nibbles(q);
        for (int j = 0; j < MR; ++j) {
            c[j][2 * (L & 1)] = _mm512_dpbusd_epi32(c[j][2 * (L & 1)], lo, xv[j][2 * L]);
            c[j][2 * (L & 1) + 1] = _mm512_dpbusd_epi32(c[j][2 * (L & 1) + 1], hi, xv[j][2 * L + 1]);
        }
    }
    for (int j = 0; j < MR; ++j)
        dot[j] = _mm512_add_epi32(_mm512_add_epi32(c[j][0], c[j][1]), _mm512_add_epi32(c[j][2], c[j][3]));
}

/* One group of g = 8, 4, 2 or 1 interleaved Q4 blocks (the blocks after the last full span) of one weight row
 * (src: the group's quants, dw: its f16 scales) against MR activation rows (xa[j]: the group's activations in
 * q4_lanes_order's order, dx[j]: their block scales): lane l's integer dot product belongs to one block, whose
 * d_w d_x scales it into acc[j]. The scale vectors repeat the group's g scales across the 16 lanes (broadcasts,
 * no permutes); g <= 2 puts the low and the high nibbles in one vector (one vpdpbusd per activation row). */
static inline __attribute__((always_inline)) void q4_group_dot(const int g, const uint8_t *src, const uint8_t *dw,
                                                              const int MR, const int8_t *const *xa,
                                                              const float *const *dx, int64_t ahead, __m512 *acc) {
    const __m512i low = _mm512_set1_epi8(15);
    __m512i wq[4];
    __m512 dwv;
    if (ahead) TL_QUANT_PREFETCH(src + ahead);
    if (g == 8) {
        if (ahead) TL_QUANT_PREFETCH(src + 64 + ahead);
        for (int V = 0; V < 2; ++V) {
            const __m512i q = _mm512_loadu_si512(src + 64 * V);
            wq[2 * V] = _mm512_and_si512(q, low);
            wq[2 * V + 1] = tl_high_nibbles(q);
        }
        dwv = _mm512_cvtph_ps(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)dw)));
    } else if (g == 4) {
        const __m512i q = _mm512_loadu_si512(src);
        wq[0] = _mm512_and_si512(q, low);
        wq[1] = tl_high_nibbles(q);
        int64_t d4;
        memcpy(&d4, dw, 8);
        dwv = _mm512_cvtph_ps(_mm256_set1_epi64x(d4));
    } else if (g == 2) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)src), low8 = _mm256_set1_epi8(15);
        wq[0] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(q, low8)),
                                   _mm256_and_si256(_mm256_srli_epi16(q, 4), low8), 1);
        int32_t d2;
        memcpy(&d2, dw, 4);
        dwv = _mm512_cvtph_ps(_mm256_set1_epi32(d2));
    } else {
        const __m128i q = _mm_loadu_si128((const __m128i *)src), low4 = _mm_set1_epi8(15);
        wq[0] = _mm512_zextsi256_si512(_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low4), _mm_and_si128(q, low4)));
        dwv = _mm512_set1_ps(h2f(dw));
    }
    for (int j = 0; j < MR; ++j) {
        __m512i dot;
        __m512 dxv;
        if (g == 8) {
            const __m512i d0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[0],
                                                                       _mm512_loadu_si512(xa[j])),
                                                   wq[2], _mm512_loadu_si512(xa[j] + 128));
            const __m512i d1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[1],
                                                                       _mm512_loadu_si512(xa[j] + 64)),
                                                   wq[3], _mm512_loadu_si512(xa[j] + 192));
            dot = _mm512_add_epi32(d0, d1);
            dxv = _mm512_broadcast_f32x8(_mm256_loadu_ps(dx[j]));
        } else if (g == 4) {
            dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[0], _mm512_loadu_si512(xa[j])),
                                      wq[1], _mm512_loadu_si512(xa[j] + 64));
            dxv = _mm512_broadcast_f32x4(_mm_loadu_ps(dx[j]));
        } else if (g == 2) {
            dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[0], _mm512_loadu_si512(xa[j]));
            double d2;
            memcpy(&d2, dx[j], 8);
            dxv = _mm512_castpd_ps(_mm512_set1_pd(d2));
        } else {
            dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[0],
                                      _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)xa[j])));
            dxv = _mm512_set1_ps(dx[j][0]);
        }
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dwv, dxv), acc[j]);
    }
}

/* The groups after the last full span (nblk < 16 blocks from block b, q4_group_of) of one weight row (qs: its
 * quants, ds: its f16 scales) against MR activation rows from r0: q4_group_dot, group by group. */
static inline __attribute__((always_inline)) void q4_tail_groups(const uint8_t *qs, const uint8_t *ds, int64_t b,
                                                                int nblk, const int MR, const tl_act_q8 *a, int64_t r0,
                                                                int64_t ahead, __m512 *acc) {
    const int64_t nb = a->k / TL_QK;
    const int8_t *xa[4];
    const float *dx[4];
#define Q4_TAIL_GROUP(G)                                                                                        \
    if (nblk & (G)) {                                                                                           \
        for (int j = 0; j < MR; ++j) {                                                                          \
            xa[j] = a->lanes + (r0 + j) * a->k + 32 * b;                                                        \
            dx[j] = a->d + (r0 + j) * nb + b;                                                                   \
        }                                                                                                       \
        q4_group_dot((G), qs + 16 * b, ds + 2 * b, MR, xa, dx, ahead, acc);                                     \
        b += (G);                                                                                               \
    }
    Q4_TAIL_GROUP(8)
    Q4_TAIL_GROUP(4)
    Q4_TAIL_GROUP(2)
    Q4_TAIL_GROUP(1)
#undef Q4_TAIL_GROUP
}

/* One span (16 blocks, or the last `nblk` with masks when MASKED) of a Q4 tile. */
static inline __attribute__((always_inline)) void q4_span(const int kind, const legacy_mat *T, const int NR,
                                                          const int MR, const tl_act_q8 *a, int64_t r0, int64_t b,
                                                          const int MASKED, int nblk, int64_t ahead, __m512 *acc) {
    const int64_t nb = a->k / TL_QK;
    const __mmask16 mask = MASKED ? (__mmask16)((1u << nblk) - 1u) : (__mmask16)0xFFFF;
    __m512 p[LEGACY_MAX_OUT];
    span_scales(kind, T, NR, MR, a, r0, nb, b, mask, ahead, acc, p);
    if (!MASKED) { /* a full span: the interleaved layout */
        __m512i xa[4][8];
        const __m512i *xv[4];
        for (int j = 0; j < MR; ++j) {
            q4_lanes_row(a, r0 + j, b, xa[j]);
            xv[j] = xa[j];
        }
        for (int r = 0; r < NR; ++r) {
            __m512i dot[4];
            q4_lanes_dot(T->q + r * T->q_stride + 16 * b, MR, xv, ahead, dot);
            for (int j = 0; j < MR; ++j)
                acc[r * MR + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[j]), p[r * MR + j], acc[r * MR + j]);
        }
        return;
    }
    for (int r = 0; r < NR; ++r) /* the blocks after the last full span: their interleave groups */
        q4_tail_groups(T->q + r * T->q_stride, T->d + r * T->s_stride, b, nblk, MR, a, r0, ahead, acc + r * MR);
}

/* A full span of natural-order activations (16 blocks at xq) in the interleaved Q8_0 order: x[V] lane i holds
 * bytes 4 V .. 4 V + 3 of block i (a 16 x 8 transpose of 4-byte units: per pair of natural vectors one
 * vpermt2d per half of V, then a 4 x 4 transpose of 128-bit lanes; 24 shuffles). */
static inline __attribute__((always_inline)) void q8_regroup(const int8_t *xq, __m512i x[8]) {
    /* half h: lane W - 4h of each vpermt2d holds dword W of the pair's four blocks */
    const __m512i idx[2] = {_mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27),
                            _mm512_setr_epi32(4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31)};
    for (int h = 0; h < 2; ++h) {
        __m512i t[4];
        for (int p = 0; p < 4; ++p)
            t[p] = _mm512_permutex2var_epi32(_mm512_loadu_si512(xq + 128 * p), idx[h], _mm512_loadu_si512(xq + 128 * p + 64));
        const __m512i u0 = _mm512_shuffle_i32x4(t[0], t[1], 0x44), u1 = _mm512_shuffle_i32x4(t[0], t[1], 0xEE);
        const __m512i u2 = _mm512_shuffle_i32x4(t[2], t[3], 0x44), u3 = _mm512_shuffle_i32x4(t[2], t[3], 0xEE);
        x[4 * h] = _mm512_shuffle_i32x4(u0, u2, 0x88);
        x[4 * h + 1] = _mm512_shuffle_i32x4(u0, u2, 0xDD);
        x[4 * h + 2] = _mm512_shuffle_i32x4(u1, u3, 0x88);
        x[4 * h + 3] = _mm512_shuffle_i32x4(u1, u3, 0xDD);
    }
}

/* Lane i: block i's integer dot product over a full span of interleaved Q8_0 quants (src) against MR activation
 * rows' regrouped vectors (xv[j]), into dot[j]; two vpdpbusd chains per activation row. */
static inline __attribute__((always_inline)) void q8_lanes_dot(const uint8_t *src, const int MR,
                                                              const __m512i *const *xv, int64_t ahead, __m512i *dot) {
    __m512i c[4][2];
    for (int j = 0; j < MR; ++j) c[j][0] = c[j][1] = _mm512_setzero_si512();
    for (int V = 0; V < 8; ++V) {
        if (ahead) TL_QUANT_PREFETCH(src + 64 * V + ahead);
        const __m512i u = _mm512_loadu_si512(src + 64 * V);
        for (int j = 0; j < MR; ++j) c[j][V & 1] = _mm512_dpbusd_epi32(c[j][V & 1], u, xv[j][V]);
    }
    for (int j = 0; j < MR; ++j) dot[j] = _mm512_add_epi32(c[j][0], c[j][1]);
}

/* One span of a Q8_0 tile (quants stored + 128). A full span: the interleaved layout (q8_lanes_dot); the blocks
 * after the last one (file order): two blocks per 64-byte vector, lanes 0..7 and 8..15. */
static inline __attribute__((always_inline)) void q8_span(const legacy_mat *T, const int NR, const int MR,
                                                          const tl_act_q8 *a, int64_t r0, int64_t b, const int MASKED,
                                                          int nblk, int64_t ahead, __m512 *acc) {
    const int64_t k = a->k, nb = k / TL_QK;
    const __mmask16 mask = MASKED ? (__mmask16)((1u << nblk) - 1u) : (__mmask16)0xFFFF;
    __m512 p[LEGACY_MAX_OUT];
    span_scales(2, T, NR, MR, a, r0, nb, b, mask, ahead, acc, p);
    if (!MASKED) { /* a full span: the interleaved layout; else the blocks after the last one, two a vector */
        __m512i xs[4][8], dot[4];
        const __m512i *xv[4];
        for (int j = 0; j < MR; ++j) {
            q8_regroup(a->q + (r0 + j) * k + 32 * b, xs[j]);
            xv[j] = xs[j];
        }
        for (int r = 0; r < NR; ++r) {
            q8_lanes_dot(T->q + r * T->q_stride + 32 * b, MR, xv, ahead, dot);
            for (int j = 0; j < MR; ++j)
                acc[r * MR + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[j]), p[r * MR + j], acc[r * MR + j]);
        }
        return;
    }
    const int pairs = (nblk + 1) / 2;
    for (int v = 0; v < pairs; ++v) {
        const __m512i idx = _mm512_add_epi32(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                                             _mm512_set1_epi32(2 * v));
        const __mmask64 mq = nblk - 2 * v >= 2 ? ~(__mmask64)0 : (((__mmask64)1 << 32) - 1);
        __m512i x[4];
        for (int j = 0; j < MR; ++j) {
            const int8_t *xq = a->q + (r0 + j) * k + 32 * (b + 2 * v);
            x[j] = _mm512_maskz_loadu_epi8(mq, xq);
        }
        for (int r = 0; r < NR; ++r) {
            const uint8_t *src = T->q + r * T->q_stride + 32 * (b + 2 * v);
            if (ahead) TL_QUANT_PREFETCH(src + ahead);
            const __m512i u = _mm512_maskz_loadu_epi8(mq, src);
            for (int j = 0; j < MR; ++j) {
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, x[j]);
                acc[r * MR + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(idx, p[r * MR + j]),
                                                  acc[r * MR + j]);
            }
        }
    }
}

/* NR weight rows (from w) x MR activation rows (from r0): out[j * out_stride + r]. */
static inline __attribute__((always_inline)) void legacy_tile(const int kind, const legacy_mat *T, const int NR,
                                                              const int MR, const tl_act_q8 *a, int64_t r0, float *out,
                                                              int64_t out_stride) {
    const int64_t nb = a->k / TL_QK;
    __m512 acc[LEGACY_MAX_OUT];
    for (int i = 0; i < NR * MR; ++i) acc[i] = _mm512_setzero_ps();
    /* the next tile's rows follow this one's: ask for them while this one computes (quant bytes ahead) */
    const int64_t ahead = NR > 1 ? tl_quant_prefetch_tiles * NR * T->q_stride : 0;
    int64_t b = 0;
    for (; b + 16 <= nb; b += 16) {
        if (kind == 2)
            q8_span(T, NR, MR, a, r0, b, 0, 16, ahead, acc);
        else
            q4_span(kind, T, NR, MR, a, r0, b, 0, 16, ahead, acc);
    }
    if (b < nb) {
        if (kind == 2)
            q8_span(T, NR, MR, a, r0, b, 1, (int)(nb - b), ahead, acc);
        else
            q4_span(kind, T, NR, MR, a, r0, b, 1, (int)(nb - b), ahead, acc);
    }
    __m512 slots[16];
    for (int t = 0; t < 16; ++t) slots[REDUCE16_SLOT(t)] = t < NR * MR ? acc[t] : _mm512_setzero_ps();
    float sums[16];
    _mm512_storeu_ps(sums, reduce16(slots)); /* lane t: output t = (weight row t / MR, activation row t % MR) */
    for (int r = 0; r < NR; ++r)
        for (int j = 0; j < MR; ++j) out[j * out_stride + r] = sums[r * MR + j];
}

/* ---- the row-sequential stream ----
 *
 * A tile reads its NR rows side by side, NR short runs inside each 4 KiB page (SmolLM2's rows are 360-1632 B),
 * which the hardware prefetchers, following one run per page, lose: read alone, such a pattern moves 15-23
 * GB/s on the Zen 4 EPYC, one run per thread 28-30 (a read microbenchmark, 512 MB, two threads). So for rows
 * shorter than a page the tile walks its rows one after another instead (the same accumulators, the same
 * batched horizontal sum), and what its rows shared (the activations' scale vectors per span, the Q4 regroup
 * of their quants) is prepared once per dot_rows call (a chunk of 16 weight rows) into a stack buffer and
 * read back from L1 by every row of it. */
#define LEGACY_SEQ_VECS 1024 /* 64 KiB of prepared activations */
#define LEGACY_SEQ_PAGE 4096 /* the stream runs for rows shorter than this (bytes) */
#define LEGACY_SEQ_AHEAD 4096 /* its software prefetch distance (x tl_quant_prefetch_tiles), bytes */

/* Vectors per (activation row, span): d_x and the offset term's vector, then (a full span) its eight
 * activation vectors in the kernel's order (Q4: from a->lanes; Q8_0: q8_regroup); the blocks after the last full
 * span read a->lanes (Q4) or a->q (Q8_0). */
#define LEGACY_SEQ_STRIDE 10

/* Activation row r, span s at prep[(r * spans + s) * stride]: everything span_scales and q4_span compute per
 * activation row, once. */
static void legacy_seq_prep(const int kind, const tl_act_q8 *a, __m512 *prep) {
    const int64_t k = a->k, nb = k / TL_QK, spans = (nb + 15) / 16;
    const int stride = LEGACY_SEQ_STRIDE;
    for (int r = 0; r < a->m; ++r)
        for (int64_t sp = 0; sp < spans; ++sp) {
            const int64_t b = 16 * sp;
            const int nblk = nb - b < 16 ? (int)(nb - b) : 16;
            const __mmask16 mask = (__mmask16)((1u << nblk) - 1u);
            __m512 *p = prep + (r * spans + sp) * stride;
            const int64_t o = (int64_t)r * nb + b;
            const __m512 dx = _mm512_maskz_loadu_ps(mask, a->d + o);
            const __m512 sum = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(mask, a->s + o));
            p[0] = dx;
            p[1] = kind == 1 ? _mm512_mul_ps(dx, sum) : _mm512_mul_ps(sum, _mm512_set1_ps(kind == 0 ? -8.0f : -128.0f));
            if (nblk < 16) continue; /* a full span: the interleaved layout's vectors */
            if (kind == 2)
                q8_regroup(a->q + (int64_t)r * k + 32 * b, (__m512i *)(p + 2));
            else
                q4_lanes_row(a, r, b, (__m512i *)(p + 2));
        }
}

/* One span of one weight row against MR prepared activation rows (from r0): q4_span / q8_span's arithmetic. */
static inline __attribute__((always_inline)) void legacy_seq_span(const int kind, const legacy_mat *R, const int MR,
                                                                  const tl_act_q8 *a, const __m512 *prep,
                                                                  int64_t spans, int r0, int64_t b, const int MASKED,
                                                                  int nblk, int64_t ahead, int64_t ahead_s,
                                                                  __m512 *acc) {
    const int64_t k = a->k;
    const int stride = LEGACY_SEQ_STRIDE;
    const __mmask16 mask = MASKED ? (__mmask16)((1u << nblk) - 1u) : (__mmask16)0xFFFF;
    const __m512 *pr[4];
    for (int j = 0; j < MR; ++j) pr[j] = prep + ((r0 + j) * spans + b / 16) * stride;
    if (ahead) {
        TL_QUANT_PREFETCH(R->d + 2 * b + ahead_s);
        if (kind == 1) TL_QUANT_PREFETCH(R->m + 2 * b + ahead_s);
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, R->d + 2 * b));
    const __m512 mw = kind == 1 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, R->m + 2 * b)) : dw;
    __m512 p[4];
    for (int j = 0; j < MR; ++j) {
        p[j] = _mm512_mul_ps(dw, pr[j][0]);
        acc[j] = _mm512_fmadd_ps(kind == 1 ? mw : p[j], pr[j][1], acc[j]);
    }
    if (!MASKED) { /* a full span: the interleaved layout */
        __m512i dot[4];
        const __m512i *xv[4];
        for (int j = 0; j < MR; ++j) xv[j] = (const __m512i *)(pr[j] + 2);
        if (kind == 2)
            q8_lanes_dot(R->q + 32 * b, MR, xv, ahead, dot);
        else
            q4_lanes_dot(R->q + 16 * b, MR, xv, ahead, dot);
        for (int j = 0; j < MR; ++j) acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[j]), p[j], acc[j]);
        return;
    }
    if (kind == 2) {
        const int pairs = (nblk + 1) / 2;
        for (int v = 0; v < pairs; ++v) {
            const __m512i idx = _mm512_add_epi32(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                                                 _mm512_set1_epi32(2 * v));
            const __mmask64 mq = nblk - 2 * v >= 2 ? ~(__mmask64)0 : (((__mmask64)1 << 32) - 1);
            const uint8_t *src = R->q + 32 * (b + 2 * v);
            if (ahead) TL_QUANT_PREFETCH(src + ahead);
            const __m512i u = _mm512_maskz_loadu_epi8(mq, src);
            for (int j = 0; j < MR; ++j) {
                const int8_t *xq = a->q + (int64_t)(r0 + j) * k + 32 * (b + 2 * v);
                const __m512i x = _mm512_maskz_loadu_epi8(mq, xq);
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, x);
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(idx, p[j]), acc[j]);
            }
        }
        return;
    }
    q4_tail_groups(R->q, R->d, b, nblk, MR, a, r0, ahead, acc); /* the blocks after the last full span */
}

/* legacy_tile's outputs with its NR rows read one after another. */
static inline __attribute__((always_inline)) void legacy_seq_tile(const int kind, const legacy_mat *T, const int NR,
                                                                  const int MR, const tl_act_q8 *a,
                                                                  const __m512 *prep, int r0, float *out,
                                                                  int64_t out_stride) {
    const int64_t nb = a->k / TL_QK, spans = (nb + 15) / 16;
    const int64_t ahead = (int64_t)tl_quant_prefetch_tiles * LEGACY_SEQ_AHEAD; /* quant bytes */
    const int64_t ahead_s = ahead / T->q_stride * T->s_stride;                  /* the same rows in the scales */
    __m512 acc[LEGACY_MAX_OUT];
    for (int i = 0; i < NR * MR; ++i) acc[i] = _mm512_setzero_ps();
    /* unrolled, so that the accumulators stay in registers: with the Q4 tail groups' code in it the loop
     * outgrew GCC's own unrolling, and the accumulators went to the stack (0.87x per call in cache) */
    _Pragma("GCC unroll 16")
    for (int r = 0; r < NR; ++r) {
        const legacy_mat R = legacy_advance(T, r);
        int64_t b = 0;
        for (; b + 16 <= nb; b += 16)
            legacy_seq_span(kind, &R, MR, a, prep, spans, r0, b, 0, 16, ahead, ahead_s, acc + r * MR);
        if (b < nb) legacy_seq_span(kind, &R, MR, a, prep, spans, r0, b, 1, (int)(nb - b), ahead, ahead_s, acc + r * MR);
    }
    __m512 slots[16];
    for (int t = 0; t < 16; ++t) slots[REDUCE16_SLOT(t)] = t < NR * MR ? acc[t] : _mm512_setzero_ps();
    float sums[16];
    _mm512_storeu_ps(sums, reduce16(slots));
    for (int r = 0; r < NR; ++r)
        for (int j = 0; j < MR; ++j) out[j * out_stride + r] = sums[r * MR + j];
}

/* legacy_dot's bands over the stream; 0 when it does not apply (rows of a page or more: the tiles' runs then
 * lie in pages of their own; or prepared activations beyond the buffer). */
static inline __attribute__((always_inline)) int legacy_seq_dot(const int kind, const legacy_mat *M, int64_t row_bytes,
                                                                int64_t n0, int64_t n1, const tl_act_q8 *a,
                                                                float *out, int64_t out_stride) {
    const int64_t spans = (a->k / TL_QK + 15) / 16;
    if (a->m > tl_quant_seq_max_m || row_bytes >= LEGACY_SEQ_PAGE ||
        spans * a->m * LEGACY_SEQ_STRIDE > LEGACY_SEQ_VECS)
        return 0;
    __m512 prep[LEGACY_SEQ_VECS];
    legacy_seq_prep(kind, a, prep);
    int64_t j = n0;
    if (a->m == 1) {
        for (; j + 16 <= n1; j += 16) {
            const legacy_mat T = legacy_advance(M, j);
            legacy_seq_tile(kind, &T, 16, 1, a, prep, 0, out + (j - n0), 0);
        }
    } else {
        for (; j + 8 <= n1; j += 8) {
            const legacy_mat T = legacy_advance(M, j);
            int r = 0;
            for (; r + 2 <= a->m; r += 2)
                legacy_seq_tile(kind, &T, 8, 2, a, prep, r, out + r * out_stride + (j - n0), out_stride);
            if (r < a->m) legacy_seq_tile(kind, &T, 8, 1, a, prep, r, out + r * out_stride + (j - n0), out_stride);
        }
    }
    for (; j < n1; ++j) { /* the last few rows: one row, every activation row */
        const legacy_mat T = legacy_advance(M, j);
        for (int r = 0; r < a->m; ++r)
            legacy_seq_tile(kind, &T, 1, 1, a, prep, r, out + r * out_stride + (j - n0), out_stride);
    }
    return 1;
}

/* Every activation row against NR weight rows: one band when m == 1 (NR = 16), else bands of 2 (NR = 8). */
static inline __attribute__((always_inline)) void legacy_dot(const int kind, const uint8_t *w, int64_t n,
                                                             int64_t row_bytes, int64_t n0, int64_t n1,
                                                             const tl_act_q8 *a, float *out, int64_t out_stride) {
    const legacy_mat M = legacy_view(kind, w, n, a->k, 0);
    if (legacy_seq_dot(kind, &M, row_bytes, n0, n1, a, out, out_stride)) return;
    int64_t j = n0;
    if (a->m == 1) {
        for (; j + 16 <= n1; j += 16) {
            const legacy_mat T = legacy_advance(&M, j);
            legacy_tile(kind, &T, 16, 1, a, 0, out + (j - n0), 0);
        }
    } else {
        for (; j + 8 <= n1; j += 8) {
            const legacy_mat T = legacy_advance(&M, j);
            int64_t r = 0;
            for (; r + 2 <= a->m; r += 2)
                legacy_tile(kind, &T, 8, 2, a, r, out + r * out_stride + (j - n0), out_stride);
            if (r < a->m) legacy_tile(kind, &T, 8, 1, a, r, out + r * out_stride + (j - n0), out_stride);
        }
    }
    for (; j < n1; ++j) { /* the last few rows one by one */
        const legacy_mat T = legacy_advance(&M, j);
        for (int64_t r = 0; r < a->m; ++r) legacy_tile(kind, &T, 1, 1, a, r, out + r * out_stride + (j - n0), out_stride);
    }
}

static void q4_0_dot(const uint8_t *w, int64_t n, int64_t row_bytes, int64_t n0, int64_t n1, const tl_act_q8 *a,
                     float *out, int64_t out_stride) {
    legacy_dot(0, w, n, row_bytes, n0, n1, a, out, out_stride);
}
static void q4_1_dot(const uint8_t *w, int64_t n, int64_t row_bytes, int64_t n0, int64_t n1, const tl_act_q8 *a,
                     float *out, int64_t out_stride) {
    legacy_dot(1, w, n, row_bytes, n0, n1, a, out, out_stride);
}
static void q8_0_dot(const uint8_t *w, int64_t n, int64_t row_bytes, int64_t n0, int64_t n1, const tl_act_q8 *a,
                     float *out, int64_t out_stride) {
    legacy_dot(2, w, n, row_bytes, n0, n1, a, out, out_stride);
}

/* ---- unsigned quants with per-block scale and minimum (quant_common.h's tl_u8_row_fn) ---- */

/* Q4: nibbles to bytes (low nibbles are a block's elements 0..15, high ones 16..31). Q4_0: w = d q - 8 d;
 * Q4_1: w = d q + m; Q8_0: w = d u - 128 d with the re-laid-out u = q + 128. */
static inline __attribute__((always_inline)) void q4_u8(const uint8_t *w, int64_t n, int64_t r, int64_t k,
                                                        uint8_t *q, float *scale, float *min, const int is_q4_1) {
    const int64_t nb = k / TL_QK;
    const legacy_mat R = legacy_view(is_q4_1, w, n, k, r);
    const uint8_t *qs = R.q;
    const __m128i low = _mm_set1_epi8(15);
    for (int64_t b = 0; b < nb; ++b) {
        const __m128i v = q4_block_bytes(qs, nb, b);
        _mm_storeu_si128((__m128i *)(q + 32 * b), _mm_and_si128(v, low));
        _mm_storeu_si128((__m128i *)(q + 32 * b + 16), _mm_and_si128(_mm_srli_epi16(v, 4), low));
        const float d = h2f(R.d + 2 * b);
        scale[b] = d;
        min[b] = is_q4_1 ? h2f(R.m + 2 * b) : -8.0f * d;
    }
}
static void q4_0_u8(const uint8_t *w, int64_t n, int64_t r, int64_t k, uint8_t *q, float *scale, float *min) {
    q4_u8(w, n, r, k, q, scale, min, 0);
}
static void q4_1_u8(const uint8_t *w, int64_t n, int64_t r, int64_t k, uint8_t *q, float *scale, float *min) {
    q4_u8(w, n, r, k, q, scale, min, 1);
}
static void q8_0_u8(const uint8_t *w, int64_t n, int64_t r, int64_t k, uint8_t *q, float *scale, float *min) {
    const int64_t nb = k / TL_QK;
    const legacy_mat R = legacy_view(2, w, n, k, r);
    for (int64_t b = 0; b < nb; ++b) {
        q8_block_bytes(R.q, nb, b, q + 32 * b);
        scale[b] = h2f(R.d + 2 * b);
        min[b] = -128.0f * scale[b];
    }
}

static const tl_quant_type TL_LEGACY_TYPES[3] = {
    {TL_Q4_0, 32, 18, q4_0_dot, q4_0_dequant, q4_0_repack, q4_0_u8, 32},
    {TL_Q4_1, 32, 20, q4_1_dot, q4_1_dequant, q4_1_repack, q4_1_u8, 32},
    {TL_Q8_0, 32, 34, q8_0_dot, q8_0_dequant, q8_0_repack, q8_0_u8, 32},
};
#endif

/* The family's bf16 dequantize of one re-laid-out row (the driver's bf16 matmul tile), or NULL. */
typedef void (*tl_dequant_bf16_fn)(const uint8_t *w, int64_t n, int64_t r, int64_t k, uint16_t *out);

static tl_dequant_bf16_fn tl_legacy_dequant_bf16(int type) {
#if HAVE_QUANT_LEGACY && defined(__AVX512BF16__)
    switch (type) {
    case TL_Q4_0: return q4_0_dequant_bf16;
    case TL_Q4_1: return q4_1_dequant_bf16;
    case TL_Q8_0: return q8_0_dequant_bf16;
    default: break;
    }
#endif
    (void)type;
    return NULL;
}

static const tl_quant_type *tl_legacy_type(int type) {
#if HAVE_QUANT_LEGACY
    for (int i = 0; i < 3; ++i)
        if (TL_LEGACY_TYPES[i].type == type) return &TL_LEGACY_TYPES[i];
#endif
    (void)type;
    return NULL;
}
