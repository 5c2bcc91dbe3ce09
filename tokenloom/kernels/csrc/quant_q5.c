/*
 * GGUF Q5_0 and Q5_1 (32-element blocks with a fifth bit) for csrc/quant_gemm.c: same-size re-layout, exact
 * dequantize, the many-row path's unsigned quants, and an AVX512-VNNI dot kernel against int8 activations
 * (quant_common.h).
 *
 * llama-quantize writes these types where a K type cannot go: a tensor whose rows are not whole 256-element
 * super-blocks takes Q5_0 for Q4_K and Q5_1 for Q5_K (llama.cpp's src/llama-quant.cpp, the "fallback"
 * quantization). So a Q4_K_M file of a model with a hidden size of 576, 896 or 960 (SmolLM2-135M,
 * Qwen2.5-0.5B, SmolLM2-360M) is mostly Q5_0.
 *
 * File blocks: Q5_0 {f16 d; u32 qh; u8 qs[16]} with w = d (q - 16); Q5_1 {f16 d; f16 m; u32 qh; u8 qs[16]}
 * with w = d q + m. Element j < 16 is the low nibble of qs[j] plus bit j of qh as its fifth bit (value 16);
 * element 16 + j is the high nibble of qs[j] plus bit 16 + j.
 *
 * Re-laid-out matrix (the same bytes): every row's full spans of 16 blocks, row after row, then the T = nb % 16
 * blocks left of every row (the tail) in bands of 16 rows. A span (352 / 384 bytes):
 *     qs  256 bytes interleaved as the Q4 types' spans (quant_legacy.c): byte 64 L + 4 i + t is byte 4 L + t
 *         of block i's qs, so the low nibbles of 64-byte vector L are vector v = 2 L of the span and the high
 *         ones vector v = 2 L + 1, each holding elements 16 h + 4 L .. + 3 (h = v % 2) of block i in lane i;
 *     hb  64 bytes: bit v of byte j is the fifth bit of byte j of vector v (one shift and one bitwise select
 *         each place them, as Q6_K's high bits in quant_kquants.c);
 *     d   16 f16;  Q5_1 also m: 16 f16.
 * A band of L rows (16; the last band the rows left) holds per tail block t the same fields with lane = row:
 * for each 4-byte unit U of the block's qs the L rows' units (4 L bytes, row l's at 4 l), then the L rows'
 * fifth bits (4 L bytes: bit 2 U + h of byte 4 l + b is that of element 16 h + 4 U + b of row l), then their d
 * and (Q5_1) their m (L f16 each).
 *
 * Dot product: over a span, vpdpbusd of each of the 8 quant vectors against the activations in the same
 * lane order leaves block i's integer dot product in int32 lane i: one conversion and one multiply-add with
 * d_w d_x per lane (the activations regrouped once per call, as quant_legacy.c's q4_lanes_order). The tail is
 * a pass of its own over the bands, as quant_legacy.c's: a unit of 16 rows against the activation's matching 4
 * bytes broadcast leaves each row's sum in its lane, so a tail block costs 8 vpdpbusd per activation row for 16
 * weight rows (in groups of 4 blocks per row, k = 576's two tail blocks had cost ~40% of a span per row). Q5_0's
 * -16 enters the integer sums as -16 (the block's activation quant sum); Q5_1's m adds m_w d_x s_x per block in
 * a second multiply-add. One activation row's two int8 terms (tl_act_q8.paired) are summed as 128 dot0 + dot1
 * before the conversion, as in the other families. Weight rows stream one after another; their accumulators are
 * summed 16 at a time (reduce16).
 *
 * Dequantize is exact: d (q - 16) and d q are exact in float32 (an f16 times an integer below 32), so
 * Q5_0's value has no rounding and Q5_1's one (+ m), as in the gguf package's numpy.
 */
#include "bf16_common.h"
#include "quant_common.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__F16C__)
#include <immintrin.h>
#define HAVE_QUANT_Q5 1
#else
#define HAVE_QUANT_Q5 0
#endif

#if HAVE_QUANT_Q5
#define Q5_0_BYTES 22
#define Q5_1_BYTES 24
#define Q5_PREP_VECS 1024 /* 64 KiB of prepared activations on the stack */
#define Q5_SPAN_VECS 10   /* vectors per (span, activation row): 8 quant vectors, scale, offset */
#define Q5_MAX_MB 4       /* activation rows per pass over the weight rows */
#define Q5_AHEAD 4096     /* software prefetch distance (x tl_quant_prefetch_tiles), bytes */

/* Row `row` of a re-laid-out [n, k] matrix: its spans, and the band of its tail (`lanes` rows from row `first`;
 * the row is lane row - first). */
typedef struct {
    const uint8_t *spans, *band;
    int64_t spans_n, tail, span_bytes, first;
    int lanes;
} q5_row_view;

static inline q5_row_view q5_view(const int one, const uint8_t *w, int64_t n, int64_t nb, int64_t row) {
    const int64_t bs = one ? Q5_1_BYTES : Q5_0_BYTES, spans = nb / 16, tail = nb % 16, span_bytes = 16 * bs;
    const int64_t first = row / 16 * 16;
    const q5_row_view v = {w + row * spans * span_bytes, w + n * spans * span_bytes + first * tail * bs, spans,
                           tail, span_bytes, first, (int)(n - first < 16 ? n - first : 16)};
    return v;
}

/* ---- a span ---- */

/* The span's 8 quant vectors (v = 2 L + h) with their fifth bits. */
static inline __attribute__((always_inline)) void q5_span_quants(const uint8_t *span, __m512i v[8]) {
    const __m512i nib = _mm512_set1_epi8(0x0f), bit4 = _mm512_set1_epi8(0x10);
    const __m512i hb = _mm512_loadu_si512(span + 256);
    for (int L = 0; L < 4; ++L) {
        const __m512i q = _mm512_loadu_si512(span + 64 * L);
        for (int h = 0; h < 2; ++h) {
            const int s = 2 * L + h; /* bit s of hb's bytes -> bit 4 */
            const __m512i b = s < 4 ? _mm512_slli_epi16(hb, 4 - s) : s > 4 ? _mm512_srli_epi16(hb, s - 4) : hb;
            const __m512i n = h ? tl_high_nibbles(q) : _mm512_and_si512(q, nib);
            v[s] = _mm512_ternarylogic_epi32(n, b, bit4, 0xF8); /* n | (b & 0x10) */
        }
    }
}

/* One span against MB prepared activation rows (p: Q5_SPAN_VECS a row), into acc; PAIRED: the pair's sum
 * into acc[0]. */
static inline __attribute__((always_inline)) void q5_span_dot(const int one, const int MB, const int PAIRED,
                                                              const uint8_t *span, const __m512i *p, __m512 *acc) {
    __m512i v[8], dot[Q5_MAX_MB];
    q5_span_quants(span, v);
    for (int j = 0; j < MB; ++j) {
        const __m512i *x = p + j * Q5_SPAN_VECS;
        __m512i c0 = one ? _mm512_setzero_si512() : x[9], c1 = _mm512_setzero_si512();
        for (int s = 0; s < 8; s += 2) {
            c0 = _mm512_dpbusd_epi32(c0, v[s], x[s]);
            c1 = _mm512_dpbusd_epi32(c1, v[s + 1], x[s + 1]);
        }
        dot[j] = _mm512_add_epi32(c0, c1);
    }
    if (PAIRED) dot[0] = _mm512_add_epi32(_mm512_slli_epi32(dot[0], TL_TERM2_SHIFT), dot[1]);
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(span + 320)));
    const __m512 mw = one ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(span + 352))) : dw;
    for (int j = 0; j < (PAIRED ? 1 : MB); ++j) {
        const __m512i *x = p + j * Q5_SPAN_VECS;
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[j]), _mm512_mul_ps(dw, _mm512_castsi512_ps(x[8])), acc[j]);
        if (one) acc[j] = _mm512_fmadd_ps(mw, _mm512_castsi512_ps(x[9]), acc[j]);
    }
}

/* ---- activations ---- */

/* Activation row `row`, span sp, into p[0..9]: the 8 vectors in the span's lane order (vector 2 L + h, lane i:
 * elements 16 h + 4 L .. + 3 of block i), d_x (times dscale) per block and the offset vector (Q5_0: the int32
 * -16 s per block; Q5_1: the float d_x s). */
static inline void q5_prep_span(const int one, const tl_act_q8 *a, int64_t row, int64_t sp, float dscale,
                                __m512i *p) {
    const int64_t nb = a->k / TL_QK, b0 = 16 * sp;
    const int8_t *xq = a->q + row * a->k + 32 * b0;
    const __m512i lane = _mm512_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120);
    for (int s = 0; s < 8; ++s) { /* dword 8 i + 4 h + L of the span's natural order */
        const int h = s % 2, L = s / 2;
        p[s] = _mm512_i32gather_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32(4 * h + L)), xq, 4);
    }
    const __m512 dx = _mm512_loadu_ps(a->d + row * nb + b0);
    const __m512i sx = _mm512_loadu_si512(a->s + row * nb + b0);
    p[8] = _mm512_castps_si512(_mm512_mul_ps(dx, _mm512_set1_ps(dscale)));
    p[9] = one ? _mm512_castps_si512(_mm512_mul_ps(dx, _mm512_cvtepi32_ps(sx)))
               : _mm512_mullo_epi32(sx, _mm512_set1_epi32(-16));
}

/* Spans [s0, s1) of activation rows [r0, r0 + mb) into prep: span sp of row j at ((sp - s0) * mb + j) *
 * Q5_SPAN_VECS. A pair (mb 2, paired): row 0's scales become d_x0 / 128 (the scale of 128 dot0 + dot1) and
 * Q5_1's offset the pair's d_x0 s_x0 + d_x1 s_x1 (Q5_0's stay per row: they enter the integer sums). */
static void q5_prep(const int one, const tl_act_q8 *a, int r0, int mb, int paired, int64_t s0, int64_t s1,
                    __m512i *prep) {
    const float pair_scale = 1.0f / (1 << TL_TERM2_SHIFT);
    for (int64_t sp = s0; sp < s1; ++sp) {
        __m512i *p = prep + (sp - s0) * mb * Q5_SPAN_VECS;
        for (int j = 0; j < mb; ++j)
            q5_prep_span(one, a, r0 + j, sp, paired && j == 0 ? pair_scale : 1.0f, p + j * Q5_SPAN_VECS);
        if (paired && one)
            p[9] = _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(p[9]),
                                                     _mm512_castsi512_ps(p[Q5_SPAN_VECS + 9])));
    }
}

/* ---- the dot kernel ---- */

/* Up to 16 outputs' accumulators (in reduce16's slots) summed in one pass and written (add == 0) or added to
 * their places: output t of `count` goes to *dst[t]. */
static inline void q5_flush(__m512 *slots, float *const *dst, int count, int add) {
    for (int t = count; t < 16; ++t) slots[REDUCE16_SLOT(t)] = _mm512_setzero_ps();
    float sums[16];
    _mm512_storeu_ps(sums, reduce16(slots));
    for (int t = 0; t < count; ++t) *dst[t] = add ? *dst[t] + sums[t] : sums[t];
}

/* Weight rows [n0, n1), spans [s0, s1), against MB prepared rows (from r0): each row's sums written (add == 0)
 * or added (add == 1) to out[(r0 + j) * out_stride + (row - n0)]; a pair's row 1 gets 0. */
static inline __attribute__((always_inline)) void q5_rows(const int one, const int MB, const int PAIRED,
                                                          const uint8_t *w, int64_t n, int64_t n0, int64_t n1,
                                                          int64_t nb, int64_t s0, int64_t s1, const __m512i *prep,
                                                          int r0, int add, float *out, int64_t out_stride) {
    const int64_t ahead = (int64_t)tl_quant_prefetch_tiles * Q5_AHEAD;
    const int outs = PAIRED ? 1 : MB;
    __m512 slots[16];
    float *dst[16];
    int filled = 0;
    for (int64_t row = n0; row < n1; ++row) {
        const q5_row_view R = q5_view(one, w, n, nb, row);
        __m512 acc[Q5_MAX_MB];
        for (int j = 0; j < MB; ++j) acc[j] = _mm512_setzero_ps();
        for (int64_t sp = s0; sp < s1; ++sp) {
            const uint8_t *span = R.spans + sp * R.span_bytes;
            if (ahead) /* the matrix one prefetch distance on, every line in turn */
                for (int64_t o = 0; o < R.span_bytes; o += 64) TL_QUANT_PREFETCH(span + ahead + o);
            q5_span_dot(one, MB, PAIRED, span, prep + (sp - s0) * MB * Q5_SPAN_VECS, acc);
        }
        if (filled + outs > 16) {
            q5_flush(slots, dst, filled, add);
            filled = 0;
        }
        for (int j = 0; j < outs; ++j, ++filled) {
            slots[REDUCE16_SLOT(filled)] = acc[j];
            dst[filled] = out + (int64_t)(r0 + j) * out_stride + (row - n0);
        }
        if (PAIRED) out[(int64_t)(r0 + 1) * out_stride + (row - n0)] = 0.0f;
    }
    if (filled) q5_flush(slots, dst, filled, add);
}

/* ---- the tail, in bands of rows ---- */

/* Tail block t of a band of `lanes` rows (rec: its record) as 8 vectors of quants with their fifth bits, lane
 * = row: vector 2 U + h holds elements 16 h + 4 U .. + 3 of each row (U: the 4-byte unit of the block's qs). */
static inline __attribute__((always_inline)) void q5_band_quants(const uint8_t *rec, int lanes, __m512i v[8]) {
    const __mmask64 bytes = lanes == 16 ? ~(__mmask64)0 : ((__mmask64)1 << (4 * lanes)) - 1;
    const __m512i nib = _mm512_set1_epi8(0x0f), bit4 = _mm512_set1_epi8(0x10);
    const __m512i hb = _mm512_maskz_loadu_epi8(bytes, rec + 16 * lanes);
    for (int U = 0; U < 4; ++U) {
        const __m512i q = _mm512_maskz_loadu_epi8(bytes, rec + 4 * lanes * U);
        for (int h = 0; h < 2; ++h) {
            const int s = 2 * U + h; /* bit s of hb's bytes -> bit 4 */
            const __m512i b = s < 4 ? _mm512_slli_epi16(hb, 4 - s) : s > 4 ? _mm512_srli_epi16(hb, s - 4) : hb;
            const __m512i n = h ? tl_high_nibbles(q) : _mm512_and_si512(q, nib);
            v[s] = _mm512_ternarylogic_epi32(n, b, bit4, 0xF8);
        }
    }
}

/* The band's decoded tail block v (q5_band_quants) against activation row `row` (its block blk): each lane's
 * (weight row's) integer dot product, with Q5_0's -16 s_x in it. */
static inline __attribute__((always_inline)) __m512i q5_band_dot(const int one, const __m512i v[8],
                                                                 const tl_act_q8 *a, int64_t row, int64_t blk) {
    const int8_t *xq = a->q + row * a->k + 32 * blk;
    __m512i c0 = one ? _mm512_setzero_si512() : _mm512_set1_epi32(-16 * a->s[row * (a->k / TL_QK) + blk]);
    __m512i c1 = _mm512_setzero_si512();
    for (int U = 0; U < 4; ++U)
        for (int h = 0; h < 2; ++h) {
            int32_t x4;
            memcpy(&x4, xq + 16 * h + 4 * U, 4);
            if (h)
                c1 = _mm512_dpbusd_epi32(c1, v[2 * U + 1], _mm512_set1_epi32(x4));
            else
                c0 = _mm512_dpbusd_epi32(c0, v[2 * U], _mm512_set1_epi32(x4));
        }
    return _mm512_add_epi32(c0, c1);
}

/* Every tail block of weight rows [n0, n1) against MB activation rows (from r0; PAIRED: a pair, rows r0 and
 * r0 + second, its sum into row r0's output), added to out[(r0 + j) * out_stride + (row - n0)]. */
static inline __attribute__((always_inline)) void q5_tail_pass(const int one, const int MB, const int PAIRED,
                                                               const uint8_t *w, int64_t n, int64_t nb, int64_t n0,
                                                               int64_t n1, const tl_act_q8 *a, int r0, int second,
                                                               float *out, int64_t out_stride) {
    const int64_t bs = one ? Q5_1_BYTES : Q5_0_BYTES, full = nb / 16 * 16;
    for (int64_t first = n0 / 16 * 16; first < n1; first += 16) {
        const q5_row_view R = q5_view(one, w, n, nb, first);
        __m512 acc[Q5_MAX_MB];
        for (int j = 0; j < MB; ++j) acc[j] = _mm512_setzero_ps();
        for (int64_t t = 0; t < R.tail; ++t) {
            const uint8_t *rec = R.band + t * R.lanes * bs;
            const __mmask16 lanes = (__mmask16)((1u << R.lanes) - 1);
            const __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, rec + 20 * R.lanes));
            const __m512 mw = one ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, rec + 22 * R.lanes)) : dw;
            __m512i dot[Q5_MAX_MB];
            __m512i v[8];
            q5_band_quants(rec, R.lanes, v); /* decoded once for every activation row */
            for (int j = 0; j < MB; ++j) dot[j] = q5_band_dot(one, v, a, r0 + (PAIRED ? j * second : j), full + t);
            if (PAIRED) dot[0] = _mm512_add_epi32(_mm512_slli_epi32(dot[0], TL_TERM2_SHIFT), dot[1]);
            for (int j = 0; j < (PAIRED ? 1 : MB); ++j) {
                const int64_t o = (r0 + j) * (a->k / TL_QK) + full + t;
                const float dx = PAIRED ? a->d[o] / (1 << TL_TERM2_SHIFT) : a->d[o];
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[j]), _mm512_mul_ps(dw, _mm512_set1_ps(dx)), acc[j]);
                if (one) {
                    float ds = a->d[o] * (float)a->s[o];
                    if (PAIRED) ds += a->d[o + second * nb] * (float)a->s[o + second * nb];
                    acc[j] = _mm512_fmadd_ps(mw, _mm512_set1_ps(ds), acc[j]);
                }
            }
        }
        float sums[Q5_MAX_MB][16];
        for (int j = 0; j < MB; ++j) _mm512_storeu_ps(sums[j], acc[j]);
        const int64_t lo = n0 > first ? n0 : first, hi = n1 < first + R.lanes ? n1 : first + R.lanes;
        for (int j = 0; j < (PAIRED ? 1 : MB); ++j)
            for (int64_t row = lo; row < hi; ++row) out[(r0 + j) * out_stride + (row - n0)] += sums[j][row - first];
    }
}

/* CALL(MB, PAIRED) for the pass's mb activation rows (a pair: MB 2, PAIRED 1), the constants the inlined passes
 * are specialized on. */
#define Q5_BY_ROWS(CALL)                                                                                         \
    switch (mb) {                                                                                                \
    case 4: CALL(4, 0); break;                                                                                   \
    case 3: CALL(3, 0); break;                                                                                   \
    case 2:                                                                                                      \
        if (paired)                                                                                              \
            CALL(2, 1);                                                                                          \
        else                                                                                                     \
            CALL(2, 0);                                                                                          \
        break;                                                                                                   \
    default: CALL(1, 0); break;                                                                                  \
    }

/* ---- batched decode: every activation row's two terms as a pair (tl_act_q8.pairs > 1) ----
 *
 * The passes above decode a span's quants once per Q5_MAX_MB activation term rows and scale every term row
 * apart. Here a span is decoded once for up to Q5_PAIRS_GROUP pairs, each pair's two integer sums joined as
 * 128 dot0 + dot1 (Q5_0's -16 s in each) before one conversion and scaling, the prepared activations in
 * chunks of spans that stay in L1 (as quant_kquants.c's kq_pairs_dot). Measured against the passes above
 * (bench/quant_gemm.py --pairs-ab, SmolLM2's shapes): 1.09-1.24x at 2-8 rows; the SmolLM2 Q4_K_M decode step
 * (mostly Q5_0) 0.84-0.87x at batch 2-8 with the K types' pairs (bench/ab_decode.py). */
#define Q5_PAIRS_GROUP 8   /* pairs per pass (the small path's up to 11: a second pass) */
/* Prepared activations per chunk of spans: 32 KiB (k = 1536 at 8 pairs in one chunk). 24 KiB measured 0.86-0.91x
 * the terms apart at 8 rows of 576 x 1536 (two chunks), 32 KiB 1.13-1.15x; elsewhere level. */
#define Q5_PAIRS_L1_VECS 512

/* Weight rows [n0, n1), spans [s0, s1) (every term row prepared at prep, q5_prep's layout with mb = 2 pairs),
 * against pairs p0 .. p0 + G - 1: each pair's sums written (add == 0) or added to its output row, 0 into its
 * second term's. */
static inline __attribute__((always_inline)) void q5_pairs_rows(const int one, const int G, const uint8_t *w,
                                                                int64_t n, int64_t n0, int64_t n1, int64_t nb,
                                                                int64_t s0, int64_t s1, const __m512i *prep,
                                                                const tl_act_q8 *a, int p0, int add, float *out,
                                                                int64_t out_stride) {
    const int64_t ahead = (int64_t)tl_quant_prefetch_tiles * Q5_AHEAD, rows = 2 * (int64_t)a->pairs;
    __m512 slots[16];
    float *dst[16];
    int filled = 0;
    for (int64_t row = n0; row < n1; ++row) {
        const q5_row_view R = q5_view(one, w, n, nb, row);
        __m512 acc[Q5_PAIRS_GROUP];
        for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
        for (int64_t sp = s0; sp < s1; ++sp) {
            const uint8_t *span = R.spans + sp * R.span_bytes;
            if (ahead)
                for (int64_t o = 0; o < R.span_bytes; o += 64) TL_QUANT_PREFETCH(span + ahead + o);
            __m512i v[8];
            q5_span_quants(span, v);
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(span + 320)));
            const __m512 mw = one ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(span + 352))) : dw;
            const __m512i *p = prep + (sp - s0) * rows * Q5_SPAN_VECS;
            for (int g = 0; g < G; ++g) {
                const __m512i *x0 = p + (p0 + g) * Q5_SPAN_VECS, *x1 = p + (a->pairs + p0 + g) * Q5_SPAN_VECS;
                __m512i c0 = one ? _mm512_setzero_si512() : x0[9], c1 = one ? _mm512_setzero_si512() : x1[9];
                for (int t = 0; t < 8; ++t) {
                    c0 = _mm512_dpbusd_epi32(c0, v[t], x0[t]);
                    c1 = _mm512_dpbusd_epi32(c1, v[t], x1[t]);
                }
                const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(c0, TL_TERM2_SHIFT), c1);
                acc[g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, _mm512_castsi512_ps(x0[8])),
                                         acc[g]);
                if (one) acc[g] = _mm512_fmadd_ps(mw, _mm512_castsi512_ps(x0[9]), acc[g]);
            }
        }
        if (filled + G > 16) {
            q5_flush(slots, dst, filled, add);
            filled = 0;
        }
        for (int g = 0; g < G; ++g, ++filled) {
            slots[REDUCE16_SLOT(filled)] = acc[g];
            dst[filled] = out + (int64_t)(p0 + g) * out_stride + (row - n0);
            out[(int64_t)(a->pairs + p0 + g) * out_stride + (row - n0)] = 0.0f;
        }
    }
    if (filled) q5_flush(slots, dst, filled, add);
}

/* tl_dot_rows_fn for a->pairs > 1: chunks of spans, every pair in passes of Q5_PAIRS_GROUP, then the tail pass
 * pair by pair. */
static inline __attribute__((always_inline)) void q5_pairs_dot(const int one, const uint8_t *w, int64_t n, int64_t n0,
                                                               int64_t n1, const tl_act_q8 *a, float *out,
                                                               int64_t out_stride) {
    const int64_t nb = a->k / TL_QK, spans = nb / 16, rows = 2 * (int64_t)a->pairs;
    const int64_t fit = Q5_PAIRS_L1_VECS / (rows * Q5_SPAN_VECS), chunk = fit > 0 ? fit : 1;
    const float pair_scale = 1.0f / (1 << TL_TERM2_SHIFT);
    __m512i prep[Q5_PAIRS_L1_VECS]; /* (at least one span of 16 term rows: 160 vectors) */
    if (spans == 0) /* the tail pass adds to zeros (and the second terms' rows stay so) */
        for (int64_t j = 0; j < rows; ++j)
            for (int64_t row = n0; row < n1; ++row) out[j * out_stride + (row - n0)] = 0.0f;
    for (int64_t s0 = 0; s0 < spans; s0 += chunk) {
        const int64_t s1 = spans - s0 < chunk ? spans : s0 + chunk;
        q5_prep(one, a, 0, (int)rows, 0, s0, s1, prep);
        for (int64_t sp = s0; sp < s1; ++sp) { /* a first term's scales and offset become its pair's */
            __m512i *p = prep + (sp - s0) * rows * Q5_SPAN_VECS;
            for (int64_t j = 0; j < a->pairs; ++j) {
                __m512i *x0 = p + j * Q5_SPAN_VECS;
                const __m512i *x1 = p + (a->pairs + j) * Q5_SPAN_VECS;
                x0[8] = _mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(x0[8]), _mm512_set1_ps(pair_scale)));
                if (one)
                    x0[9] = _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(x0[9]), _mm512_castsi512_ps(x1[9])));
            }
        }
        for (int p0 = 0; p0 < a->pairs; p0 += Q5_PAIRS_GROUP) {
#define Q5_PAIRS(G) q5_pairs_rows(one, G, w, n, n0, n1, nb, s0, s1, prep, a, p0, s0 > 0, out, out_stride)
            switch (a->pairs - p0 < Q5_PAIRS_GROUP ? a->pairs - p0 : Q5_PAIRS_GROUP) {
            case 8: Q5_PAIRS(8); break;
            case 7: Q5_PAIRS(7); break;
            case 6: Q5_PAIRS(6); break;
            case 5: Q5_PAIRS(5); break;
            case 4: Q5_PAIRS(4); break;
            case 3: Q5_PAIRS(3); break;
            case 2: Q5_PAIRS(2); break;
            default: Q5_PAIRS(1); break;
            }
#undef Q5_PAIRS
        }
    }
    if (nb % 16 == 0) return;
    for (int j = 0; j < a->pairs; ++j)
        q5_tail_pass(one, 2, 1, w, n, nb, n0, n1, a, j, a->pairs, out, out_stride);
}

/* tl_dot_rows_fn: activation rows Q5_MAX_MB at a time (a pair as one), spans in passes whose prepared
 * activations fit the stack buffer (one pass for k up to 8192 at 4 rows), then the tail pass. */
static inline __attribute__((always_inline)) void q5_dot(const int one, const uint8_t *w, int64_t n, int64_t n0,
                                                         int64_t n1, const tl_act_q8 *a, float *out,
                                                         int64_t out_stride) {
    const int64_t nb = a->k / TL_QK, spans = nb / 16;
    if (a->pairs > 1) {
        q5_pairs_dot(one, w, n, n0, n1, a, out, out_stride);
        return;
    }
    __m512i prep[Q5_PREP_VECS];
    for (int r0 = 0; r0 < a->m; r0 += Q5_MAX_MB) {
        const int paired = a->paired && r0 == 0 && a->m == 2;
        const int mb = a->m - r0 < Q5_MAX_MB ? a->m - r0 : Q5_MAX_MB;
        const int64_t per_pass = Q5_PREP_VECS / (mb * Q5_SPAN_VECS);
        if (spans == 0) /* the tail pass adds to zeros */
            for (int j = 0; j < mb; ++j)
                for (int64_t row = n0; row < n1; ++row) out[(r0 + j) * out_stride + (row - n0)] = 0.0f;
        for (int64_t s0 = 0; s0 < spans; s0 += per_pass) {
            const int64_t s1 = spans - s0 < per_pass ? spans : s0 + per_pass;
            const int add = s0 > 0;
            q5_prep(one, a, r0, mb, paired, s0, s1, prep);
#define Q5_ROWS(MB, PAIRED) q5_rows(one, MB, PAIRED, w, n, n0, n1, nb, s0, s1, prep, r0, add, out, out_stride)
            Q5_BY_ROWS(Q5_ROWS)
#undef Q5_ROWS
        }
        if (nb % 16 == 0) continue;
#define Q5_TAIL(MB, PAIRED) q5_tail_pass(one, MB, PAIRED, w, n, nb, n0, n1, a, r0, 1, out, out_stride)
        Q5_BY_ROWS(Q5_TAIL)
#undef Q5_TAIL
    }
}

#undef Q5_BY_ROWS

static void q5_0_dot(const uint8_t *w, int64_t n, int64_t row_bytes, int64_t n0, int64_t n1, const tl_act_q8 *a,
                     float *out, int64_t out_stride) {
    (void)row_bytes;
    q5_dot(0, w, n, n0, n1, a, out, out_stride);
}
static void q5_1_dot(const uint8_t *w, int64_t n, int64_t row_bytes, int64_t n0, int64_t n1, const tl_act_q8 *a,
                     float *out, int64_t out_stride) {
    (void)row_bytes;
    q5_dot(1, w, n, n0, n1, a, out, out_stride);
}

/* ---- re-layout ---- */

/* Row r's nb file blocks (at `file`) into its spans and its lane of the tail's band (see the top). */
static void q5_repack_row(const int one, const uint8_t *file, uint8_t *w, int64_t n, int64_t nb, int64_t r) {
    const int bs = one ? Q5_1_BYTES : Q5_0_BYTES, qh_at = one ? 4 : 2, qs_at = qh_at + 4;
    const q5_row_view R = q5_view(one, w, n, nb, r);
    for (int64_t sp = 0; sp < R.spans_n; ++sp) {
        uint8_t *span = (uint8_t *)R.spans + sp * R.span_bytes;
        memset(span + 256, 0, 64);
        for (int i = 0; i < 16; ++i) {
            const uint8_t *blk = file + (16 * sp + i) * bs;
            uint32_t qh;
            memcpy(&qh, blk + qh_at, 4);
            for (int L = 0; L < 4; ++L)
                for (int t = 0; t < 4; ++t) {
                    const int j = 64 * L + 4 * i + t, e = 4 * L + t; /* byte j: elements e and 16 + e */
                    span[j] = blk[qs_at + e];
                    span[256 + (j & 63)] |= (uint8_t)(((qh >> e) & 1u) << (2 * L));
                    span[256 + (j & 63)] |= (uint8_t)(((qh >> (16 + e)) & 1u) << (2 * L + 1));
                }
            memcpy(span + 320 + 2 * i, blk, 2);
            if (one) memcpy(span + 352 + 2 * i, blk + 2, 2);
        }
    }
    const int lanes = R.lanes, l = (int)(r - R.first);
    for (int64_t t = 0; t < R.tail; ++t) {
        const uint8_t *blk = file + (16 * R.spans_n + t) * bs;
        uint8_t *rec = (uint8_t *)R.band + t * lanes * bs;
        uint32_t qh;
        memcpy(&qh, blk + qh_at, 4);
        for (int U = 0; U < 4; ++U)
            for (int b = 0; b < 4; ++b) {
                const int e = 4 * U + b;
                rec[4 * lanes * U + 4 * l + b] = blk[qs_at + e];
                uint8_t *bits = rec + 16 * lanes + 4 * l + b;
                if (U == 0) *bits = 0;
                *bits |= (uint8_t)((((qh >> e) & 1u) << (2 * U)) | (((qh >> (16 + e)) & 1u) << (2 * U + 1)));
            }
        memcpy(rec + 20 * lanes + 2 * l, blk, 2);
        if (one) memcpy(rec + 22 * lanes + 2 * l, blk + 2, 2);
    }
}

static int q5_repack(const int one, uint8_t *data, int64_t n, int64_t k) {
    const int64_t nb = k / TL_QK, row_bytes = nb * (one ? Q5_1_BYTES : Q5_0_BYTES);
    uint8_t *file = malloc((size_t)(n * row_bytes) + 1);
    if (file == NULL) return -1;
    memcpy(file, data, (size_t)(n * row_bytes));
    for (int64_t r = 0; r < n; ++r) q5_repack_row(one, file + r * row_bytes, data, n, nb, r);
    free(file);
    return 0;
}
static int q5_0_repack(uint8_t *data, int64_t n, int64_t k) { return q5_repack(0, data, n, k); }
static int q5_1_repack(uint8_t *data, int64_t n, int64_t k) { return q5_repack(1, data, n, k); }

/* ---- dequantize, unsigned quants ---- */

/* A span's quants (0..31) in natural order into q[512], its d into scale[16] and its minimum (Q5_1: m; Q5_0:
 * -16 d) into min[16]. */
static inline void q5_span_unpack(const int one, const uint8_t *span, uint8_t *q, float *scale, float *min) {
    /* natural dword 8 i + 4 h + L of a span is dword i of vector 2 L + h */
    const __m512i from = _mm512_setr_epi32(0, 32, 64, 96, 16, 48, 80, 112, 1, 33, 65, 97, 17, 49, 81, 113);
    __m512i v[8];
    uint8_t vec[512];
    q5_span_quants(span, v);
    for (int s = 0; s < 8; ++s) _mm512_storeu_si512(vec + 64 * s, v[s]);
    for (int n = 0; n < 8; ++n) /* natural vector n: blocks 2n and 2n + 1 */
        _mm512_storeu_si512(q + 64 * n,
                            _mm512_i32gather_epi32(_mm512_add_epi32(from, _mm512_set1_epi32(2 * n)), vec, 4));
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(span + 320)));
    _mm512_storeu_ps(scale, dw);
    _mm512_storeu_ps(min, one ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(span + 352)))
                              : _mm512_mul_ps(dw, _mm512_set1_ps(-16.0f)));
}

/* Tail block t of row r (R: its view) as quants (0..31, natural order) into q[32], its d and minimum (Q5_1: m;
 * Q5_0: -16 d). */
static inline void q5_tail_unpack(const int one, const q5_row_view *R, int64_t r, int64_t t, uint8_t *q, float *scale,
                                  float *min) {
    const int64_t bs = one ? Q5_1_BYTES : Q5_0_BYTES;
    const int lanes = R->lanes, l = (int)(r - R->first);
    const uint8_t *rec = R->band + t * lanes * bs;
    for (int U = 0; U < 4; ++U)
        for (int b = 0; b < 4; ++b) {
            const uint8_t byte = rec[4 * lanes * U + 4 * l + b], bits = rec[16 * lanes + 4 * l + b];
            q[4 * U + b] = (uint8_t)((byte & 15) | (((bits >> (2 * U)) & 1) << 4));
            q[16 + 4 * U + b] = (uint8_t)((byte >> 4) | (((bits >> (2 * U + 1)) & 1) << 4));
        }
    uint16_t d, m;
    memcpy(&d, rec + 20 * lanes + 2 * l, 2);
    *scale = _cvtsh_ss(d);
    if (one) {
        memcpy(&m, rec + 22 * lanes + 2 * l, 2);
        *min = _cvtsh_ss(m);
    } else {
        *min = -16.0f * *scale;
    }
}

/* Row r as quants (0..31, natural order) with per-block scale d and minimum (m, or -16 d for Q5_0): the
 * dequantized weight is scale q + min. The many-row path's tl_u8_row_fn. */
static inline __attribute__((always_inline)) void q5_unpack_row(const int one, const uint8_t *w, int64_t n, int64_t r,
                                                                int64_t k, uint8_t *q, float *scale, float *min) {
    const int64_t nb = k / TL_QK;
    const q5_row_view R = q5_view(one, w, n, nb, r);
    for (int64_t sp = 0; sp < R.spans_n; ++sp)
        q5_span_unpack(one, R.spans + sp * R.span_bytes, q + 512 * sp, scale + 16 * sp, min + 16 * sp);
    const int64_t b0 = 16 * R.spans_n;
    for (int64_t t = 0; t < R.tail; ++t) q5_tail_unpack(one, &R, r, t, q + 32 * (b0 + t), scale + b0 + t, min + b0 + t);
}

static void q5_0_u8(const uint8_t *w, int64_t n, int64_t r, int64_t k, uint8_t *q, float *scale, float *min) {
    q5_unpack_row(0, w, n, r, k, q, scale, min);
}
static void q5_1_u8(const uint8_t *w, int64_t n, int64_t r, int64_t k, uint8_t *q, float *scale, float *min) {
    q5_unpack_row(1, w, n, r, k, q, scale, min);
}

/* `blocks` unpacked blocks (q, scale, min) dequantized into out: scale q + min, exact for Q5_0 (d q - 16 d, both
 * products exact, is d (q - 16)) and one rounding for Q5_1 (d q + m, d q exact), as the gguf package. */
static inline void q5_blocks_out(const uint8_t *q, const float *scale, const float *min, int blocks, float *out) {
    for (int b = 0; b < blocks; ++b)
        for (int h = 0; h < 2; ++h) {
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(q + 32 * b + 16 * h));
            const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
            _mm512_storeu_ps(out + 32 * b + 16 * h,
                             _mm512_fmadd_ps(_mm512_set1_ps(scale[b]), v, _mm512_set1_ps(min[b])));
        }
}

/* Exact dequantize of row r, a span or a tail block at a time. */
static inline __attribute__((always_inline)) void q5_dequant(const int one, const uint8_t *w, int64_t n, int64_t r,
                                                             int64_t k, float *out) {
    const int64_t nb = k / TL_QK;
    const q5_row_view R = q5_view(one, w, n, nb, r);
    uint8_t q[512];
    float scale[16], min[16];
    for (int64_t sp = 0; sp < R.spans_n; ++sp) {
        q5_span_unpack(one, R.spans + sp * R.span_bytes, q, scale, min);
        q5_blocks_out(q, scale, min, 16, out + 512 * sp);
    }
    for (int64_t t = 0; t < R.tail; ++t) {
        q5_tail_unpack(one, &R, r, t, q, scale, min);
        q5_blocks_out(q, scale, min, 1, out + 32 * (16 * R.spans_n + t));
    }
}
static void q5_0_dequant(const uint8_t *w, int64_t n, int64_t r, int64_t k, float *out) {
    q5_dequant(0, w, n, r, k, out);
}
static void q5_1_dequant(const uint8_t *w, int64_t n, int64_t r, int64_t k, float *out) {
    q5_dequant(1, w, n, r, k, out);
}

static const tl_quant_type TL_Q5_TYPES[2] = {
    {TL_Q5_0, 32, Q5_0_BYTES, q5_0_dot, q5_0_dequant, q5_0_repack, q5_0_u8, 32},
    {TL_Q5_1, 32, Q5_1_BYTES, q5_1_dot, q5_1_dequant, q5_1_repack, q5_1_u8, 32},
};
#endif /* HAVE_QUANT_Q5 */

/* The family's table entry for `type`, or NULL (another type, or a build without AVX512-VNNI). */
static const tl_quant_type *tl_q5_type(int type) {
#if HAVE_QUANT_Q5
    for (int i = 0; i < 2; ++i)
        if (TL_Q5_TYPES[i].type == type) return &TL_Q5_TYPES[i];
#endif
    (void)type;
    return NULL;
}
