/*
 * GGUF legacy types Q4_0, Q4_1, Q8_0 (32-element blocks) for csrc/quant_gemm.c: same-size re-layout, exact
 * dequantize, and AVX512-VNNI dot kernels against int8 activations (quant_common.h).
 *
 * File blocks: Q4_0 {f16 d; u8 qs[16]} (qs[j] low nibble = element j, high nibble = element j + 16;
 * w = d * (q - 8)); Q4_1 {f16 d; f16 m; u8 qs[16]} (w = d * q + m); Q8_0 {f16 d; i8 qs[32]} (w = d * q).
 *
 * Re-laid-out matrix of n rows (nb = k / 32 blocks a row, same byte count; F = nb rounded down to a multiple of
 * 16, the full spans; T = nb - F, the tail), quants and scales apart, so that vector loads see only quants or
 * only scales (legacy_view):
 *     Q4_0: qs[n][F][16] | tail bands | d[n][F] (f16)                  (qs: see below)
 *     Q4_1: qs[n][F][16] | tail bands | d[n][F] (f16) | m[n][F] (f16)
 *     Q8_0: u[n][F][32]  | tail bands | d[n][F] (f16)                  (u = q + 128: vpdpbusd wants unsigned bytes)
 * With all quants first, a row's quants start on a 64-byte boundary (the tensor itself on a 64-byte one): with
 * each row's scales in front of its quants, SmolLM2's k = 576 Q4_1 rows (360 bytes) began their quants at
 * 8-byte offsets, and every 64-byte load split across two cache lines (a load whose halves each stay inside a
 * line costs nothing extra on Zen 4; at an 8-byte offset the same stream ran 1.18x slower). Decode step 0.962x
 * at batch 1 (twice) and 0.982x at batch 64 against the row-by-row layout (`bench/ab_decode.py`, SmolLM2 Q4_1).
 * Full spans are interleaved: byte 64 U + 4 i + t of a span is byte 4 U + t of its block i (U = 0..3 for Q4,
 * 0..7 for Q8_0), so that each 64-byte vector of a span holds one 32-bit lane per block.
 * The tail (k = 576: 2 blocks) lies in bands of 16 rows (the last band: the rows left), lane = row: a band of
 * `lanes` rows holds its 4-byte units (unit U = 4 t + L of Q4 tail block t: its bytes 4 L .. 4 L + 3; Q8_0:
 * U = 8 t + V) unit by unit, each for every row of the band in turn, then its d scales block by block for
 * every row, then (Q4_1) its m scales alike (legacy_band_of).
 *
 * Dot product, full spans: lane i of a span's 64-byte quant vectors belongs to block i, so vpdpbusd over the
 * low nibbles (elements 4 L .. 4 L + 3 of each block) and the high ones (16 + 4 L ..) against the activations
 * in the same order leaves block i's whole integer dot product in lane i: one conversion and one multiply-add
 * with the span's scale vector d_w * d_x per span, no permutes (against the four groups of the file order:
 * decode step 0.977x at batch 1 and ~0.9x at batch 4 on SmolLM2 Q4_1, `bench/ab_decode.py`; many rows
 * unchanged). The caller reorders the activations once per call (tl_act_q8.lanes, q4_lanes_order). Q8_0's
 * eight vpdpbusd of a span and activation row chain into one int32 vector (the file order paid a conversion,
 * a vpermps and a multiply-add per 64 bytes); its kernels regroup the activations to match themselves
 * (q8_regroup, once per span and activation row: in the stream's prepared buffer, or per tile), so its
 * callers make no other order (a MoE layer may mix Q4 and Q8_0 experts over one activation order).
 * The tail is one pass of its own over every weight row (legacy_tail_pass): a 4-byte unit of a band's 16 rows
 * is one vector and the activations' matching 4 bytes (natural order, tl_act_q8.q) one broadcast, so each
 * block costs 4 (Q4) or 8 (Q8_0) vpdpbusd per activation row for 16 weight rows, and one conversion and one
 * multiply-add with the band's scale vector. Kept at the end of each row, k = 576's two tail blocks had cost
 * ~0.55-0.6 of a full span per weight row (their own masked scale loads and conversions, a permute per row);
 * banded, a Q4_1 1536 x 576 call at one activation row takes 21.7 us instead of 32.2 (one thread, from
 * cache), Q8_0 21.5 instead of 29.1, and the SmolLM2 Q4_1 decode step 0.951x at batch 1, 0.846x at batch 4
 * (`bench/ab_decode.py`). Integer sums are exact, so the order of the vpdpbusd chains does not change a result.
 * The weight offset goes through the activation block sums s, on the same span vectors: Q4_0 adds
 * (d_w d_x) * (-8 s), Q4_1 adds m_w * (d_x s), Q8_0 adds (d_w d_x) * (-128 s) (the tail pass adds -8 s or
 * -128 s to its exact integer sums instead). A tile is 16 weight rows x 1
 * activation row or 8 x 2 (16 accumulators), ended by one batched horizontal sum (reduce16).
 * One activation row's two int8 terms (tl_act_q8.paired, the second scaled by exactly 1/128 of the first) go
 * through the 8 x 2 tiles, the stream and the tail pass as one: the two integer dot products joined as
 * 128 dot0 + dot1 before the one conversion and multiply-add, the offset term's vector the pair's
 * (legacy_pair_scales): per span and weight row one conversion, two multiply-adds and one product fewer.
 * Measured one thread from cache: Q4_1 1536 x 576 22.2 -> 19.8 us, 576 x 1536 20.0 -> 18.2, Q8_0 1536 x 576
 * 22.2 -> 19.6.
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
#include <math.h>
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

/* A re-laid-out legacy matrix of n rows viewed from row `row` on: the full spans (the first `full` blocks of
 * a row, a multiple of 16) of row row + i at q + i * q_stride (quants), d + i * s_stride and (Q4_1)
 * m + i * s_stride (f16 scales); the `tail_blocks` blocks after them in the matrix's bands (legacy_band_of).
 * The header comment has the layout. */
typedef struct {
    const uint8_t *q, *d, *m;
    int64_t q_stride, s_stride;
    const uint8_t *tail; /* band 0 (the whole matrix's tail region) */
    int64_t row, n, full, tail_blocks, block_q; /* block_q: quant bytes a block (16 or 32) */
    int fields;                                 /* f16 scale fields a block (Q4_1: d and m) */
} legacy_mat;

/* The matrix w [n rows of k columns] of kind 0 (Q4_0), 1 (Q4_1) or 2 (Q8_0), viewed from row r (m: the d
 * scales again where the type has no m, so that no pointer leaves the matrix). */
static inline legacy_mat legacy_view(const int kind, const uint8_t *w, int64_t n, int64_t k, int64_t r) {
    const int64_t nb = k / TL_QK, full = nb / 16 * 16, tail_blocks = nb - full, block_q = kind == 2 ? 32 : 16;
    const int fields = kind == 1 ? 2 : 1;
    const int64_t qs = block_q * full, ss = 2 * full;
    const uint8_t *tail = w + n * qs, *d = tail + n * tail_blocks * (block_q + 2 * fields);
    const legacy_mat v = {w + r * qs,  d + r * ss, (kind == 1 ? d + n * ss : d) + r * ss,
                          qs,          ss,         tail,
                          r,           n,          full,
                          tail_blocks, block_q,    fields};
    return v;
}

/* The same matrix from `rows` rows further on. */
static inline legacy_mat legacy_advance(const legacy_mat *v, int64_t rows) {
    legacy_mat u = *v;
    u.q += rows * v->q_stride;
    u.d += rows * v->s_stride;
    u.m += rows * v->s_stride;
    u.row += rows;
    return u;
}

/* One band of the tail region: rows 16 band .. 16 band + lanes - 1 (lanes = 16 but in the last band). 4-byte
 * unit U (U = 4 t + L for Q4, 8 t + V for Q8_0: bytes 4 L / 4 V on of tail block t) of the band's row l at
 * q + 4 (U lanes + l); tail block t's scales of row l at d + 2 (t lanes + l) and m + 2 (t lanes + l). */
typedef struct {
    const uint8_t *q, *d, *m;
    int lanes;
} legacy_band;

static inline legacy_band legacy_band_of(const legacy_mat *M, int64_t band) {
    const int64_t first = 16 * band, lanes = M->n - first < 16 ? M->n - first : 16;
    const uint8_t *q = M->tail + first * M->tail_blocks * (M->block_q + 2 * M->fields);
    const uint8_t *d = q + lanes * M->tail_blocks * M->block_q;
    const legacy_band b = {q, d, M->fields == 2 ? d + 2 * M->tail_blocks * lanes : d, (int)lanes};
    return b;
}

static inline int32_t load32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Scale field f (0: d, 1: m) of every block of the view's first row, as float: out[nb] (the full spans 16 at
 * a time, then the tail blocks from the row's band). */
static inline void legacy_row_scales(const legacy_mat *M, int f, float *out) {
    const uint8_t *src = f ? M->m : M->d;
    for (int64_t b = 0; b < M->full; b += 16)
        _mm512_storeu_ps(out + b, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + 2 * b))));
    if (M->tail_blocks == 0) return;
    const legacy_band B = legacy_band_of(M, M->row / 16);
    const uint8_t *tail = (f ? B.m : B.d) + 2 * (M->row % 16);
    for (int64_t t = 0; t < M->tail_blocks; ++t) out[M->full + t] = h2f(tail + 2 * t * B.lanes);
}

/* Block b's quant bytes of the view's first row in the file's order (Q8_0: its 32 bytes, stored + 128; Q4: its 16
 * bytes in the low half): a full span's byte 4 units U + 4 i + t is byte 4 U + t of its block i, a band's unit
 * U of row l lies at 4 (U lanes + l) (the header comment). */
static inline __m256i legacy_block_vec(const legacy_mat *M, int64_t b) {
    const int64_t units = M->block_q / 4;
    const uint8_t *at;
    int64_t step;
    if (b < M->full) {
        at = M->q + M->block_q * (b - b % 16) + 4 * (b % 16);
        step = 64;
    } else {
        const legacy_band B = legacy_band_of(M, M->row / 16);
        at = B.q + 4 * ((b - M->full) * units * B.lanes + M->row % 16);
        step = 4 * B.lanes;
    }
    if (units == 4)
        return _mm256_castsi128_si256(_mm_setr_epi32(load32(at), load32(at + step), load32(at + 2 * step),
                                                     load32(at + 3 * step)));
    return _mm256_setr_epi32(load32(at), load32(at + step), load32(at + 2 * step), load32(at + 3 * step),
                             load32(at + 4 * step), load32(at + 5 * step), load32(at + 6 * step),
                             load32(at + 7 * step));
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

/* Interleaves the quants of every full span of 16 blocks of block_q bytes (qs: the row's quants, file order):
 * block i's bytes 4 U .. 4 U + 3 go to the span's bytes 64 U + 4 i .. (the header comment); the rest stay. */
static void legacy_interleave(uint8_t *qs, int64_t nb, int block_q) {
    uint8_t span[512];
    for (int64_t b0 = 0; b0 + 16 <= nb; b0 += 16) {
        uint8_t *at = qs + block_q * b0;
        for (int i = 0; i < 16; ++i)
            for (int U = 0; U < block_q / 4; ++U) memcpy(span + 64 * U + 4 * i, at + block_q * i + 4 * U, 4);
        memcpy(at, span, (size_t)(16 * block_q));
    }
}

/* The whole matrix data [n rows of k columns] of kind 0, 1 or 2: each row re-laid out (legacy_repack; its
 * full spans interleaved), then every row's full spans gathered at the front, the blocks after them in bands
 * of 16 rows, and every row's full spans' scale fields last, field by field (legacy_view, legacy_band_of).
 * -1 when the copy cannot be allocated. */
static int legacy_repack_matrix(uint8_t *data, int64_t n, int64_t k, const int kind) {
    const int fields = kind == 1 ? 2 : 1, block_q = kind == 2 ? 32 : 16, units = block_q / 4;
    const int64_t nb = k / TL_QK, block_size = block_q + 2 * fields, row_bytes = nb * block_size;
    const int64_t scale_bytes = 2 * fields * nb;
    uint8_t *copy = malloc((size_t)(n * row_bytes));
    if (copy == NULL) return -1;
    for (int64_t r = 0; r < n; ++r) {
        uint8_t *row = data + r * row_bytes;
        legacy_repack(row, k, (int)block_size, fields, kind == 2);
        legacy_interleave(row + scale_bytes, nb, block_q);
    }
    memcpy(copy, data, (size_t)(n * row_bytes));
    const legacy_mat M = legacy_view(kind, data, n, k, 0);
    for (int64_t r = 0; r < n; ++r) {
        const uint8_t *src = copy + r * row_bytes;
        memcpy((uint8_t *)M.q + r * M.q_stride, src + scale_bytes, (size_t)M.q_stride);
        for (int f = 0; f < fields; ++f)
            memcpy((uint8_t *)(f ? M.m : M.d) + r * M.s_stride, src + f * 2 * nb, (size_t)M.s_stride);
        if (M.tail_blocks == 0) continue;
        const legacy_band B = legacy_band_of(&M, r / 16);
        const int l = (int)(r % 16);
        for (int64_t t = 0; t < M.tail_blocks; ++t) {
            const uint8_t *qs = src + scale_bytes + block_q * (M.full + t);
            for (int U = 0; U < units; ++U) memcpy((uint8_t *)B.q + 4 * ((t * units + U) * B.lanes + l), qs + 4 * U, 4);
            for (int f = 0; f < fields; ++f)
                memcpy((uint8_t *)(f ? B.m : B.d) + 2 * (t * B.lanes + l), src + f * 2 * nb + 2 * (M.full + t), 2);
        }
    }
    free(copy);
    return 0;
}

static int q4_0_repack(uint8_t *data, int64_t n, int64_t k) { return legacy_repack_matrix(data, n, k, 0); }
static int q4_1_repack(uint8_t *data, int64_t n, int64_t k) { return legacy_repack_matrix(data, n, k, 1); }
static int q8_0_repack(uint8_t *data, int64_t n, int64_t k) { return legacy_repack_matrix(data, n, k, 2); }

/* ---- exact dequantize of a re-laid-out row ---- */

/* Block b's 16 quant bytes in the file's order, from the view's first row. */
static inline __m128i q4_block_bytes(const legacy_mat *R, int64_t b) {
    return _mm256_castsi256_si128(legacy_block_vec(R, b));
}

/* 16 nibbles of one half of a Q4 block as float: low (shift 0) or high (shift 4) nibbles of its 16 bytes. */
static inline __m512 q4_half(__m128i bytes, int shift) {
    const __m512i v = _mm512_cvtepu8_epi32(bytes);
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, shift), _mm512_set1_epi32(15)));
}

static void q4_0_dequant(const uint8_t *w, int64_t n, int64_t r, int64_t k, float *out) {
    const int64_t nb = k / TL_QK;
    const legacy_mat R = legacy_view(0, w, n, k, r);
    float dsc[nb];
    legacy_row_scales(&R, 0, dsc);
    const __m512 eight = _mm512_set1_ps(8.0f);
    for (int64_t b = 0; b < nb; ++b) {
        const __m512 d = _mm512_set1_ps(dsc[b]);
        /* d * (q - 8): q - 8 is exact, the product exact in float32 */
        const __m128i bytes = q4_block_bytes(&R, b);
        _mm512_storeu_ps(out + 32 * b, _mm512_mul_ps(d, _mm512_sub_ps(q4_half(bytes, 0), eight)));
        _mm512_storeu_ps(out + 32 * b + 16, _mm512_mul_ps(d, _mm512_sub_ps(q4_half(bytes, 4), eight)));
    }
}

static void q4_1_dequant(const uint8_t *w, int64_t n, int64_t r, int64_t k, float *out) {
    const int64_t nb = k / TL_QK;
    const legacy_mat R = legacy_view(1, w, n, k, r);
    float dsc[nb], msc[nb];
    legacy_row_scales(&R, 0, dsc);
    legacy_row_scales(&R, 1, msc);
    for (int64_t b = 0; b < nb; ++b) {
        const __m512 d = _mm512_set1_ps(dsc[b]), m = _mm512_set1_ps(msc[b]);
        /* d * q is exact, so a fused multiply-add rounds the same as gguf's (d * q) + m */
        const __m128i bytes = q4_block_bytes(&R, b);
        _mm512_storeu_ps(out + 32 * b, _mm512_add_ps(_mm512_mul_ps(d, q4_half(bytes, 0)), m));
        _mm512_storeu_ps(out + 32 * b + 16, _mm512_add_ps(_mm512_mul_ps(d, q4_half(bytes, 4)), m));
    }
}

static void q8_0_dequant(const uint8_t *w, int64_t n, int64_t r, int64_t k, float *out) {
    const int64_t nb = k / TL_QK;
    const legacy_mat R = legacy_view(2, w, n, k, r);
    float dsc[nb];
    legacy_row_scales(&R, 0, dsc);
    const __m512i flip = _mm512_set1_epi32(128);
    for (int64_t b = 0; b < nb; ++b) {
        const __m512 d = _mm512_set1_ps(dsc[b]);
        const __m256i bytes = legacy_block_vec(&R, b);
        for (int h = 0; h < 2; ++h) {
            const __m128i half = h ? _mm256_extracti128_si256(bytes, 1) : _mm256_castsi256_si128(bytes);
            const __m512i u = _mm512_cvtepu8_epi32(half);
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
    float dsc[nb], msc[nb];
    legacy_row_scales(&R, 0, dsc);
    if (is_q4_1) legacy_row_scales(&R, 1, msc);
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 q_off = is_q4_1 ? iota : _mm512_sub_ps(iota, _mm512_set1_ps(8.0f));
    const __m256i low = _mm256_set1_epi16(15);
    for (int64_t b = 0; b < nb; ++b) {
        const __m512 d = _mm512_set1_ps(dsc[b]);
        const __m512 vals = is_q4_1 ? _mm512_add_ps(_mm512_mul_ps(d, q_off), _mm512_set1_ps(msc[b]))
                                    : _mm512_mul_ps(d, q_off);
        const __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(vals));
        const __m256i w16 = _mm256_cvtepu8_epi16(q4_block_bytes(&R, b));
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

/* A full Q8_0 span's 16 blocks in the file's order: its eight 64-byte vectors (vector U holds unit U, bytes
 * 4 U .. 4 U + 3, of every block, lane i = block i) transposed by three rounds of two-source permutes into
 * out[o] = blocks 2 o and 2 o + 1, 32 bytes each (24 permutes a span where gathering each block's eight units
 * took eight loads and seven inserts). */
static inline void q8_span_blocks(const uint8_t *span, __m512i out[8]) {
    __m512i a[8], b[8], c[8];
    for (int U = 0; U < 8; ++U) a[U] = _mm512_loadu_si512(span + 64 * U);
    /* b[2 p] / b[2 p + 1]: units 2 p, 2 p + 1 of blocks 0..7 / 8..15, one 64-bit lane a block */
    const __m512i lo1 = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi1 = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int p = 0; p < 4; ++p) {
        b[2 * p] = _mm512_permutex2var_epi32(a[2 * p], lo1, a[2 * p + 1]);
        b[2 * p + 1] = _mm512_permutex2var_epi32(a[2 * p], hi1, a[2 * p + 1]);
    }
    /* c[g] / c[g + 4]: units 0..3 / 4..7 of blocks 4 g .. 4 g + 3, one 128-bit lane a block */
    const __m512i lo2 = _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11);
    const __m512i hi2 = _mm512_setr_epi64(4, 12, 5, 13, 6, 14, 7, 15);
    for (int half = 0; half < 2; ++half) { /* units 0..3 from b[0..3], units 4..7 from b[4..7] */
        const __m512i *s = b + 4 * half;
        c[4 * half + 0] = _mm512_permutex2var_epi64(s[0], lo2, s[2]);
        c[4 * half + 1] = _mm512_permutex2var_epi64(s[0], hi2, s[2]);
        c[4 * half + 2] = _mm512_permutex2var_epi64(s[1], lo2, s[3]);
        c[4 * half + 3] = _mm512_permutex2var_epi64(s[1], hi2, s[3]);
    }
    const __m512i lo3 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const __m512i hi3 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    for (int g = 0; g < 4; ++g) {
        out[2 * g] = _mm512_permutex2var_epi64(c[g], lo3, c[g + 4]);
        out[2 * g + 1] = _mm512_permutex2var_epi64(c[g], hi3, c[g + 4]);
    }
}

/* One Q8_0 block's 32 quants (q + 128, in the file's order: two 16-byte halves) times d, rounded to bf16. */
static inline void q8_block_bf16(const __m128i q0, const __m128i q1, const float d, uint16_t *out) {
    const __m512i flip = _mm512_set1_epi32(128);
    const __m512 dv = _mm512_set1_ps(d);
    const __m512 v0 = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(q0), flip)));
    const __m512 v1 = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(q1), flip)));
    _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
}

static void q8_0_dequant_bf16(const uint8_t *w, int64_t n, int64_t r, int64_t k, uint16_t *out) {
    const int64_t nb = k / TL_QK;
    const legacy_mat R = legacy_view(2, w, n, k, r);
    float dsc[nb];
    legacy_row_scales(&R, 0, dsc);
    for (int64_t b0 = 0; b0 < R.full; b0 += 16) {
        __m512i pairs[8];
        q8_span_blocks(R.q + 32 * b0, pairs);
        for (int o = 0; o < 8; ++o) {
            const int64_t b = b0 + 2 * o;
            q8_block_bf16(_mm512_extracti32x4_epi32(pairs[o], 0), _mm512_extracti32x4_epi32(pairs[o], 1), dsc[b],
                          out + 32 * b);
            q8_block_bf16(_mm512_extracti32x4_epi32(pairs[o], 2), _mm512_extracti32x4_epi32(pairs[o], 3),
                          dsc[b + 1], out + 32 * (b + 1));
        }
    }
    const __m512i flip = _mm512_set1_epi32(128);
    for (int64_t b = R.full; b < nb; ++b) { /* the tail blocks, from the row's band */
        const __m512 d = _mm512_set1_ps(dsc[b]);
        __m512 v[2];
        const __m256i bytes = legacy_block_vec(&R, b);
        for (int h = 0; h < 2; ++h) {
            const __m128i half = h ? _mm256_extracti128_si256(bytes, 1) : _mm256_castsi256_si128(bytes);
            const __m512i u = _mm512_cvtepu8_epi32(half);
            v[h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(u, flip)));
        }
        _mm512_storeu_si512(out + 32 * b, (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]));
    }
}

/* ---- dot kernels ---- */

/* A tile is NR weight rows x MR activation rows (NR * MR <= 16 outputs, one accumulator each), walked over
 * the full spans of 16 blocks (512 elements). Per span and output, the 16 block scales d_w * d_x are one
 * vector; the offset term rides on the same vectors. At the end one batched horizontal sum (reduce16) turns
 * the 16 accumulators into 16 outputs. The blocks after the last full span are a pass of their own
 * (legacy_tail_pass). */
#define LEGACY_MAX_OUT 16
#define LEGACY_TAIL_AHEAD 2048 /* the tail pass's software prefetch distance (x tl_quant_prefetch_tiles), bytes */

/* A pair's (tl_act_q8.paired / pairs: its terms in activation rows `first` and `second`) scale vectors for the
 * span from block b: dx = the first term's d / 128, the scale of 128 dot0 + dot1, and the offset term's vector
 * for the pair: Q4_1 d0 s0 + d1 s1 (one explicit fused multiply-add, so every kernel rounds it alike), Q4_0 /
 * Q8_0 -8 or -128 times the pair's integer sum 128 s0 + s1 (exact). */
static inline __attribute__((always_inline)) void legacy_pair_scales(const int kind, const tl_act_q8 *a,
                                                                     int64_t first, int64_t second, int64_t b,
                                                                     __m512 *dx, __m512 *tx) {
    const int64_t nb = a->k / TL_QK, o0 = first * nb + b, o1 = second * nb + b;
    const __m512 d0 = _mm512_loadu_ps(a->d + o0), d1 = _mm512_loadu_ps(a->d + o1);
    const __m512i s0 = _mm512_loadu_si512(a->s + o0), s1 = _mm512_loadu_si512(a->s + o1);
    *dx = _mm512_mul_ps(d0, _mm512_set1_ps(1.0f / (1 << TL_TERM2_SHIFT)));
    if (kind == 1)
        *tx = _mm512_fmadd_ps(d1, _mm512_cvtepi32_ps(s1), _mm512_mul_ps(d0, _mm512_cvtepi32_ps(s0)));
    else
        *tx = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(s0, TL_TERM2_SHIFT), s1)),
                            _mm512_set1_ps(kind == 0 ? -8.0f : -128.0f));
}

/* A pair's two integer dot products as one: 128 dot0 + dot1 (exact in int32). */
static inline __attribute__((always_inline)) __m512i legacy_pair_dot(__m512i dot0, __m512i dot1) {
    return _mm512_add_epi32(_mm512_slli_epi32(dot0, TL_TERM2_SHIFT), dot1);
}

/* Per-block scales of the span from block b for every output, and the offset term. kind 0: Q4_0, 1: Q4_1,
 * 2: Q8_0. */
static inline __attribute__((always_inline)) void span_scales(const int kind, const legacy_mat *T,
                                                              const int NR, const int MR, const int PAIRED,
                                                              const tl_act_q8 *a, int64_t r0, int64_t nb,
                                                              int64_t b, int64_t ahead, __m512 *acc, __m512 *p) {
    __m512 dx[4], tx[4];
    if (PAIRED) {
        legacy_pair_scales(kind, a, 0, 1, b, &dx[0], &tx[0]);
    } else {
        for (int j = 0; j < MR; ++j) {
            const int64_t o = (r0 + j) * nb + b;
            dx[j] = _mm512_loadu_ps(a->d + o);
            const __m512 s = _mm512_cvtepi32_ps(_mm512_loadu_si512(a->s + o));
            /* Q4_1: m_w * (d_x s); Q4_0 / Q8_0: (d_w d_x) * (-8 s or -128 s) */
            tx[j] = kind == 1 ? _mm512_mul_ps(dx[j], s) : _mm512_mul_ps(s, _mm512_set1_ps(kind == 0 ? -8.0f : -128.0f));
        }
    }
    const int mr = PAIRED ? 1 : MR; /* outputs per weight row */
    const int64_t ahead_s = ahead / T->q_stride * T->s_stride; /* the same rows ahead in the scales */
    for (int r = 0; r < NR; ++r) {
        const uint8_t *d = T->d + r * T->s_stride, *m = T->m + r * T->s_stride;
        if (ahead) {
            TL_QUANT_PREFETCH(d + 2 * b + ahead_s);
            if (kind == 1) TL_QUANT_PREFETCH(m + 2 * b + ahead_s);
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + 2 * b)));
        const __m512 mw = kind == 1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + 2 * b))) : dw;
        for (int j = 0; j < mr; ++j) {
            const __m512 pj = _mm512_mul_ps(dw, dx[j]);
            p[r * MR + j] = pj;
            acc[r * MR + j] = _mm512_fmadd_ps(kind == 1 ? mw : pj, tx[j], acc[r * MR + j]);
        }
    }
}

/* Activation rows [rows][k] in the full spans' interleaved order (tl_act_q8.lanes): a span's 64-byte vector
 * 2 L + h holds, in lane i, elements 16 h + 4 L .. 16 h + 4 L + 3 of block i; the bytes after the last full
 * span are left unwritten (the tail pass reads tl_act_q8.q). Every Q4 caller of the dot kernels makes it
 * (once per call). */
static void q4_lanes_order(const int8_t *q, int64_t rows, int64_t k, int8_t *out) {
    const int64_t nb = k / TL_QK, full = nb / 16 * 16;
    for (int64_t r = 0; r < rows; ++r) {
        const int8_t *src = q + r * k;
        int8_t *dst = out + r * k;
        for (int64_t b0 = 0; b0 < full; b0 += 16) /* vector v = 2 L + h, lane i */
            for (int i = 0; i < 16; ++i)
                for (int v = 0; v < 8; ++v)
                    memcpy(dst + 32 * b0 + 64 * v + 4 * i, src + 32 * (b0 + i) + 16 * (v & 1) + 4 * (v >> 1), 4);
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

/* One full span (from block b) of a Q4 tile. */
static inline __attribute__((always_inline)) void q4_span(const int kind, const legacy_mat *T, const int NR,
                                                          const int MR, const int PAIRED, const tl_act_q8 *a,
                                                          int64_t r0, int64_t b, int64_t ahead, __m512 *acc) {
    const int64_t nb = a->k / TL_QK;
    __m512 p[LEGACY_MAX_OUT];
    span_scales(kind, T, NR, MR, PAIRED, a, r0, nb, b, ahead, acc, p);
    __m512i xa[4][8];
    const __m512i *xv[4];
    for (int j = 0; j < MR; ++j) {
        q4_lanes_row(a, r0 + j, b, xa[j]);
        xv[j] = xa[j];
    }
    for (int r = 0; r < NR; ++r) {
        __m512i dot[4];
        q4_lanes_dot(T->q + r * T->q_stride + 16 * b, MR, xv, ahead, dot);
        if (PAIRED) dot[0] = legacy_pair_dot(dot[0], dot[1]);
        for (int j = 0; j < (PAIRED ? 1 : MR); ++j)
            acc[r * MR + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[j]), p[r * MR + j], acc[r * MR + j]);
    }
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

/* Activation rows [rows][k] with every full span regrouped as q8_regroup does (out: the span's eight vectors at
 * 32 b + 64 V of the row; the bytes after the last full span unwritten): tl_act_q8.q8_lanes, made once per call
 * for the pair tiles. */
static void q8_lanes_order(const int8_t *q, int64_t rows, int64_t k, int8_t *out) {
    const int64_t full = k / TL_QK / 16 * 16;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < full; b += 16) {
            __m512i x[8];
            q8_regroup(q + r * k + 32 * b, x);
            for (int v = 0; v < 8; ++v) _mm512_storeu_si512(out + r * k + 32 * b + 64 * v, x[v]);
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

/* One full span (from block b) of a Q8_0 tile (quants stored + 128). */
static inline __attribute__((always_inline)) void q8_span(const legacy_mat *T, const int NR, const int MR,
                                                          const int PAIRED, const tl_act_q8 *a, int64_t r0, int64_t b,
                                                          int64_t ahead, __m512 *acc) {
    const int64_t k = a->k, nb = k / TL_QK;
    __m512 p[LEGACY_MAX_OUT];
    span_scales(2, T, NR, MR, PAIRED, a, r0, nb, b, ahead, acc, p);
    __m512i xs[4][8], dot[4];
    const __m512i *xv[4];
    for (int j = 0; j < MR; ++j) {
        q8_regroup(a->q + (r0 + j) * k + 32 * b, xs[j]);
        xv[j] = xs[j];
    }
    for (int r = 0; r < NR; ++r) {
        q8_lanes_dot(T->q + r * T->q_stride + 32 * b, MR, xv, ahead, dot);
        if (PAIRED) dot[0] = legacy_pair_dot(dot[0], dot[1]);
        for (int j = 0; j < (PAIRED ? 1 : MR); ++j)
            acc[r * MR + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[j]), p[r * MR + j], acc[r * MR + j]);
    }
}

/* The 16 accumulators of NR x MR outputs summed (reduce16) into out[j * out_stride + r]. */
static inline __attribute__((always_inline)) void legacy_store(const int NR, const int MR, const __m512 *acc,
                                                               float *out, int64_t out_stride) {
    __m512 slots[16];
    for (int t = 0; t < 16; ++t) slots[REDUCE16_SLOT(t)] = t < NR * MR ? acc[t] : _mm512_setzero_ps();
    float sums[16];
    _mm512_storeu_ps(sums, reduce16(slots)); /* lane t: output t = (weight row t / MR, activation row t % MR) */
    for (int r = 0; r < NR; ++r)
        for (int j = 0; j < MR; ++j) out[j * out_stride + r] = sums[r * MR + j];
}

/* NR weight rows (from w) x MR activation rows (from r0), their full spans: out[j * out_stride + r]. */
static inline __attribute__((always_inline)) void legacy_tile(const int kind, const legacy_mat *T, const int NR,
                                                              const int MR, const int PAIRED, const tl_act_q8 *a,
                                                              int64_t r0, float *out, int64_t out_stride) {
    __m512 acc[LEGACY_MAX_OUT];
    for (int i = 0; i < NR * MR; ++i) acc[i] = _mm512_setzero_ps();
    /* the next tile's rows follow this one's: ask for them while this one computes (quant bytes ahead) */
    const int64_t ahead = NR > 1 ? tl_quant_prefetch_tiles * NR * T->q_stride : 0;
    for (int64_t b = 0; b < T->full; b += 16) {
        if (kind == 2)
            q8_span(T, NR, MR, PAIRED, a, r0, b, ahead, acc);
        else
            q4_span(kind, T, NR, MR, PAIRED, a, r0, b, ahead, acc);
    }
    legacy_store(NR, MR, acc, out, out_stride);
}

/* ---- batched decode: several activation rows, each in its two terms (tl_act_q8.pairs > 1) ----
 *
 * The tiles above walk a span weight row by weight row, each row's vpdpbusd reading the activation vectors
 * again (from L1): as many 64-byte loads as multiplies, and one load port of that width a cycle on Zen 4. Here
 * a tile of NR weight rows x MP rows' pairs walks the span's 64-byte vectors in the outer loop: at each the
 * 2 MP activation term vectors are loaded once and serve all NR weight rows, one int32 sum per (weight row,
 * term row) over the span. Each pair's two sums then become one, 128 dot0 + dot1 (exact), before the one
 * conversion and scaling (against the few-row tiles: half the conversions, scale products and multiply-adds,
 * and each Q4 nibble unpacked once for every activation row, not once per two). Q8_0 reads its activations
 * regrouped once per call (tl_act_q8.q8_lanes), Q4 from tl_act_q8.lanes. Measured against the terms apart in
 * the 8 x 2 tiles (bench/quant_gemm.py --pairs-ab, two threads, weights from memory, Q4_1 / Q8_0 at SmolLM2's
 * and the ~1B's shapes): 0.98-1.42x at 2 rows (memory-bound there), 1.06-1.47x at 3-8; the SmolLM2 Q4_1 decode
 * step 0.89-0.95x at batch 2-8 (bench/ab_decode.py). */
#define PAIRS_NR 4 /* weight rows per tile: 4 x 4 int32 sums, 4 x 2 float accumulators, 8 activation vectors */
#define PAIRS_MP 2 /* pairs per tile (the last one alone when their count is odd) */
/* The software prefetch distance, bytes of quants: a tile of 4 short rows (SmolLM2's Q8_0 k = 576: 512 bytes of
 * full spans each) asks too close ahead with the next tile's rows alone. Measured at two rows of activations
 * from memory (bench/quant_gemm.py --copies 40): Q8_0 3072 x 576 0.090 / 0.080 / 0.069 / 0.079 ms at 4 / 6 /
 * 8 / 12 KiB ahead, against 0.093-0.100 one tile (2 KiB) ahead; the wider rows level. */
#define PAIRS_AHEAD 8192

/* NR weight rows (from T's first) x MP pairs (rows p0 .. p0 + MP - 1 and their second terms, rows a->pairs + p0
 * ..): the pairs' sums into out[p * out_stride + r], 0 into their second terms' rows. */
static inline __attribute__((always_inline)) void legacy_pairs_tile(const int kind, const legacy_mat *T, const int NR,
                                                                    const int MP, const tl_act_q8 *a, int64_t p0,
                                                                    float *out, int64_t out_stride) {
    const int64_t k = a->k, P = a->pairs, vecs = kind == 2 ? 8 : 4, block_q = kind == 2 ? 32 : 16;
    /* the rows from PAIRS_AHEAD bytes on (at least the next tile's), x tl_quant_prefetch_tiles */
    const int64_t stride = T->q_stride > 0 ? T->q_stride : 1; /* (0: no full span, nothing to read) */
    const int64_t ahead_rows = (tl_quant_prefetch_tiles * PAIRS_AHEAD + stride - 1) / stride;
    const int64_t ahead = tl_quant_prefetch_tiles ? (ahead_rows > NR ? ahead_rows : NR) * T->q_stride : 0;
    const int64_t ahead_s = ahead / stride * T->s_stride;
    const __m512i low = _mm512_set1_epi8(15);
    const int8_t *order = kind == 2 ? a->q8_lanes : a->lanes;
    const int8_t *xrow[2 * PAIRS_MP]; /* term rows: the MP first terms, then their second terms */
    for (int j = 0; j < 2 * MP; ++j) xrow[j] = order + (p0 + (j < MP ? j : P + j - MP)) * k;
    __m512 acc[PAIRS_NR * PAIRS_MP];
    for (int i = 0; i < NR * MP; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < T->full; b += 16) {
        __m512i c[PAIRS_NR][2 * PAIRS_MP];
        for (int r = 0; r < NR; ++r)
            for (int j = 0; j < 2 * MP; ++j) c[r][j] = _mm512_setzero_si512();
        for (int64_t v = 0; v < vecs; ++v) {
            __m512i xl[2 * PAIRS_MP], xh[2 * PAIRS_MP]; /* Q4: the low and high nibbles' activations; Q8_0: xl */
            for (int j = 0; j < 2 * MP; ++j) {
                xl[j] = _mm512_loadu_si512(xrow[j] + 32 * b + (kind == 2 ? 64 : 128) * v);
                if (kind != 2) xh[j] = _mm512_loadu_si512(xrow[j] + 32 * b + 128 * v + 64);
            }
            for (int r = 0; r < NR; ++r) {
                const uint8_t *src = T->q + r * T->q_stride + block_q * b + 64 * v;
                if (ahead) TL_QUANT_PREFETCH(src + ahead);
                const __m512i w = _mm512_loadu_si512(src);
                if (kind == 2) {
                    for (int j = 0; j < 2 * MP; ++j) c[r][j] = _mm512_dpbusd_epi32(c[r][j], w, xl[j]);
                } else {
                    const __m512i lo = _mm512_and_si512(w, low), hi = tl_high_nibbles(w);
                    for (int j = 0; j < 2 * MP; ++j)
                        c[r][j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(c[r][j], lo, xl[j]), hi, xh[j]);
                }
            }
        }
        __m512 dx[2], tx[2];
        for (int p = 0; p < MP; ++p) legacy_pair_scales(kind, a, p0 + p, P + p0 + p, b, &dx[p], &tx[p]);
        for (int r = 0; r < NR; ++r) {
            const uint8_t *d = T->d + r * T->s_stride + 2 * b, *m = T->m + r * T->s_stride + 2 * b;
            if (ahead) {
                TL_QUANT_PREFETCH(d + ahead_s);
                if (kind == 1) TL_QUANT_PREFETCH(m + ahead_s);
            }
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d));
            const __m512 mw = kind == 1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)m)) : dw;
            for (int p = 0; p < MP; ++p) {
                const __m512 pj = _mm512_mul_ps(dw, dx[p]);
                __m512 *o = &acc[r * MP + p];
                *o = _mm512_fmadd_ps(kind == 1 ? mw : pj, tx[p], *o);
                *o = _mm512_fmadd_ps(_mm512_cvtepi32_ps(legacy_pair_dot(c[r][p], c[r][MP + p])), pj, *o);
            }
        }
    }
    legacy_store(NR, MP, acc, out, out_stride);
    for (int p = 0; p < MP; ++p)
        for (int r = 0; r < NR; ++r) out[(P + p) * out_stride + r] = 0.0f;
}

/* The full spans of weight rows [n0, n1) against every pair: tiles of PAIRS_NR weight rows x PAIRS_MP pairs, the
 * weight rows left one at a time. */
static inline __attribute__((always_inline)) void legacy_pairs_dot(const int kind, const legacy_mat *M, int64_t n0,
                                                                   int64_t n1, const tl_act_q8 *a, float *out,
                                                                   int64_t out_stride) {
    int64_t j = n0;
    for (; j + PAIRS_NR <= n1; j += PAIRS_NR) {
        const legacy_mat T = legacy_advance(M, j);
        int64_t p = 0;
        for (; p + PAIRS_MP <= a->pairs; p += PAIRS_MP)
            legacy_pairs_tile(kind, &T, PAIRS_NR, PAIRS_MP, a, p, out + p * out_stride + (j - n0), out_stride);
        if (p < a->pairs) legacy_pairs_tile(kind, &T, PAIRS_NR, 1, a, p, out + p * out_stride + (j - n0), out_stride);
    }
    for (; j < n1; ++j) {
        const legacy_mat T = legacy_advance(M, j);
        int64_t p = 0;
        for (; p + 2 <= a->pairs; p += 2)
            legacy_pairs_tile(kind, &T, 1, 2, a, p, out + p * out_stride + (j - n0), out_stride);
        if (p < a->pairs) legacy_pairs_tile(kind, &T, 1, 1, a, p, out + p * out_stride + (j - n0), out_stride);
    }
}

/* ---- the blocks after the last full span ----
 *
 * A row of k = 576 (SmolLM2's hidden size) is one full span and 2 blocks. Kept in each row, those 2 blocks
 * cost ~0.55-0.6 of a span per weight row (their own scale loads, conversions and multiply-adds for two
 * blocks' worth of vpdpbusd). In bands of 16 weight rows, lane = weight row, a 4-byte unit of all 16 rows
 * is one vector and the activations' matching 4 bytes one broadcast: 4 (Q4) or 8 (Q8_0) vpdpbusd per block
 * and activation row cover 16 weight rows, and one conversion and multiply-add per block scales them all. */

/* Weight rows [row0, row0 + cnt) of one band (lanes l0 .. l0 + cnt - 1) against MR activation rows from r0:
 * out[j * out_stride + i] += the tail's sum of row row0 + i; PAIRED (MR 2: activation rows r0 and r0 + second,
 * one row's two terms): the pair's sum into row 0 alone. */
static inline __attribute__((always_inline)) void legacy_tail_band(const int kind, const legacy_mat *M, int64_t row0,
                                                                   int cnt, const int MR, const int PAIRED,
                                                                   const tl_act_q8 *a, int64_t r0, int64_t second,
                                                                   int64_t ahead, float *out, int64_t out_stride) {
    const int units = kind == 2 ? 8 : 4, l0 = (int)(row0 % 16);
    const int64_t nb = a->k / TL_QK;
    const legacy_band B = legacy_band_of(M, row0 / 16);
    const __mmask16 mask = (__mmask16)(((1u << cnt) - 1u) << l0);
    const __m512i low = _mm512_set1_epi8(15);
    __m512 res[4];
    for (int j = 0; j < MR; ++j) res[j] = _mm512_setzero_ps();
    for (int64_t t = 0; t < M->tail_blocks; ++t) {
        const int64_t b = M->full + t;
        __m512i c[4][2];
        for (int j = 0; j < MR; ++j) c[j][0] = c[j][1] = _mm512_setzero_si512();
        for (int u = 0; u < units; ++u) {
            const uint8_t *src = B.q + 4 * ((t * units + u) * B.lanes);
            if (ahead) TL_QUANT_PREFETCH(src + ahead);
            const __m512i w = _mm512_maskz_loadu_epi32(mask, src);
            for (int j = 0; j < MR; ++j) {
                const int8_t *x = a->q + (r0 + (PAIRED ? j * second : j)) * a->k + 32 * b + 4 * u;
                int32_t x0, x1;
                memcpy(&x0, x, 4);
                if (kind == 2) {
                    c[j][u & 1] = _mm512_dpbusd_epi32(c[j][u & 1], w, _mm512_set1_epi32(x0));
                } else { /* unit u: elements 4 u .. in the low nibbles, 16 + 4 u .. in the high ones */
                    memcpy(&x1, x + 16, 4);
                    c[j][0] = _mm512_dpbusd_epi32(c[j][0], _mm512_and_si512(w, low), _mm512_set1_epi32(x0));
                    c[j][1] = _mm512_dpbusd_epi32(c[j][1], tl_high_nibbles(w), _mm512_set1_epi32(x1));
                }
            }
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, B.d + 2 * t * B.lanes));
        const __m512 mw = kind == 1 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, B.m + 2 * t * B.lanes)) : dw;
        __m512i dot[4];
        for (int j = 0; j < MR; ++j) {
            const int64_t o = (r0 + (PAIRED ? j * second : j)) * nb + b;
            dot[j] = _mm512_add_epi32(c[j][0], c[j][1]);
            /* Q4_0 / Q8_0: d_w d_x (dot - 8 s or - 128 s), exact in int32; Q4_1: d_w d_x dot + m_w (d_x s) */
            if (kind != 1) dot[j] = _mm512_add_epi32(dot[j], _mm512_set1_epi32(a->s[o] * (kind == 0 ? -8 : -128)));
        }
        if (PAIRED) { /* 128 (dot0 - 8 s0) + (dot1 - 8 s1), scaled by d0 / 128; Q4_1: m_w (d0 s0 + d1 s1) */
            const __m512i both = legacy_pair_dot(dot[0], dot[1]);
            const int64_t o0 = r0 * nb + b, o1 = (r0 + second) * nb + b;
            const float d0 = a->d[o0] * (1.0f / (1 << TL_TERM2_SHIFT));
            res[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(both), _mm512_mul_ps(dw, _mm512_set1_ps(d0)), res[0]);
            if (kind == 1) {
                const float ds = fmaf(a->d[o1], (float)a->s[o1], a->d[o0] * (float)a->s[o0]);
                res[0] = _mm512_fmadd_ps(mw, _mm512_set1_ps(ds), res[0]);
            }
        } else {
            for (int j = 0; j < MR; ++j) {
                const int64_t o = (r0 + j) * nb + b;
                const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a->d[o]));
                res[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[j]), scale, res[j]);
                if (kind == 1) res[j] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a->d[o] * (float)a->s[o]), res[j]);
            }
        }
    }
    const __m512i from = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(l0));
    const __mmask16 first = (__mmask16)((1u << cnt) - 1u);
    for (int j = 0; j < (PAIRED ? 1 : MR); ++j) {
        float *o = out + j * out_stride;
        const __m512 v = l0 ? _mm512_permutexvar_ps(from, res[j]) : res[j]; /* lane l0 + i to lane i */
        _mm512_mask_storeu_ps(o, first, _mm512_add_ps(_mm512_maskz_loadu_ps(first, o), v));
    }
}

/* The tail blocks of weight rows [n0, n1) against every activation row, added to out[r * out_stride + (j - n0)]
 * (the full spans' sums, already there): band by band, activation rows four at a time, or (pair_rows: the
 * full spans went through legacy_pairs_dot) each of the a->pairs rows' two terms as one. */
static inline __attribute__((always_inline)) void legacy_tail_pass(const int kind, const legacy_mat *M, int64_t n0,
                                                                   int64_t n1, const tl_act_q8 *a, int pair_rows,
                                                                   float *out, int64_t out_stride) {
    if (M->tail_blocks == 0) return;
    const int64_t ahead = (int64_t)tl_quant_prefetch_tiles * LEGACY_TAIL_AHEAD;
    for (int64_t j = n0; j < n1;) {
        const int64_t band_end = (j / 16 + 1) * 16, end = band_end < n1 ? band_end : n1;
        const int cnt = (int)(end - j);
        float *o = out + (j - n0);
        int64_t r = 0;
        if (a->paired) {
            legacy_tail_band(kind, M, j, cnt, 2, 1, a, 0, 1, ahead, o, out_stride);
        } else if (pair_rows) {
            for (; r < a->pairs; ++r)
                legacy_tail_band(kind, M, j, cnt, 2, 1, a, r, a->pairs, ahead, o + r * out_stride, out_stride);
        } else {
            for (; r + 4 <= a->m; r += 4)
                legacy_tail_band(kind, M, j, cnt, 4, 0, a, r, 0, ahead, o + r * out_stride, out_stride);
            for (; r + 2 <= a->m; r += 2)
                legacy_tail_band(kind, M, j, cnt, 2, 0, a, r, 0, ahead, o + r * out_stride, out_stride);
            if (r < a->m) legacy_tail_band(kind, M, j, cnt, 1, 0, a, r, 0, ahead, o + r * out_stride, out_stride);
        }
        j = end;
    }
}

/* ---- the row-sequential stream ----
 *
 * A tile reads its NR rows side by side, NR short runs inside each 4 KiB page (SmolLM2's rows are 360-1632 B),
 * which the hardware prefetchers, following one run per page, lose: read alone, such a pattern moves 15-23
 * GB/s on the Zen 4 EPYC, one run per thread 28-30 (a read microbenchmark, 512 MB, two threads). So for rows
 * shorter than a page the tile walks its rows one after another instead (the same accumulators, the same
 * batched horizontal sum), and what its rows shared (the activations' scale vectors per span, the Q4 regroup
 * of their quants) is prepared once per dot_rows call (a work item of weight rows) into a stack buffer and
 * read back from L1 by every row of it. */
#define LEGACY_SEQ_VECS 1024 /* 64 KiB of prepared activations */
#define LEGACY_SEQ_PAGE 4096 /* the stream runs for rows shorter than this (bytes) */
#define LEGACY_SEQ_AHEAD 4096 /* its software prefetch distance (x tl_quant_prefetch_tiles), bytes */

/* Vectors per (activation row, full span): d_x and the offset term's vector, then its eight activation vectors
 * in the kernel's order (Q4: from a->lanes; Q8_0: q8_regroup). */
#define LEGACY_SEQ_STRIDE 10

/* Activation row r, span s at prep[(r * spans + s) * stride]: everything span_scales and q4_span compute per
 * activation row, once; for a pair (tl_act_q8.paired) row 0's two scale vectors are the pair's
 * (legacy_pair_scales). */
static void legacy_seq_prep(const int kind, const tl_act_q8 *a, __m512 *prep) {
    const int64_t k = a->k, nb = k / TL_QK, spans = nb / 16;
    const int stride = LEGACY_SEQ_STRIDE;
    for (int r = 0; r < a->m; ++r)
        for (int64_t sp = 0; sp < spans; ++sp) {
            const int64_t b = 16 * sp;
            __m512 *p = prep + (r * spans + sp) * stride;
            const int64_t o = (int64_t)r * nb + b;
            const __m512 dx = _mm512_loadu_ps(a->d + o);
            const __m512 sum = _mm512_cvtepi32_ps(_mm512_loadu_si512(a->s + o));
            p[0] = dx;
            p[1] = kind == 1 ? _mm512_mul_ps(dx, sum) : _mm512_mul_ps(sum, _mm512_set1_ps(kind == 0 ? -8.0f : -128.0f));
            if (kind == 2)
                q8_regroup(a->q + (int64_t)r * k + 32 * b, (__m512i *)(p + 2));
            else
                q4_lanes_row(a, r, b, (__m512i *)(p + 2));
        }
    if (a->paired)
        for (int64_t sp = 0; sp < spans; ++sp)
            legacy_pair_scales(kind, a, 0, 1, 16 * sp, &prep[sp * stride], &prep[sp * stride + 1]);
}

/* One full span of one weight row against MR prepared activation rows (from r0): q4_span / q8_span's
 * arithmetic. */
static inline __attribute__((always_inline)) void legacy_seq_span(const int kind, const legacy_mat *R, const int MR,
                                                                  const int PAIRED, const __m512 *prep, int64_t spans,
                                                                  int r0,
                                                                  int64_t b, int64_t ahead, int64_t ahead_s,
                                                                  __m512 *acc) {
    const int stride = LEGACY_SEQ_STRIDE;
    const __m512 *pr[4];
    for (int j = 0; j < MR; ++j) pr[j] = prep + ((r0 + j) * spans + b / 16) * stride;
    if (ahead) {
        TL_QUANT_PREFETCH(R->d + 2 * b + ahead_s);
        if (kind == 1) TL_QUANT_PREFETCH(R->m + 2 * b + ahead_s);
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(R->d + 2 * b)));
    const __m512 mw = kind == 1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(R->m + 2 * b))) : dw;
    __m512 p[4];
    const int mr = PAIRED ? 1 : MR; /* outputs */
    for (int j = 0; j < mr; ++j) {
        p[j] = _mm512_mul_ps(dw, pr[j][0]);
        acc[j] = _mm512_fmadd_ps(kind == 1 ? mw : p[j], pr[j][1], acc[j]);
    }
    __m512i dot[4];
    const __m512i *xv[4];
    for (int j = 0; j < MR; ++j) xv[j] = (const __m512i *)(pr[j] + 2);
    if (kind == 2)
        q8_lanes_dot(R->q + 32 * b, MR, xv, ahead, dot);
    else
        q4_lanes_dot(R->q + 16 * b, MR, xv, ahead, dot);
    if (PAIRED) dot[0] = legacy_pair_dot(dot[0], dot[1]);
    for (int j = 0; j < mr; ++j) acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[j]), p[j], acc[j]);
}

/* legacy_tile's outputs with its NR rows read one after another. */
static inline __attribute__((always_inline)) void legacy_seq_tile(const int kind, const legacy_mat *T, const int NR,
                                                                  const int MR, const int PAIRED, const __m512 *prep,
                                                                  int r0, float *out, int64_t out_stride) {
    const int64_t spans = T->full / 16;
    const int64_t ahead = (int64_t)tl_quant_prefetch_tiles * LEGACY_SEQ_AHEAD; /* quant bytes */
    const int64_t ahead_s = ahead / T->q_stride * T->s_stride;                  /* the same rows in the scales */
    __m512 acc[LEGACY_MAX_OUT];
    for (int i = 0; i < NR * MR; ++i) acc[i] = _mm512_setzero_ps();
    _Pragma("GCC unroll 16") /* unrolled, so that the accumulators stay in registers */
    for (int r = 0; r < NR; ++r) {
        const legacy_mat R = legacy_advance(T, r);
        for (int64_t b = 0; b < T->full; b += 16)
            legacy_seq_span(kind, &R, MR, PAIRED, prep, spans, r0, b, ahead, ahead_s, acc + r * MR);
    }
    legacy_store(NR, MR, acc, out, out_stride);
}

/* legacy_dot's full spans over the stream; 0 when it does not apply (no full span; rows of a page or more: the
 * tiles' runs then lie in pages of their own; or prepared activations beyond the buffer). */
static inline __attribute__((always_inline)) int legacy_seq_dot(const int kind, const legacy_mat *M, int64_t row_bytes,
                                                                int64_t n0, int64_t n1, const tl_act_q8 *a,
                                                                float *out, int64_t out_stride) {
    const int64_t spans = M->full / 16;
    if (spans == 0 || a->m > tl_quant_seq_max_m || row_bytes >= LEGACY_SEQ_PAGE ||
        spans * a->m * LEGACY_SEQ_STRIDE > LEGACY_SEQ_VECS)
        return 0;
    __m512 prep[LEGACY_SEQ_VECS];
    legacy_seq_prep(kind, a, prep);
    int64_t j = n0;
    if (a->m == 1) {
        for (; j + 16 <= n1; j += 16) {
            const legacy_mat T = legacy_advance(M, j);
            legacy_seq_tile(kind, &T, 16, 1, 0, prep, 0, out + (j - n0), 0);
        }
    } else if (a->paired) { /* (its prepared row 0 holds the pair's scales: only the paired tiles read it) */
        for (; j + 8 <= n1; j += 8) {
            const legacy_mat T = legacy_advance(M, j);
            legacy_seq_tile(kind, &T, 8, 2, 1, prep, 0, out + (j - n0), out_stride);
        }
        for (; j < n1; ++j) {
            const legacy_mat T = legacy_advance(M, j);
            legacy_seq_tile(kind, &T, 1, 2, 1, prep, 0, out + (j - n0), out_stride);
        }
    } else {
        for (; j + 8 <= n1; j += 8) {
            const legacy_mat T = legacy_advance(M, j);
            int r = 0;
            for (; r + 2 <= a->m; r += 2)
                legacy_seq_tile(kind, &T, 8, 2, 0, prep, r, out + r * out_stride + (j - n0), out_stride);
            if (r < a->m) legacy_seq_tile(kind, &T, 8, 1, 0, prep, r, out + r * out_stride + (j - n0), out_stride);
        }
    }
    for (; j < n1; ++j) { /* the last few rows: one row, every activation row */
        const legacy_mat T = legacy_advance(M, j);
        for (int r = 0; r < a->m; ++r)
            legacy_seq_tile(kind, &T, 1, 1, 0, prep, r, out + r * out_stride + (j - n0), out_stride);
    }
    return 1;
}

/* Every activation row against NR weight rows: one band when m == 1 (NR = 16), else bands of 2 (NR = 8); then
 * the blocks after the last full span (legacy_tail_pass). */
static inline __attribute__((always_inline)) void legacy_dot(const int kind, const uint8_t *w, int64_t n,
                                                             int64_t row_bytes, int64_t n0, int64_t n1,
                                                             const tl_act_q8 *a, float *out, int64_t out_stride) {
    const legacy_mat M = legacy_view(kind, w, n, a->k, 0);
    const int pair_rows = a->pairs > 1 && (kind != 2 || a->q8_lanes != NULL);
    if (pair_rows) {
        legacy_pairs_dot(kind, &M, n0, n1, a, out, out_stride);
    } else if (!legacy_seq_dot(kind, &M, row_bytes, n0, n1, a, out, out_stride)) {
        int64_t j = n0;
        if (a->m == 1) {
            for (; j + 16 <= n1; j += 16) {
                const legacy_mat T = legacy_advance(&M, j);
                legacy_tile(kind, &T, 16, 1, 0, a, 0, out + (j - n0), 0);
            }
        } else if (a->paired) {
            for (; j + 8 <= n1; j += 8) {
                const legacy_mat T = legacy_advance(&M, j);
                legacy_tile(kind, &T, 8, 2, 1, a, 0, out + (j - n0), out_stride);
            }
            for (; j < n1; ++j) {
                const legacy_mat T = legacy_advance(&M, j);
                legacy_tile(kind, &T, 1, 2, 1, a, 0, out + (j - n0), out_stride);
            }
        } else {
            for (; j + 8 <= n1; j += 8) {
                const legacy_mat T = legacy_advance(&M, j);
                int64_t r = 0;
                for (; r + 2 <= a->m; r += 2)
                    legacy_tile(kind, &T, 8, 2, 0, a, r, out + r * out_stride + (j - n0), out_stride);
                if (r < a->m) legacy_tile(kind, &T, 8, 1, 0, a, r, out + r * out_stride + (j - n0), out_stride);
            }
        }
        for (; j < n1; ++j) { /* the last few rows one by one */
            const legacy_mat T = legacy_advance(&M, j);
            for (int64_t r = 0; r < a->m; ++r)
                legacy_tile(kind, &T, 1, 1, 0, a, r, out + r * out_stride + (j - n0), out_stride);
        }
    }
    legacy_tail_pass(kind, &M, n0, n1, a, pair_rows, out, out_stride);
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
    legacy_row_scales(&R, 0, scale);
    if (is_q4_1) legacy_row_scales(&R, 1, min);
    const __m128i low = _mm_set1_epi8(15);
    for (int64_t b = 0; b < nb; ++b) {
        const __m128i v = q4_block_bytes(&R, b);
        _mm_storeu_si128((__m128i *)(q + 32 * b), _mm_and_si128(v, low));
        _mm_storeu_si128((__m128i *)(q + 32 * b + 16), _mm_and_si128(_mm_srli_epi16(v, 4), low));
        if (!is_q4_1) min[b] = -8.0f * scale[b];
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
    legacy_row_scales(&R, 0, scale);
    for (int64_t b = 0; b < nb; ++b) {
        _mm256_storeu_si256((__m256i *)(q + 32 * b), legacy_block_vec(&R, b));
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
