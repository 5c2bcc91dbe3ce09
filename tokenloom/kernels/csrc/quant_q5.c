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
 * Re-laid-out row (the same bytes; rows stay whole): its full spans of 16 blocks, then the T = nb % 16 blocks
 * left (the tail). A span (352 / 384 bytes):
 *     qs  256 bytes interleaved as the Q4 types' spans (quant_legacy.c): byte 64 L + 4 i + t is byte 4 L + t
 *         of block i's qs, so the low nibbles of 64-byte vector L are vector v = 2 L of the span and the high
 *         ones vector v = 2 L + 1, each holding elements 16 h + 4 L .. + 3 (h = v % 2) of block i in lane i;
 *     hb  64 bytes: bit v of byte j is the fifth bit of byte j of vector v (one shift and one bitwise select
 *         each place them, as Q6_K's high bits in quant_kquants.c);
 *     d   16 f16;  Q5_1 also m: 16 f16.
 * The tail, in groups of 4 blocks (the last may hold 1-3): qs as in the file (T x 16 bytes: a group's 64
 * bytes hold block b in 16-byte lane b, low nibbles its elements 0..15, high ones 16..31), then per group of
 * r blocks 2 r bytes of fifth bits of elements 0..15 (a u16 a block) and 2 r of elements 16..31 (for a whole
 * group: two 64-bit masks for a masked byte add), then T f16 d and (Q5_1) T f16 m.
 *
 * Dot product: over a span, vpdpbusd of each of the 8 quant vectors against the activations in the same
 * lane order leaves block i's integer dot product in int32 lane i: one conversion and one multiply-add with
 * d_w d_x per lane (the activations regrouped once per call, as quant_legacy.c's q4_lanes_order). In a tail
 * group the low and high vectors against the activations' elements 0..15 and 16..31 leave block b's sum in
 * lanes 4b..4b+3. Q5_0's -16 enters the integer sums as -16 (the block's activation quant sum) in one lane a
 * block; Q5_1's m adds m_w d_x s_x per block in a second multiply-add. One activation row's two int8 terms
 * (tl_act_q8.paired) are summed as 128 dot0 + dot1 before the conversion, as in the other families. Weight
 * rows stream one after another; their accumulators are summed 16 at a time (reduce16).
 *
 * Dequantize is exact: d (q - 16) and d q are exact in float32 (an f16 times an integer below 32), so
 * Q5_0's value has no rounding and Q5_1's one (+ m), as in the gguf package's numpy.
 */
#include "bf16_common.h"
#include "quant_common.h"
#include <stdint.h>
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
#define Q5_GROUP_VECS 4   /* per (tail group, activation row): low, high, scale, offset */
#define Q5_MAX_MB 4       /* activation rows per pass over the weight rows */
#define Q5_AHEAD 4096     /* software prefetch distance (x tl_quant_prefetch_tiles), bytes */

/* A re-laid-out row's parts: spans (span_bytes each) and the tail's regions (T blocks). */
typedef struct {
    const uint8_t *spans, *qs, *bits, *d, *m;
    int64_t spans_n, tail, span_bytes;
} q5_row_view;

static inline q5_row_view q5_view(const int one, const uint8_t *row, int64_t nb) {
    const int64_t spans = nb / 16, tail = nb % 16, span_bytes = 16 * (one ? Q5_1_BYTES : Q5_0_BYTES);
    const uint8_t *t = row + spans * span_bytes;
    const q5_row_view v = {row, t, t + 16 * tail, t + 20 * tail, t + 22 * tail, spans, tail, span_bytes};
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

/* ---- a tail group ---- */

/* 4 values (lanes 0-3 of v) spread to 16 lanes, lane i holding value i / 4. */
static inline __m512 q5_spread4(__m128 v) {
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                 _mm512_castps128_ps512(v));
}

/* r f16 values at p (r <= 4; the rest 0) as floats (a masked load reads nothing past them). */
static inline __m128 q5_halfs(const uint8_t *p, int r) {
    if (r == 4) return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)p));
    return _mm_cvtph_ps(_mm_maskz_loadu_epi16((__mmask8)((1u << r) - 1), p));
}

/* 2r bytes at p (r <= 4) as the low bits of a 64-bit mask. */
static inline uint64_t q5_bits(const uint8_t *p, int r) {
    if (r == 4) {
        uint64_t v;
        memcpy(&v, p, 8);
        return v;
    }
    return (uint64_t)_mm_cvtsi128_si64(_mm_maskz_loadu_epi8((__mmask16)((1u << (2 * r)) - 1), p));
}

/* Tail group g (r blocks): its quants with the fifth bit (lo: elements 0..15 of block b in lane b, hi:
 * elements 16..31), its d spread to 4 lanes a block, and (Q5_1) its m alike. Lanes past r are 0. */
static inline __attribute__((always_inline)) void q5_group(const int one, const q5_row_view *R, int64_t g, int r,
                                                           __m512i *lo, __m512i *hi, __m512 *dw, __m512 *mw) {
    const __m512i q = r == 4 ? _mm512_loadu_si512(R->qs + 64 * g)
                             : _mm512_maskz_loadu_epi8(((__mmask64)1 << (16 * r)) - 1, R->qs + 64 * g);
    const uint64_t blo = q5_bits(R->bits + 16 * g, r), bhi = q5_bits(R->bits + 16 * g + 2 * r, r);
    const __m512i sixteen = _mm512_set1_epi8(16), low = _mm512_and_si512(q, _mm512_set1_epi8(0x0f));
    *lo = _mm512_mask_add_epi8(low, _cvtu64_mask64(blo), low, sixteen);
    const __m512i high = tl_high_nibbles(q);
    *hi = _mm512_mask_add_epi8(high, _cvtu64_mask64(bhi), high, sixteen);
    *dw = q5_spread4(q5_halfs(R->d + 8 * g, r));
    if (one) *mw = q5_spread4(q5_halfs(R->m + 8 * g, r));
}

/* One tail group against MB prepared rows (p: Q5_GROUP_VECS a row), into acc. */
static inline __attribute__((always_inline)) void q5_group_dot(const int one, const int MB, const int PAIRED,
                                                               const q5_row_view *R, int64_t g, int r,
                                                               const __m512i *p, __m512 *acc) {
    __m512i lo, hi, dot[Q5_MAX_MB];
    __m512 dw, mw = _mm512_setzero_ps();
    q5_group(one, R, g, r, &lo, &hi, &dw, &mw);
    for (int j = 0; j < MB; ++j) {
        const __m512i *x = p + j * Q5_GROUP_VECS;
        dot[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(one ? _mm512_setzero_si512() : x[3], lo, x[0]), hi, x[1]);
    }
    if (PAIRED) dot[0] = _mm512_add_epi32(_mm512_slli_epi32(dot[0], TL_TERM2_SHIFT), dot[1]);
    for (int j = 0; j < (PAIRED ? 1 : MB); ++j) {
        const __m512i *x = p + j * Q5_GROUP_VECS;
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[j]), _mm512_mul_ps(dw, _mm512_castsi512_ps(x[2])), acc[j]);
        if (one) acc[j] = _mm512_fmadd_ps(mw, _mm512_castsi512_ps(x[3]), acc[j]);
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

/* Activation row `row`, tail group g (r blocks), into p[0..3]: the low and high halves of its blocks in the
 * weights' lane order, d_x spread to 4 lanes a block (times dscale), and the offset (Q5_0 the int32 -16 s,
 * Q5_1 the float d_x s) in lane 4b (0 elsewhere). */
static inline void q5_prep_group(const int one, const tl_act_q8 *a, int64_t row, int64_t g, int r, float dscale,
                                 __m512i *p) {
    const int64_t nb = a->k / TL_QK, b0 = nb / 16 * 16 + 4 * g;
    const int8_t *xq = a->q + row * a->k + 32 * b0;
    const int bytes = 32 * r;
    const __m512i A = _mm512_maskz_loadu_epi8(bytes >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << bytes) - 1, xq);
    const __m512i B = bytes > 64 ? _mm512_maskz_loadu_epi8(bytes >= 128 ? ~(__mmask64)0
                                                                         : ((__mmask64)1 << (bytes - 64)) - 1,
                                                           xq + 64)
                                 : _mm512_setzero_si512();
    p[0] = _mm512_shuffle_i32x4(A, B, _MM_SHUFFLE(2, 0, 2, 0));
    p[1] = _mm512_shuffle_i32x4(A, B, _MM_SHUFFLE(3, 1, 3, 1));
    const __mmask8 lanes = (__mmask8)((1u << r) - 1);
    const __m128 dx = _mm_maskz_loadu_ps(lanes, a->d + row * nb + b0);
    const __m128i sx = _mm_maskz_loadu_epi32(lanes, a->s + row * nb + b0);
    p[2] = _mm512_castps_si512(q5_spread4(_mm_mul_ps(dx, _mm_set1_ps(dscale))));
    const __m512i first = _mm512_setr_epi32(0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0);
    if (one)
        p[3] = _mm512_castps_si512(
            _mm512_maskz_permutexvar_ps(0x1111, first, _mm512_castps128_ps512(_mm_mul_ps(dx, _mm_cvtepi32_ps(sx)))));
    else
        p[3] = _mm512_maskz_permutexvar_epi32(0x1111, first,
                                              _mm512_castsi128_si512(_mm_mullo_epi32(sx, _mm_set1_epi32(-16))));
}

/* Spans [s0, s1) (and, with `tail`, the tail groups) of activation rows [r0, r0 + mb) into prep: span sp of row
 * j at ((sp - s0) * mb + j) * Q5_SPAN_VECS, then tail group g of row j after all spans at (g * mb + j) *
 * Q5_GROUP_VECS. A pair (mb 2, paired): row 0's scales become d_x0 / 128 (the scale of 128 dot0 + dot1) and
 * Q5_1's offset the pair's d_x0 s_x0 + d_x1 s_x1 (Q5_0's stay per row: they enter the integer sums). */
static void q5_prep(const int one, const tl_act_q8 *a, int r0, int mb, int paired, int64_t s0, int64_t s1, int tail,
                    __m512i *prep) {
    const int64_t nb = a->k / TL_QK, t = nb % 16;
    const float pair_scale = 1.0f / (1 << TL_TERM2_SHIFT);
    for (int64_t sp = s0; sp < s1; ++sp) {
        __m512i *p = prep + (sp - s0) * mb * Q5_SPAN_VECS;
        for (int j = 0; j < mb; ++j)
            q5_prep_span(one, a, r0 + j, sp, paired && j == 0 ? pair_scale : 1.0f, p + j * Q5_SPAN_VECS);
        if (paired && one)
            p[9] = _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(p[9]),
                                                     _mm512_castsi512_ps(p[Q5_SPAN_VECS + 9])));
    }
    if (!tail) return;
    __m512i *base = prep + (s1 - s0) * mb * Q5_SPAN_VECS;
    for (int64_t g = 0; 4 * g < t; ++g) {
        const int r = t - 4 * g < 4 ? (int)(t - 4 * g) : 4;
        __m512i *p = base + g * mb * Q5_GROUP_VECS;
        for (int j = 0; j < mb; ++j)
            q5_prep_group(one, a, r0 + j, g, r, paired && j == 0 ? pair_scale : 1.0f, p + j * Q5_GROUP_VECS);
        if (paired && one)
            p[3] = _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(p[3]),
                                                     _mm512_castsi512_ps(p[Q5_GROUP_VECS + 3])));
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

/* Weight rows [n0, n1), spans [s0, s1) and (with `tail`) the tail, against MB prepared rows (from r0): each
 * row's sums written (add == 0) or added (add == 1) to out[(r0 + j) * out_stride + (row - n0)]; a pair's row 1
 * gets 0. */
static inline __attribute__((always_inline)) void q5_rows(const int one, const int MB, const int PAIRED,
                                                          const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1,
                                                          int64_t nb, int64_t s0, int64_t s1, int tail,
                                                          const __m512i *prep, int r0, int add, float *out,
                                                          int64_t out_stride) {
    const int64_t ahead = (int64_t)tl_quant_prefetch_tiles * Q5_AHEAD;
    const int outs = PAIRED ? 1 : MB;
    const __m512i *tail_prep = prep + (s1 - s0) * MB * Q5_SPAN_VECS;
    __m512 slots[16];
    float *dst[16];
    int filled = 0;
    for (int64_t row = n0; row < n1; ++row) {
        const uint8_t *base = w + row * row_bytes;
        const q5_row_view R = q5_view(one, base, nb);
        __m512 acc[Q5_MAX_MB];
        for (int j = 0; j < MB; ++j) acc[j] = _mm512_setzero_ps();
        for (int64_t sp = s0; sp < s1; ++sp) {
            const uint8_t *span = R.spans + sp * R.span_bytes;
            if (ahead) /* the matrix one prefetch distance on, every line in turn */
                for (int64_t o = 0; o < R.span_bytes; o += 64) TL_QUANT_PREFETCH(span + ahead + o);
            q5_span_dot(one, MB, PAIRED, span, prep + (sp - s0) * MB * Q5_SPAN_VECS, acc);
        }
        if (tail && R.tail) {
            if (ahead) TL_QUANT_PREFETCH(R.qs + ahead);
            int64_t g = 0;
            for (; 4 * g + 4 <= R.tail; ++g) {
                if (ahead) TL_QUANT_PREFETCH(R.qs + ahead + 64 * g + 64);
                q5_group_dot(one, MB, PAIRED, &R, g, 4, tail_prep + g * MB * Q5_GROUP_VECS, acc);
            }
            if (4 * g < R.tail)
                q5_group_dot(one, MB, PAIRED, &R, g, (int)(R.tail - 4 * g), tail_prep + g * MB * Q5_GROUP_VECS, acc);
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

/* tl_dot_rows_fn: activation rows Q5_MAX_MB at a time (a pair as one), spans in passes whose prepared
 * activations fit the stack buffer (one pass for k up to 8192 at 4 rows), the tail in the last pass. */
static inline __attribute__((always_inline)) void q5_dot(const int one, const uint8_t *w, int64_t row_bytes,
                                                         int64_t n0, int64_t n1, const tl_act_q8 *a, float *out,
                                                         int64_t out_stride) {
    const int64_t nb = a->k / TL_QK, spans = nb / 16, tail_groups = (nb % 16 + 3) / 4;
    __m512i prep[Q5_PREP_VECS];
    for (int r0 = 0; r0 < a->m; r0 += Q5_MAX_MB) {
        const int paired = a->paired && r0 == 0 && a->m == 2;
        const int mb = a->m - r0 < Q5_MAX_MB ? a->m - r0 : Q5_MAX_MB;
        const int64_t per_pass = (Q5_PREP_VECS - tail_groups * mb * Q5_GROUP_VECS) / (mb * Q5_SPAN_VECS);
        int64_t s0 = 0;
        do {
            const int64_t s1 = spans - s0 < per_pass ? spans : s0 + per_pass;
            const int tail = s1 == spans, add = s0 > 0;
            q5_prep(one, a, r0, mb, paired, s0, s1, tail, prep);
#define Q5_ROWS(MB, PAIRED) \
    q5_rows(one, MB, PAIRED, w, row_bytes, n0, n1, nb, s0, s1, tail, prep, r0, add, out, out_stride)
            switch (mb) {
            case 4: Q5_ROWS(4, 0); break;
            case 3: Q5_ROWS(3, 0); break;
            case 2:
                if (paired)
                    Q5_ROWS(2, 1);
                else
                    Q5_ROWS(2, 0);
                break;
            default: Q5_ROWS(1, 0); break;
            }
#undef Q5_ROWS
            s0 = s1;
        } while (s0 < spans);
    }
}

static void q5_0_dot(const uint8_t *w, int64_t n, int64_t row_bytes, int64_t n0, int64_t n1, const tl_act_q8 *a,
                     float *out, int64_t out_stride) {
    (void)n;
    q5_dot(0, w, row_bytes, n0, n1, a, out, out_stride);
}
static void q5_1_dot(const uint8_t *w, int64_t n, int64_t row_bytes, int64_t n0, int64_t n1, const tl_act_q8 *a,
                     float *out, int64_t out_stride) {
    (void)n;
    q5_dot(1, w, row_bytes, n0, n1, a, out, out_stride);
}

/* ---- re-layout ---- */

/* One row (nb file blocks at `file`) re-laid out into `row` (see the top). */
static void q5_repack_row(const int one, const uint8_t *file, uint8_t *row, int64_t nb) {
    const int bs = one ? Q5_1_BYTES : Q5_0_BYTES, qh_at = one ? 4 : 2, qs_at = qh_at + 4;
    const q5_row_view R = q5_view(one, row, nb);
    for (int64_t sp = 0; sp < R.spans_n; ++sp) {
        uint8_t *span = row + sp * R.span_bytes;
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
    uint8_t *qs = (uint8_t *)R.qs, *bits = (uint8_t *)R.bits, *d = (uint8_t *)R.d, *m = (uint8_t *)R.m;
    for (int64_t b = 0; b < R.tail; ++b) {
        const uint8_t *blk = file + (16 * R.spans_n + b) * bs;
        const int64_t g = b / 4, r = R.tail - 4 * g < 4 ? R.tail - 4 * g : 4, lane = b % 4;
        memcpy(qs + 16 * b, blk + qs_at, 16);
        memcpy(bits + 16 * g + 2 * lane, blk + qh_at, 2);             /* qh bits 0..15 */
        memcpy(bits + 16 * g + 2 * r + 2 * lane, blk + qh_at + 2, 2); /* qh bits 16..31 */
        memcpy(d + 2 * b, blk, 2);
        if (one) memcpy(m + 2 * b, blk + 2, 2);
    }
}

static int q5_repack(const int one, uint8_t *data, int64_t n, int64_t k) {
    const int64_t nb = k / TL_QK, row_bytes = nb * (one ? Q5_1_BYTES : Q5_0_BYTES);
    uint8_t file[65536]; /* QUANT_MAX_ROW_BYTES: the driver refuses longer rows */
    for (int64_t i = 0; i < n; ++i) {
        memcpy(file, data + i * row_bytes, (size_t)row_bytes);
        q5_repack_row(one, file, data + i * row_bytes, nb);
    }
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

/* Tail group g (r blocks) likewise into q[32 r], scale[r], min[r]. */
static inline void q5_group_unpack(const int one, const q5_row_view *R, int64_t g, int r, uint8_t *q, float *scale,
                                   float *min) {
    __m512i lo, hi;
    __m512 dw, mw = _mm512_setzero_ps();
    q5_group(one, R, g, r, &lo, &hi, &dw, &mw);
    uint8_t lo_b[64], hi_b[64];
    float dv[16], mv[16];
    _mm512_storeu_si512(lo_b, lo);
    _mm512_storeu_si512(hi_b, hi);
    _mm512_storeu_ps(dv, dw);
    _mm512_storeu_ps(mv, mw);
    for (int b = 0; b < r; ++b) {
        memcpy(q + 32 * b, lo_b + 16 * b, 16);
        memcpy(q + 32 * b + 16, hi_b + 16 * b, 16);
        scale[b] = dv[4 * b];
        min[b] = one ? mv[4 * b] : -16.0f * dv[4 * b];
    }
}

/* Row r as quants (0..31, natural order) with per-block scale d and minimum (m, or -16 d for Q5_0): the
 * dequantized weight is scale q + min. The many-row path's tl_u8_row_fn. */
static inline __attribute__((always_inline)) void q5_unpack_row(const int one, const uint8_t *w, int64_t r, int64_t k,
                                                                uint8_t *q, float *scale, float *min) {
    const int64_t nb = k / TL_QK, row_bytes = nb * (one ? Q5_1_BYTES : Q5_0_BYTES);
    const q5_row_view R = q5_view(one, w + r * row_bytes, nb);
    for (int64_t sp = 0; sp < R.spans_n; ++sp)
        q5_span_unpack(one, R.spans + sp * R.span_bytes, q + 512 * sp, scale + 16 * sp, min + 16 * sp);
    const int64_t b0 = 16 * R.spans_n;
    for (int64_t g = 0; 4 * g < R.tail; ++g) {
        const int64_t b = b0 + 4 * g;
        q5_group_unpack(one, &R, g, R.tail - 4 * g < 4 ? (int)(R.tail - 4 * g) : 4, q + 32 * b, scale + b, min + b);
    }
}

static void q5_0_u8(const uint8_t *w, int64_t n, int64_t r, int64_t k, uint8_t *q, float *scale, float *min) {
    (void)n;
    q5_unpack_row(0, w, r, k, q, scale, min);
}
static void q5_1_u8(const uint8_t *w, int64_t n, int64_t r, int64_t k, uint8_t *q, float *scale, float *min) {
    (void)n;
    q5_unpack_row(1, w, r, k, q, scale, min);
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

/* Exact dequantize of row r, a span or a tail group at a time. */
static inline __attribute__((always_inline)) void q5_dequant(const int one, const uint8_t *w, int64_t r, int64_t k,
                                                             float *out) {
    const int64_t nb = k / TL_QK, row_bytes = nb * (one ? Q5_1_BYTES : Q5_0_BYTES);
    const q5_row_view R = q5_view(one, w + r * row_bytes, nb);
    uint8_t q[512];
    float scale[16], min[16];
    for (int64_t sp = 0; sp < R.spans_n; ++sp) {
        q5_span_unpack(one, R.spans + sp * R.span_bytes, q, scale, min);
        q5_blocks_out(q, scale, min, 16, out + 512 * sp);
    }
    for (int64_t g = 0; 4 * g < R.tail; ++g) {
        const int blocks = R.tail - 4 * g < 4 ? (int)(R.tail - 4 * g) : 4;
        q5_group_unpack(one, &R, g, blocks, q, scale, min);
        q5_blocks_out(q, scale, min, blocks, out + 32 * (16 * R.spans_n + 4 * g));
    }
}
static void q5_0_dequant(const uint8_t *w, int64_t n, int64_t r, int64_t k, float *out) {
    (void)n;
    q5_dequant(0, w, r, k, out);
}
static void q5_1_dequant(const uint8_t *w, int64_t n, int64_t r, int64_t k, float *out) {
    (void)n;
    q5_dequant(1, w, r, k, out);
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
