/*
 * GGUF k-quant types (Q4_K, Q5_K, Q6_K: 256-element super-blocks) for csrc/quant_gemm.c: per-type dot
 * kernels against int8 activations (quant_common.h), exact dequantize, and a same-size re-layout of each
 * super-block (`repack_row`, applied once by `prepare`) that dot_rows and dequant_row read.
 *
 * Built inside kernels.c, after quant_common.h. `tl_kquant_type(type)` is the family's table lookup: the
 * type's functions, or NULL when this family does not handle the type.
 *
 * Layouts (ggml's block_q4_K / block_q5_K / block_q6_K, as gguf-py's quants.py dequantizes them):
 *   Q4_K (144 B): f16 d, f16 dmin, u8 scales[12], u8 qs[128]. Eight sub-blocks of 32 with a 6-bit scale sc and
 *        6-bit min m packed in scales[12]; w = d*sc*q - dmin*m. qs holds each 64-element chunk in 32 bytes:
 *        low nibbles are its first 32 elements, high nibbles the next 32.
 *   Q5_K (176 B): f16 d, f16 dmin, u8 scales[12], u8 qh[32], u8 qs[128]: Q4_K plus a fifth bit, element
 *        32*j + l's in bit j of qh[l].
 *   Q6_K (210 B): u8 ql[128], u8 qh[64], i8 scales[16], f16 d. Sixteen sub-blocks of 16, w = d*sc*(q - 32):
 *        element 128*h + 64*s + l (l < 64) has its low nibble in ql[64*h + l] (nibble s) and its high two bits
 *        in qh[32*h + l % 32] at bit 2*(2*s + l / 32).
 *
 * Exactness: d*sc is exact in float32 (an f16 times an integer below 2^8), and so is d*sc*q (at most 23
 * significant bits), so the dequantized value has at most one rounding (Q4_K/Q5_K's "- dmin*m"), the same
 * one numpy's float32 arithmetic makes, in any association or fused multiply-add: bit-equal to gguf-py.
 *
 * Dot kernel: vpdpbusd multiplies 64 unsigned weight quants by 64 signed activation bytes into 16 int32
 * lanes of 4 products each. The re-layout orders each super-block's 256 quants as four such vectors in which
 * every int32 lane lies in the same sub-block in all four (Q4_K/Q5_K: 8-byte runs, two lanes per 32-element
 * sub-block; Q6_K: 4-byte runs, one lane per 16-element sub-block), so the four vpdpbusd of a super-block
 * chain into one int32 vector and each output pays one int->float conversion, one scale product and one
 * fused multiply-add per super-block (the earlier layout, two lanes' worth of sub-blocks per vector pair,
 * paid two of each; measured on a Xeon core, Q4_K at batch 1's two int8 rows: 29.6 -> 25.3 cycles a
 * super-block, 24.3 with GFNI's high nibbles; Q6_K 35.5 -> 29.6). The
 * activations, in natural order, are regrouped to match with eight shuffles per super-block (a 4 x 4
 * transpose of 8-byte or 4-byte units; the same transpose turns the weights back into natural order). Each
 * int32 lane is then converted and accumulated with its own scale (weight sub-block scale x activation block
 * scale): per-lane float accumulators, one horizontal sum per output. Q4_K/Q5_K's min terms (dmin*m_j *
 * d_a*s_a per sub-block) are one 8-lane product per super-block; Q6_K's -32 offset enters vpdpbusd's
 * accumulator as -32 * (the activation bytes' sum per lane). Weight rows are processed RB at a time and
 * activation rows MB at a time (register blocking), so a decoded super-block serves every activation row and
 * an activation super-block every weight row. One activation row's two int8 terms (tl_act_q8.paired, the
 * second scaled by exactly 1/128 of the first) go through as one: both vpdpbusd chains joined as
 * 128 dot0 + dot1, then one conversion and one scaling (kq_pair_dot; one thread from cache, Q4_K 2048 x 2048
 * 110.3 -> 101.5 us, Q6_K 2048 x 8192 588 -> 571). The portable build (no AVX512-VNNI/VBMI) dequantizes a
 * super-block and sums in float.
 */
#ifndef TOKENLOOM_QUANT_KQUANTS_C
#define TOKENLOOM_QUANT_KQUANTS_C

#include "bf16_common.h"
#include "quant_common.h"
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__F16C__)
#define KQ_VNNI 1
#else
#define KQ_VNNI 0
#endif

#define KQ_K 256 /* elements per super-block */
#define KQ4_BYTES 144
#define KQ5_BYTES 176
#define KQ6_BYTES 210

/* IEEE half -> float, exactly (every f16 is a float32). */
static inline float kq_f16(const uint8_t *p) {
    uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
#if defined(__F16C__)
    return _cvtsh_ss((unsigned short)h);
#endif
    uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    } else {
        float f = (float)mant * (1.0f / 16777216.0f); /* subnormal: mant * 2^-24, exact */
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Q4_K/Q5_K's 12 scale bytes -> sc[8], m[8] (6 bits each). Bytes 0-3: sc 0-3 (low 6 bits) and the top two
 * bits of sc 4-7; bytes 4-7: m 0-3 and the top bits of m 4-7; bytes 8-11: low nibbles of sc 4-7 and (high
 * nibbles) of m 4-7. Done on 32-bit words, four sub-blocks per operation. */
static inline void kq_scale_min(const uint8_t *s, uint8_t sc[8], uint8_t m[8]) {
    uint32_t u0, u1, u2, t[4];
    memcpy(&u0, s, 4);
    memcpy(&u1, s + 4, 4);
    memcpy(&u2, s + 8, 4);
    t[0] = u0 & 0x3f3f3f3fu;
    t[1] = (u2 & 0x0f0f0f0fu) | ((u0 >> 2) & 0x30303030u);
    t[2] = u1 & 0x3f3f3f3fu;
    t[3] = ((u2 >> 4) & 0x0f0f0f0fu) | ((u1 >> 2) & 0x30303030u);
    memcpy(sc, t, 8);
    memcpy(m, t + 2, 8);
}

/* ---------------------------------------------------------------- Q4_K/Q5_K re-layout
 *
 * `prepare` re-lays each Q4_K/Q5_K super-block out (same size, same bits) so the dot kernel decodes it with a
 * few vector operations:
 *   bytes 0-7:  f16 d    | sc_j << (16 + 6j)   (one little-endian 64-bit word; j = 0..7)
 *   bytes 8-15: f16 dmin | m_j  << (16 + 6j)
 *   Q5_K only, 32 bytes: four 64-bit masks, the fifth bits of the quant vectors V0..V3 below
 *   64 bytes: low nibbles = V0, high nibbles = V1;  64 bytes: low nibbles = V2, high nibbles = V3
 * where 8-byte run u (bytes 8u..8u+7) of V_v holds elements 8v..8v+7 of sub-block kq_sub(u) = 2 (u % 4) +
 * u / 4. So int32 lanes 2u and 2u + 1 of all four vectors lie in sub-block kq_sub(u) and vpdpbusd sums them
 * in one accumulator. In units of 8 bytes this is a 4 x 4 transpose within each 256-bit half: run u of V_v is
 * run v + 4 (u / 4) of the natural-order 64-byte chunk u % 4 (kq45_swap; its own inverse). */

static inline int kq_sub(int u) { return 2 * (u % 4) + u / 4; }
/* Element of super-block position (vector v in V0..V3; byte b). */
static inline int kq_elem(int v, int b) { return 32 * kq_sub(b / 8) + 8 * v + b % 8; }

static void kq45_repack_row(uint8_t *row, int64_t k, int five) {
    const int64_t bytes = five ? KQ5_BYTES : KQ4_BYTES;
    for (int64_t blk = 0; blk < k / KQ_K; ++blk) {
        uint8_t *p = row + blk * bytes, q[KQ_K], sc[8], m[8], out[KQ5_BYTES];
        const uint8_t *qh = p + 16, *qs = p + (five ? 48 : 16);
        kq_scale_min(p + 4, sc, m);
        for (int e = 0; e < KQ_K; ++e) {
            const int j = e / 32, l = e % 32;
            q[e] = (uint8_t)(((qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0xf) | (five ? ((qh[l] >> j) & 1) << 4 : 0));
        }
        uint64_t w0 = (uint64_t)p[0] | ((uint64_t)p[1] << 8), w1 = (uint64_t)p[2] | ((uint64_t)p[3] << 8);
        for (int j = 0; j < 8; ++j) {
            w0 |= (uint64_t)sc[j] << (16 + 6 * j);
            w1 |= (uint64_t)m[j] << (16 + 6 * j);
        }
        memcpy(out, &w0, 8);
        memcpy(out + 8, &w1, 8);
        uint8_t *nib = out + (five ? 48 : 16);
        for (int v = 0; v < 4; ++v) {
            uint64_t mask = 0;
            for (int b = 0; b < 64; ++b) {
                const int e = kq_elem(v, b);
                mask |= (uint64_t)(q[e] >> 4) << b;
                if (v % 2 == 0) nib[64 * (v / 2) + b] = q[e] & 0xf;
                else nib[64 * (v / 2) + b] |= (uint8_t)((q[e] & 0xf) << 4);
            }
            if (five) memcpy(out + 16 + 8 * v, &mask, 8);
        }
        memcpy(p, out, (size_t)bytes);
    }
}
static void kq4_repack_row(uint8_t *row, int64_t k) { kq45_repack_row(row, k, 0); }
static void kq5_repack_row(uint8_t *row, int64_t k) { kq45_repack_row(row, k, 1); }

/* ---------------------------------------------------------------- dequantize (portable, exact) */

/* Q4_K/Q5_K in the re-laid-out form above. */
static void kq45_dequant_row(const uint8_t *row, int64_t k, float *out, int five) {
    const int64_t bytes = five ? KQ5_BYTES : KQ4_BYTES;
    for (int64_t blk = 0; blk < k / KQ_K; ++blk, out += KQ_K) {
        const uint8_t *p = row + blk * bytes, *nib = p + (five ? 48 : 16);
        uint64_t w0, w1;
        memcpy(&w0, p, 8);
        memcpy(&w1, p + 8, 8);
        const float d = kq_f16(p), dmin = kq_f16(p + 8);
        for (int v = 0; v < 4; ++v) {
            uint64_t mask = 0;
            if (five) memcpy(&mask, p + 16 + 8 * v, 8);
            for (int b = 0; b < 64; ++b) {
                const int e = kq_elem(v, b), j = e / 32;
                const int q = ((nib[64 * (v / 2) + b] >> (4 * (v % 2))) & 0xf) | (int)(((mask >> b) & 1) << 4);
                const float ds = d * (float)((w0 >> (16 + 6 * j)) & 63), dm = dmin * (float)((w1 >> (16 + 6 * j)) & 63);
                out[e] = ds * (float)q - dm;
            }
        }
    }
}

/* ---------------------------------------------------------------- Q6_K re-layout
 *
 * Same idea for Q6_K (210 bytes; d stays at bytes 208-209): its sub-blocks are 16 elements, so int32 lane l of
 * each of the four quant vectors V0..V3 lies in sub-block kq6_sub(l) = 4 (l % 4) + l / 4 and holds its
 * elements 4v..4v+3 (a 4 x 4 transpose of 4-byte units within each 128-bit lane, kq6_swap; its own inverse).
 *   bytes 0-63: low nibbles V0, high nibbles V1 (low 4 bits of the 6-bit quants); bytes 64-127: V2, V3
 *   bytes 128-191: byte b holds the top two bits of V0[b], V1[b], V2[b], V3[b] at bits 0-1, 2-3, 4-5, 6-7
 *   bytes 192-207: the sub-block scales in lane order (byte 192 + l: sub-block kq6_sub(l)'s) */

static inline int kq6_sub(int l) { return 4 * (l % 4) + l / 4; }
static inline int kq6_elem(int v, int b) { return 16 * kq6_sub(b / 4) + 4 * v + b % 4; }

static void kq6_repack_row(uint8_t *row, int64_t k) {
    for (int64_t blk = 0; blk < k / KQ_K; ++blk) {
        uint8_t *p = row + blk * KQ6_BYTES, q[KQ_K], out[208] = {0};
        for (int e = 0; e < KQ_K; ++e) { /* the file layout (see the top of this file) */
            const int h = e / 128, s = (e / 64) % 2, l = e % 64;
            const int hi = (p[128 + 32 * h + l % 32] >> (2 * (2 * s + l / 32))) & 3;
            q[e] = (uint8_t)(((p[64 * h + l] >> (4 * s)) & 0xf) | (hi << 4));
        }
        for (int v = 0; v < 4; ++v)
            for (int b = 0; b < 64; ++b) {
                const int e = kq6_elem(v, b);
                out[64 * (v / 2) + b] |= (uint8_t)((q[e] & 0xf) << (4 * (v % 2)));
                out[128 + b] |= (uint8_t)((q[e] >> 4) << (2 * v));
            }
        for (int l = 0; l < 16; ++l) out[192 + l] = p[192 + kq6_sub(l)];
        memcpy(p, out, sizeof out);
    }
}

static void kq6_dequant_row(const uint8_t *row, int64_t k, float *out) {
    for (int64_t blk = 0; blk < k / KQ_K; ++blk, out += KQ_K) {
        const uint8_t *p = row + blk * KQ6_BYTES;
        const int8_t *sc = (const int8_t *)(p + 192);
        const float d = kq_f16(p + 208);
        for (int v = 0; v < 4; ++v)
            for (int b = 0; b < 64; ++b) {
                const int e = kq6_elem(v, b);
                const int q = ((p[64 * (v / 2) + b] >> (4 * (v % 2))) & 0xf) | (((p[128 + b] >> (2 * v)) & 3) << 4);
                out[e] = (d * (float)sc[kq6_sub(e / 16)]) * (float)(q - 32);
            }
    }
}

static void kq4_dequant_row(const uint8_t *row, int64_t k, float *out) { kq45_dequant_row(row, k, out, 0); }
static void kq5_dequant_row(const uint8_t *row, int64_t k, float *out) { kq45_dequant_row(row, k, out, 1); }

/* ---------------------------------------------------------------- dot kernels */

#if KQ_VNNI

/* Software prefetch of the same super-block RB rows on (times tl_quant_prefetch_tiles; 1: measured best of
 * 1 / 2 / 4 / 8): the next row group's, about one DRAM latency ahead at
 * k >= 2048. The hardware prefetchers alone left a single-thread stream at ~70% of this rate (microbenchmark,
 * a 75 MB weight read from memory). A prefetch never faults, so running past the matrix is harmless. It fills
 * L2 (`tl_quant_prefetch_l2`, quant_common.h). */
static inline __attribute__((always_inline)) void kq_prefetch(const uint8_t *p, int bytes) {
    for (int o = 0; o < bytes + 63; o += 64) TL_QUANT_PREFETCH(p + o);
}

/* 16-byte lane g (a compile-time constant after unrolling) of v. */
static inline __attribute__((always_inline)) __m128i kq_lane(__m512i v, int g) {
    switch (g) {
    case 0: return _mm512_castsi512_si128(v);
    case 1: return _mm512_extracti32x4_epi32(v, 1);
    case 2: return _mm512_extracti32x4_epi32(v, 2);
    default: return _mm512_extracti32x4_epi32(v, 3);
    }
}

/* Q4_K/Q5_K's 4 x 4 transpose of 8-byte runs within each 256-bit half: out[v] run u = in[u % 4] run
 * v + 4 (u / 4). Natural-order 64-byte chunks in, the re-layout's V0..V3 order out, and back (its own
 * inverse). Eight shuffles. */
static inline __attribute__((always_inline)) void kq45_swap(const __m512i in[4], __m512i out[4]) {
    const __m512i idx_a = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), idx_b = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    const __m512i t0 = _mm512_unpacklo_epi64(in[0], in[1]), t1 = _mm512_unpackhi_epi64(in[0], in[1]);
    const __m512i t2 = _mm512_unpacklo_epi64(in[2], in[3]), t3 = _mm512_unpackhi_epi64(in[2], in[3]);
    out[0] = _mm512_permutex2var_epi64(t0, idx_a, t2);
    out[1] = _mm512_permutex2var_epi64(t1, idx_a, t3);
    out[2] = _mm512_permutex2var_epi64(t0, idx_b, t2);
    out[3] = _mm512_permutex2var_epi64(t1, idx_b, t3);
}

/* Q6_K's 4 x 4 transpose of 4-byte units within each 128-bit lane: out[v] lane l = in[l % 4] lane
 * v + 4 (l / 4) (in int32 lanes). Natural order in, the re-layout's V0..V3 out, and back. Eight shuffles. */
static inline __attribute__((always_inline)) void kq6_swap(const __m512i in[4], __m512i out[4]) {
    const __m512i t0 = _mm512_unpacklo_epi32(in[0], in[1]), t1 = _mm512_unpackhi_epi32(in[0], in[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(in[2], in[3]), t3 = _mm512_unpackhi_epi32(in[2], in[3]);
    out[0] = _mm512_unpacklo_epi64(t0, t2);
    out[1] = _mm512_unpackhi_epi64(t0, t2);
    out[2] = _mm512_unpacklo_epi64(t1, t3);
    out[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* The natural-order activation super-block at xq as four 64-byte vectors. */
static inline __attribute__((always_inline)) void kq_load4(const int8_t *xq, __m512i c[4]) {
    for (int t = 0; t < 4; ++t) c[t] = _mm512_loadu_si512(xq + 64 * t);
}

/* A re-laid-out Q6_K super-block: v = V0..V3 (unsigned 6-bit quants); returns d * sc in lane order (lane l:
 * sub-block kq6_sub(l)'s, the lanes of V0..V3 it scales). */
static inline __attribute__((always_inline)) __m512 kq6_decode(const uint8_t *blk, __m512i v[4]) {
    const __m512i nib = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    const __m512i l0 = _mm512_loadu_si512(blk), l1 = _mm512_loadu_si512(blk + 64), hb = _mm512_loadu_si512(blk + 128);
    /* 0xF8: a | (b & c): the low nibble, then the two high bits moved to bits 4-5 */
    v[0] = _mm512_ternarylogic_epi32(_mm512_and_si512(l0, nib), _mm512_slli_epi16(hb, 4), m30, 0xF8);
    v[1] = _mm512_ternarylogic_epi32(tl_high_nibbles(l0), _mm512_slli_epi16(hb, 2), m30, 0xF8);
    v[2] = _mm512_ternarylogic_epi32(_mm512_and_si512(l1, nib), hb, m30, 0xF8);
    v[3] = _mm512_ternarylogic_epi32(tl_high_nibbles(l1), _mm512_srli_epi16(hb, 2), m30, 0xF8);
    return _mm512_mul_ps(_mm512_set1_ps(kq_f16(blk + 208)),
                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192)))));
}

/* A re-laid-out Q4_K/Q5_K super-block: v = V0..V3 (unsigned 4/5-bit quants); returns d * sc_j in lanes
 * 0-7 and dmin * m_j in lanes 8-15. */
static inline __attribute__((always_inline)) __m512 kq45_decode(int five, const uint8_t *blk, __m512i v[4]) {
    const __m512i nib = _mm512_set1_epi8(0x0f);
    /* header word w (16 + 6j bit offsets) -> bytes j: sc_j (low qword) and m_j (high qword) */
    const __m128i fields = _mm_set1_epi64x(0x3a342e28221c1610LL);
    const __m512i dd_idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    const uint8_t *qs = blk + (five ? 48 : 16);
    const __m128i hdr = _mm_loadu_si128((const __m128i *)blk);
    const __m128i scm = _mm_and_si128(_mm_multishift_epi64_epi8(fields, hdr), _mm_set1_epi8(63));
    /* d in lanes 0-7, dmin in 8-15 (f16 words 0 and 4) */
    const __m512 dd = _mm512_permutexvar_ps(dd_idx, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_shuffle_epi32(hdr, 0x08))));
    const __m512i w0 = _mm512_loadu_si512(qs), w1 = _mm512_loadu_si512(qs + 64);
    v[0] = _mm512_and_si512(w0, nib);
    v[1] = tl_high_nibbles(w0);
    v[2] = _mm512_and_si512(w1, nib);
    v[3] = tl_high_nibbles(w1);
    if (five)
        for (int t = 0; t < 4; ++t) {
            uint64_t bits;
            memcpy(&bits, blk + 16 + 8 * t, 8);
            v[t] = _mm512_mask_add_epi8(v[t], _cvtu64_mask64(bits), v[t], _mm512_set1_epi8(16));
        }
    return _mm512_mul_ps(dd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(scm)));
}

/* Exact dequantize of re-laid-out rows (see the exactness note at the top): one fused multiply-add (Q4_K,
 * Q5_K: d*sc * q - dmin*m, the product exact) or one exact product (Q6_K) per element. */
static void kq45_dequant_row_avx(const uint8_t *row, int64_t k, float *out, int five) {
    const int64_t bytes = five ? KQ5_BYTES : KQ4_BYTES;
    for (int64_t blk = 0; blk < k / KQ_K; ++blk, out += KQ_K) {
        __m512i v[4], nat[4];
        const __m512 wv = kq45_decode(five, row + blk * bytes, v);
        float sc[16];
        _mm512_storeu_ps(sc, wv);
        kq45_swap(v, nat);
        for (int t = 0; t < 4; ++t)
            for (int g = 0; g < 4; ++g) { /* natural elements 64t + 16g.., of sub-block 2t + g / 2 */
                const int e = 64 * t + 16 * g, j = e / 32;
                const __m512 qf = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(kq_lane(nat[t], g)));
                _mm512_storeu_ps(out + e, _mm512_fmsub_ps(_mm512_set1_ps(sc[j]), qf, _mm512_set1_ps(sc[8 + j])));
            }
    }
}
static void kq4_dequant_row_avx(const uint8_t *row, int64_t k, float *out) { kq45_dequant_row_avx(row, k, out, 0); }

/* Unsigned quants in natural order with per-sub-block (32 columns) scale d*sc_j and minimum -dmin*m_j
 * (quant_common.h's tl_u8_row_fn): the same lanes the dequantize above writes, as bytes. */
static void kq45_u8_row(const uint8_t *row, int64_t k, uint8_t *q, float *scale, float *min, int five) {
    const int64_t bytes = five ? KQ5_BYTES : KQ4_BYTES;
    for (int64_t blk = 0; blk < k / KQ_K; ++blk, q += KQ_K, scale += 8, min += 8) {
        __m512i v[4], nat[4];
        float sc[16];
        _mm512_storeu_ps(sc, kq45_decode(five, row + blk * bytes, v));
        kq45_swap(v, nat);
        for (int t = 0; t < 4; ++t) _mm512_storeu_si512(q + 64 * t, nat[t]);
        for (int j = 0; j < 8; ++j) {
            scale[j] = sc[j];
            min[j] = -sc[8 + j];
        }
    }
}
static void kq4_u8_row(const uint8_t *row, int64_t k, uint8_t *q, float *scale, float *min) {
    kq45_u8_row(row, k, q, scale, min, 0);
}
static void kq5_u8_row(const uint8_t *row, int64_t k, uint8_t *q, float *scale, float *min) {
    kq45_u8_row(row, k, q, scale, min, 1);
}
static void kq5_dequant_row_avx(const uint8_t *row, int64_t k, float *out) { kq45_dequant_row_avx(row, k, out, 1); }

/* A re-laid-out Q6_K super-block's 16 sub-blocks as 16 unsigned quants each, in natural order, and d * sc_j. */
static inline __attribute__((always_inline)) void kq6_sub_blocks(const uint8_t *blk, __m128i sub[16], float sc[16]) {
    __m512i v[4], nat[4];
    float lane_sc[16];
    _mm512_storeu_ps(lane_sc, kq6_decode(blk, v));
    kq6_swap(v, nat);
    for (int j = 0; j < 16; ++j) { /* sub-block j: natural elements 16j.. (lane j % 4 of vector j / 4) */
        sub[j] = kq_lane(nat[j / 4], j % 4);
        sc[j] = lane_sc[kq6_sub(j)];
    }
}

static void kq6_dequant_row_avx(const uint8_t *row, int64_t k, float *out) {
    const __m512i n32 = _mm512_set1_epi32(32);
    for (int64_t blk = 0; blk < k / KQ_K; ++blk, out += KQ_K) {
        __m128i sub[16];
        float sc[16];
        kq6_sub_blocks(row + blk * KQ6_BYTES, sub, sc);
        for (int j = 0; j < 16; ++j) {
            const __m512 qf = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(sub[j]), n32));
            _mm512_storeu_ps(out + 16 * j, _mm512_mul_ps(_mm512_set1_ps(sc[j]), qf));
        }
    }
}

/* Unsigned quants (0..63) in natural order with per-sub-block (16 columns) scale d*sc_j and minimum
 * -32 * d*sc_j, both exact (tl_u8_row_fn, u8_cols 16): the quants kq6_dequant_row_avx converts, as bytes. */
static void kq6_u8_row(const uint8_t *row, int64_t k, uint8_t *q, float *scale, float *min) {
    for (int64_t blk = 0; blk < k / KQ_K; ++blk, q += KQ_K, scale += 16, min += 16) {
        __m128i sub[16];
        float sc[16];
        kq6_sub_blocks(row + blk * KQ6_BYTES, sub, sc);
        for (int j = 0; j < 16; ++j) {
            _mm_storeu_si128((__m128i *)(q + 16 * j), sub[j]);
            scale[j] = sc[j];
            min[j] = -32.0f * sc[j];
        }
    }
}

/* Per-lane index vectors: lane l's sub-block, for the weight scales of Q4_K/Q5_K (kq_sub(l / 2)), and
 * lane l's 32-element activation block (Q4_K/Q5_K: the same; Q6_K: kq6_sub(l) / 2). */
static inline __m512i kq45_lane_sub(void) { return _mm512_setr_epi32(0, 0, 2, 2, 4, 4, 6, 6, 1, 1, 3, 3, 5, 5, 7, 7); }
static inline __m512i kq6_lane_act(void) { return _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 1, 3, 5, 7, 1, 3, 5, 7); }

/* One activation row's super-block (natural order at xq, block scales from da[0..7]) made ready for the dot:
 * x = V0..V3 order, as = d_a per lane; Q4_K/Q5_K: dsa = d_a * s_a per sub-block in lanes 8-15 (lanes 0-7
 * zero; for the min term); Q6_K: init = -32 * (the bytes' sum per lane), vpdpbusd's starting accumulator. */
static inline __attribute__((always_inline)) void kq_act_prep(int six, const int8_t *xq, const float *da,
                                                              const int32_t *sa, __m512i x[4], __m512 *as,
                                                              __m512 *dsa, __m512i *init) {
    __m512i c[4];
    kq_load4(xq, c);
    const __m512 d8 = _mm512_castps256_ps512(_mm256_loadu_ps(da));
    if (six) {
        const __m512i n32 = _mm512_set1_epi8(32);
        kq6_swap(c, x);
        __m512i sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), n32, x[0]), n32, x[1]);
        sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sum, n32, x[2]), n32, x[3]);
        *init = _mm512_sub_epi32(_mm512_setzero_si512(), sum);
        *as = _mm512_permutexvar_ps(kq6_lane_act(), d8);
    } else {
        kq45_swap(c, x);
        *as = _mm512_permutexvar_ps(kq45_lane_sub(), d8);
        const __m256 ds = _mm256_mul_ps(_mm256_loadu_ps(da), _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)sa)));
        *dsa = _mm512_insertf32x8(_mm512_setzero_ps(), ds, 1);
    }
}

/* A pair's (tl_act_q8.paired) scale vectors from row 0's (as0, dsa0, made by kq_act_prep) and both rows' block
 * scales and sums at o0 / o1: as0 becomes row 0's d / 128, the scale of 128 dot(row 0) + dot(row 1); Q4_K /
 * Q5_K's dsa0 the pair's d0 s0 + d1 s1 (one explicit fused multiply-add, so the stream and the tiles round it
 * alike). */
static inline __attribute__((always_inline)) void kq_pair_scales(int six, const tl_act_q8 *a, int64_t o0, int64_t o1,
                                                                 __m512 *as0, __m512 *dsa0) {
    *as0 = _mm512_mul_ps(*as0, _mm512_set1_ps(1.0f / (1 << TL_TERM2_SHIFT)));
    if (six) return;
    const __m256 s0 = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(a->s + o0)));
    const __m256 s1 = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(a->s + o1)));
    const __m256 ds = _mm256_fmadd_ps(_mm256_loadu_ps(a->d + o1), s1, _mm256_mul_ps(_mm256_loadu_ps(a->d + o0), s0));
    *dsa0 = _mm512_insertf32x8(_mm512_setzero_ps(), ds, 1);
}

/* One weight row's super-block against a prepared pair (x0 / init0, x1 / init1; as and dsa from kq_pair_scales):
 * the two rows' vpdpbusd chains joined as 128 dot0 + dot1 (exact in int32), then kq_block_dot's scaling once. */
static inline __attribute__((always_inline)) __m512 kq_pair_dot(int six, const __m512i v[4], const __m512i x0[4],
                                                                const __m512i x1[4], __m512i init0, __m512i init1,
                                                                __m512 ws, __m512 as, __m512 wv, __m512 dsa,
                                                                __m512 acc) {
    __m512i dot0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(init0, v[0], x0[0]), v[1], x0[1]);
    __m512i dot1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(init1, v[0], x1[0]), v[1], x1[1]);
    dot0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot0, v[2], x0[2]), v[3], x0[3]);
    dot1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot1, v[2], x1[2]), v[3], x1[3]);
    const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(dot0, TL_TERM2_SHIFT), dot1);
    if (!six) acc = _mm512_fnmadd_ps(wv, dsa, acc);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws, as), acc);
}

/* One weight row's super-block against one prepared activation row, into acc: the four vpdpbusd chained
 * (from init), converted once, times the per-lane weight scale ws and activation scale as; Q4_K/Q5_K also
 * subtract the min term (wv lanes 8-15: dmin * m_j, times dsa). */
static inline __attribute__((always_inline)) __m512 kq_block_dot(int six, const __m512i v[4], const __m512i x[4],
                                                                 __m512i init, __m512 ws, __m512 as, __m512 wv,
                                                                 __m512 dsa, __m512 acc) {
    __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(init, v[0], x[0]), v[1], x[1]);
    dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot, v[2], x[2]), v[3], x[3]);
    if (!six) acc = _mm512_fnmadd_ps(wv, dsa, acc);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws, as), acc);
}

/* Outputs for weight rows [j, j + RB) and activation rows [r0, r0 + MB) of a re-laid-out K type (six: Q6_K,
 * else Q4_K, or Q5_K with five). Per super-block, each activation row is prepared once (kq_act_prep) and
 * each weight row decoded once, then every pair meets in kq_block_dot. */
static inline __attribute__((always_inline)) void kq_tile(int six, int five, int RB, int MB, const int PAIRED,
                                                          const uint8_t *w, int64_t row_bytes, int64_t j,
                                                          const tl_act_q8 *a, int r0, float *out,
                                                          int64_t out_stride) {
    const int64_t k = a->k, nb = k / KQ_K, nblk32 = k / TL_QK;
    const int64_t bytes = six ? KQ6_BYTES : five ? KQ5_BYTES : KQ4_BYTES;
    const int64_t ahead = tl_quant_prefetch_tiles * RB * row_bytes;
    const __m512i lane_sub = kq45_lane_sub();
    __m512 acc[4][4];
    for (int i = 0; i < RB; ++i)
        for (int r = 0; r < MB; ++r) acc[i][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m512i x[4][4], init[4];
        __m512 as[4], dsa[4];
        for (int r = 0; r < MB; ++r) {
            const int64_t o = (int64_t)(r0 + r) * nblk32 + 8 * b;
            init[r] = _mm512_setzero_si512();
            dsa[r] = _mm512_setzero_ps();
            kq_act_prep(six, a->q + (int64_t)(r0 + r) * k + b * KQ_K, a->d + o, a->s + o, x[r], &as[r], &dsa[r],
                        &init[r]);
        }
        if (PAIRED) kq_pair_scales(six, a, 8 * b, nblk32 + 8 * b, &as[0], &dsa[0]);
        for (int i = 0; i < RB; ++i) {
            __m512i v[4];
            const uint8_t *blk = w + (j + i) * row_bytes + b * bytes;
            if (ahead) kq_prefetch(blk + ahead, (int)bytes);
            const __m512 wv = six ? kq6_decode(blk, v) : kq45_decode(five, blk, v);
            const __m512 ws = six ? wv : _mm512_permutexvar_ps(lane_sub, wv);
            if (PAIRED)
                acc[i][0] = kq_pair_dot(six, v, x[0], x[1], init[0], init[1], ws, as[0], wv, dsa[0], acc[i][0]);
            else
                for (int r = 0; r < MB; ++r)
                    acc[i][r] = kq_block_dot(six, v, x[r], init[r], ws, as[r], wv, dsa[r], acc[i][r]);
        }
    }
    for (int i = 0; i < RB; ++i) /* (a pair's row 1: its accumulator stayed 0) */
        for (int r = 0; r < MB; ++r) out[(int64_t)(r0 + r) * out_stride + i] = _mm512_reduce_add_ps(acc[i][r]);
}

/* ---- the row-sequential stream (few activation rows) ----
 *
 * The tiles above walk RB rows side by side: RB short runs inside each 4 KiB page (Q4_K rows of k = 2048 are
 * 1152 B apart), which the hardware prefetchers, following one run per page, lose. Read alone, that pattern
 * moves 15 GB/s on the Zen 4 EPYC (23 with the tiles' software prefetch), one run per thread 28-30 (a read
 * microbenchmark, 512 MB, two threads). So for few activation rows each weight row is read whole, one after
 * another; what the tiles shared across RB rows (the activations regrouped to the weights' lane order and
 * their scales) is prepared once per dot_rows call (a chunk of 16 weight rows) into a stack buffer and read
 * back from L1/L2 by every row of it. */
#define KQ_SEQ_VECS 1024 /* 64 KiB of prepared activations */
#define KQ_SEQ_STRIDE 8  /* vectors per (activation row, super-block) */
#define KQ_SEQ_MAX_MB 4  /* activation rows per pass over the weight rows */
#define KQ_SEQ_AHEAD 4096 /* software prefetch distance of the stream (x tl_quant_prefetch_tiles), bytes */
#define KQ_SEQ_PAGE 4096  /* the stream runs for rows shorter than this (bytes) */

/* Activation rows [r0, r0 + mb), super-block b, at prep[(b * mb + r) * 8]: kq_act_prep's x (V0..V3 order),
 * then as, dsa (Q4_K/Q5_K) and init (Q6_K). */
enum { KQ_PREP_AS = 4, KQ_PREP_DSA = 5, KQ_PREP_INIT = 6 };
static void kq_seq_prep(int six, const tl_act_q8 *a, int r0, int mb, __m512i *prep) {
    const int64_t k = a->k, nb = k / KQ_K, nblk32 = k / TL_QK;
    for (int64_t b = 0; b < nb; ++b)
        for (int r = 0; r < mb; ++r) {
            __m512i *p = prep + (b * mb + r) * KQ_SEQ_STRIDE;
            const int64_t o = (int64_t)(r0 + r) * nblk32 + 8 * b;
            __m512 as, dsa = _mm512_setzero_ps();
            __m512i init = _mm512_setzero_si512();
            kq_act_prep(six, a->q + (int64_t)(r0 + r) * k + b * KQ_K, a->d + o, a->s + o, p, &as, &dsa, &init);
            p[KQ_PREP_AS] = _mm512_castps_si512(as);
            p[KQ_PREP_DSA] = _mm512_castps_si512(dsa);
            p[KQ_PREP_INIT] = init;
        }
    if (a->paired) /* row 0's scale vectors become the pair's (only the paired stream reads them) */
        for (int64_t b = 0; b < nb; ++b) {
            __m512i *p = prep + b * mb * KQ_SEQ_STRIDE;
            __m512 as = _mm512_castsi512_ps(p[KQ_PREP_AS]), dsa = _mm512_castsi512_ps(p[KQ_PREP_DSA]);
            kq_pair_scales(six, a, 8 * b, nblk32 + 8 * b, &as, &dsa);
            p[KQ_PREP_AS] = _mm512_castps_si512(as);
            p[KQ_PREP_DSA] = _mm512_castps_si512(dsa);
        }
}

/* Weight rows [n0, n1), each read whole in turn, against the MB prepared activation rows (from r0); PAIRED (MB 2):
 * the pair's sum as row 0's output, 0 as row 1's. */
static inline __attribute__((always_inline)) void kq_seq_rows(int type, const int MB, const int PAIRED,
                                                              const uint8_t *w, int64_t row_bytes, int64_t n0,
                                                              int64_t n1, int64_t k, const __m512i *prep, int r0,
                                                              float *out, int64_t out_stride) {
    const int six = type == 6, five = type == 5;
    const int64_t nb = k / KQ_K, bytes = six ? KQ6_BYTES : five ? KQ5_BYTES : KQ4_BYTES;
    const int64_t ahead = (int64_t)tl_quant_prefetch_tiles * KQ_SEQ_AHEAD;
    const __m512i lane_sub = kq45_lane_sub();
    for (int64_t j = n0; j < n1; ++j) {
        const uint8_t *row = w + j * row_bytes;
        __m512 acc[KQ_SEQ_MAX_MB];
        for (int r = 0; r < MB; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = row + b * bytes;
            if (ahead) kq_prefetch(blk + ahead, (int)bytes);
            const __m512i *p = prep + b * MB * KQ_SEQ_STRIDE;
            __m512i v[4];
            const __m512 wv = six ? kq6_decode(blk, v) : kq45_decode(five, blk, v);
            const __m512 ws = six ? wv : _mm512_permutexvar_ps(lane_sub, wv);
            if (PAIRED) {
                const __m512i *x0 = p, *x1 = p + KQ_SEQ_STRIDE;
                const __m512i zero = _mm512_setzero_si512();
                acc[0] = kq_pair_dot(six, v, x0, x1, six ? x0[KQ_PREP_INIT] : zero, six ? x1[KQ_PREP_INIT] : zero, ws,
                                     _mm512_castsi512_ps(x0[KQ_PREP_AS]), wv, _mm512_castsi512_ps(x0[KQ_PREP_DSA]),
                                     acc[0]);
                continue;
            }
            for (int r = 0; r < MB; ++r) {
                const __m512i *x = p + r * KQ_SEQ_STRIDE;
                acc[r] = kq_block_dot(six, v, x, six ? x[KQ_PREP_INIT] : _mm512_setzero_si512(), ws, _mm512_castsi512_ps(x[KQ_PREP_AS]), wv,
                                      _mm512_castsi512_ps(x[KQ_PREP_DSA]), acc[r]);
            }
        }
        for (int r = 0; r < MB; ++r)
            out[(int64_t)(r0 + r) * out_stride + (j - n0)] = PAIRED && r ? 0.0f : _mm512_reduce_add_ps(acc[r]);
    }
}

/* The stream for every activation row, KQ_SEQ_MAX_MB at a time (the chunk's weight rows are re-read from
 * cache for each further pass); 0 when the prepared activations of one pass would not fit the buffer. */
static inline __attribute__((always_inline)) int kq_seq_dot(int type, const uint8_t *w, int64_t row_bytes,
                                                            int64_t n0, int64_t n1, const tl_act_q8 *a, float *out,
                                                            int64_t out_stride) {
    const int64_t nb = a->k / KQ_K;
    const int mb_max = a->m < KQ_SEQ_MAX_MB ? a->m : KQ_SEQ_MAX_MB;
    /* rows of a page or more each: the tiles' runs lie in pages of their own, which the prefetchers follow
     * (k = 8192: the tiles 1.4-1.5x faster than the stream, whose prepared activations then outgrow L1) */
    if (row_bytes >= KQ_SEQ_PAGE || nb * mb_max * KQ_SEQ_STRIDE > KQ_SEQ_VECS) return 0;
    __m512i prep[KQ_SEQ_VECS];
    for (int r0 = 0; r0 < a->m; r0 += KQ_SEQ_MAX_MB) {
        const int mb = a->m - r0 < KQ_SEQ_MAX_MB ? a->m - r0 : KQ_SEQ_MAX_MB;
        kq_seq_prep(type == 6, a, r0, mb, prep);
        switch (mb) {
        case 4: kq_seq_rows(type, 4, 0, w, row_bytes, n0, n1, a->k, prep, r0, out, out_stride); break;
        case 3: kq_seq_rows(type, 3, 0, w, row_bytes, n0, n1, a->k, prep, r0, out, out_stride); break;
        case 2:
            if (a->paired)
                kq_seq_rows(type, 2, 1, w, row_bytes, n0, n1, a->k, prep, r0, out, out_stride);
            else
                kq_seq_rows(type, 2, 0, w, row_bytes, n0, n1, a->k, prep, r0, out, out_stride);
            break;
        default: kq_seq_rows(type, 1, 0, w, row_bytes, n0, n1, a->k, prep, r0, out, out_stride); break;
        }
    }
    return 1;
}

/* ---- batched decode: every activation row's two terms as a pair (tl_act_q8.pairs > 1) ----
 *
 * The tiles decode a weight row's super-block once per four activation term rows (their register block), so
 * at 2 x 8 term rows each super-block was decoded four times, and every term row paid its own conversion and
 * scaling. Here each weight row is read whole in turn (as the stream above) and each super-block decoded once
 * for all the pairs, up to KQ_PAIRS_GROUP of them (one float accumulator each), their prepared activations read
 * back from L1 as vpdpbusd's memory operands; each pair goes through kq_pair_dot (128 dot0 + dot1, one
 * conversion and scaling). The activations are prepared in chunks of super-blocks that stay in L1
 * (KQ_PAIRS_L1_VECS; k = 8192 at 8 pairs: eleven), each chunk's sums added to the outputs. Measured against the tiles
 * (bench/quant_gemm.py --pairs-ab, two threads, weights from memory, 2048 x 2048, 2048 x 8192, 8192 x 2048):
 * Q4_K 1.18-1.56x at 2-8 rows, Q6_K 0.89-1.50x; the ~1B Q4_K_M decode step 0.79-0.82x at batch 2-8
 * (bench/ab_decode.py). */
#define KQ_PAIRS_GROUP 8 /* pairs per pass over the weight rows (the small path's up to 11: a second pass) */
/* Prepared activations per chunk (24 KiB: they stay in L1 as the chunk's weight rows stream by). Measured (two
 * threads, weights from memory, Q4_K / Q6_K at 2-8 rows, 2048 x 2048, 2048 x 8192, 8192 x 2048): 16 KiB level
 * with it, 32 KiB 0.9-1.0x of it; the whole row's (up to 64 KiB, from L2) 0.6-0.8x at 6-8 rows. */
#define KQ_PAIRS_L1_VECS 384

/* Super-blocks [b0, b0 + nbc) of every activation row (the a->pairs first terms, then their second terms) at
 * prep[((b - b0) * 2 pairs + row) * KQ_SEQ_STRIDE] as kq_seq_prep lays them out; a first term's scale vectors
 * are its pair's (kq_pair_scales). */
static void kq_pairs_prep(int six, const tl_act_q8 *a, int64_t b0, int64_t nbc, __m512i *prep) {
    const int64_t k = a->k, nblk32 = k / TL_QK, pairs = a->pairs, rows = 2 * pairs;
    for (int64_t bb = 0; bb < nbc; ++bb) {
        const int64_t b = b0 + bb;
        for (int64_t r = 0; r < rows; ++r) {
            __m512i *p = prep + (bb * rows + r) * KQ_SEQ_STRIDE;
            const int64_t o = r * nblk32 + 8 * b;
            __m512 as, dsa = _mm512_setzero_ps();
            __m512i init = _mm512_setzero_si512();
            kq_act_prep(six, a->q + r * k + b * KQ_K, a->d + o, a->s + o, p, &as, &dsa, &init);
            if (r < pairs) kq_pair_scales(six, a, o, (pairs + r) * nblk32 + 8 * b, &as, &dsa);
            p[KQ_PREP_AS] = _mm512_castps_si512(as);
            p[KQ_PREP_DSA] = _mm512_castps_si512(dsa);
            p[KQ_PREP_INIT] = init;
        }
    }
}

/* Weight rows [n0, n1), super-blocks [b0, b0 + nbc) (prepared at prep), against pairs p0 .. p0 + G - 1: each
 * pair's sum into out row p (set on the first chunk, added after), 0 into its second term's row. */
static inline __attribute__((always_inline)) void kq_pairs_rows(int type, const int G, const uint8_t *w,
                                                                int64_t row_bytes, int64_t n0, int64_t n1, int64_t b0,
                                                                int64_t nbc, const tl_act_q8 *a, int64_t p0,
                                                                const __m512i *prep, float *out, int64_t out_stride) {
    const int six = type == 6, five = type == 5;
    const int64_t bytes = six ? KQ6_BYTES : five ? KQ5_BYTES : KQ4_BYTES, pairs = a->pairs, rows = 2 * pairs;
    /* the same super-blocks KQ_SEQ_AHEAD bytes of them on: whole rows ahead, as a chunk reads a part of each */
    const int64_t ahead_rows = (KQ_SEQ_AHEAD + nbc * bytes - 1) / (nbc * bytes);
    const int64_t ahead = (int64_t)tl_quant_prefetch_tiles * ahead_rows * row_bytes;
    const __m512i lane_sub = kq45_lane_sub(), zero = _mm512_setzero_si512();
    for (int64_t j = n0; j < n1; ++j) {
        const uint8_t *row = w + j * row_bytes + b0 * bytes;
        __m512 acc[KQ_PAIRS_GROUP];
        for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
        for (int64_t bb = 0; bb < nbc; ++bb) {
            const uint8_t *blk = row + bb * bytes;
            if (ahead) kq_prefetch(blk + ahead, (int)bytes);
            const __m512i *p = prep + bb * rows * KQ_SEQ_STRIDE;
            __m512i v[4];
            const __m512 wv = six ? kq6_decode(blk, v) : kq45_decode(five, blk, v);
            const __m512 ws = six ? wv : _mm512_permutexvar_ps(lane_sub, wv);
            for (int g = 0; g < G; ++g) {
                const __m512i *x0 = p + (p0 + g) * KQ_SEQ_STRIDE, *x1 = p + (pairs + p0 + g) * KQ_SEQ_STRIDE;
                acc[g] = kq_pair_dot(six, v, x0, x1, six ? x0[KQ_PREP_INIT] : zero, six ? x1[KQ_PREP_INIT] : zero,
                                     ws, _mm512_castsi512_ps(x0[KQ_PREP_AS]), wv,
                                     _mm512_castsi512_ps(x0[KQ_PREP_DSA]), acc[g]);
            }
        }
        for (int g = 0; g < G; ++g) {
            float *o = out + (p0 + g) * out_stride + (j - n0);
            const float sum = _mm512_reduce_add_ps(acc[g]);
            *o = b0 == 0 ? sum : *o + sum;
            out[(pairs + p0 + g) * out_stride + (j - n0)] = 0.0f;
        }
    }
}

/* dot_rows for a->pairs > 1: chunk by chunk of super-blocks, every pair in passes of KQ_PAIRS_GROUP. */
static inline __attribute__((always_inline)) void kq_pairs_dot(int type, const uint8_t *w, int64_t row_bytes,
                                                               int64_t n0, int64_t n1, const tl_act_q8 *a, float *out,
                                                               int64_t out_stride) {
    const int64_t per_block = 2 * a->pairs * KQ_SEQ_STRIDE, fit = KQ_PAIRS_L1_VECS / per_block;
    const int64_t nb = a->k / KQ_K, chunk = fit > 0 ? fit : 1; /* (8 pairs: 128 vectors a super-block) */
    __m512i prep[KQ_PAIRS_L1_VECS];
    for (int64_t b0 = 0; b0 < nb; b0 += chunk) {
        const int64_t nbc = nb - b0 < chunk ? nb - b0 : chunk;
        kq_pairs_prep(type == 6, a, b0, nbc, prep);
        for (int64_t p0 = 0; p0 < a->pairs; p0 += KQ_PAIRS_GROUP) {
#define KQ_PAIRS(G) kq_pairs_rows(type, G, w, row_bytes, n0, n1, b0, nbc, a, p0, prep, out, out_stride)
            switch (a->pairs - p0 < KQ_PAIRS_GROUP ? a->pairs - p0 : KQ_PAIRS_GROUP) {
            case 8: KQ_PAIRS(8); break;
            case 7: KQ_PAIRS(7); break;
            case 6: KQ_PAIRS(6); break;
            case 5: KQ_PAIRS(5); break;
            case 4: KQ_PAIRS(4); break;
            case 3: KQ_PAIRS(3); break;
            case 2: KQ_PAIRS(2); break;
            default: KQ_PAIRS(1); break;
            }
#undef KQ_PAIRS
        }
    }
}

/* A pair (tl_act_q8.paired, m == 2) goes through the tiles as one: kq_tile's PAIRED form. More pairs go through
 * kq_pairs_dot, but Q6_K rows of a page or more (the ~1B's ffn_down, k = 8192): there the chunks' pieces of
 * each row measured 0.62-0.89x the tiles at two rows, 0.9-1.0x at four. */
#define KQ_TILES(SIX, FIVE, SEQ, NAME)                                                                           \
    static void NAME(const uint8_t *w, int64_t n, int64_t row_bytes, int64_t n0, int64_t n1, const tl_act_q8 *a, \
                     float *out, int64_t out_stride) {                                                           \
        (void)n; /* rows stay whole */                                                                           \
        if (a->pairs > 1 && (!SIX || row_bytes < KQ_SEQ_PAGE)) {                                                 \
            kq_pairs_dot(SEQ, w, row_bytes, n0, n1, a, out, out_stride);                                         \
            return;                                                                                              \
        }                                                                                                        \
        if (a->m <= tl_quant_seq_max_m && kq_seq_dot(SEQ, w, row_bytes, n0, n1, a, out, out_stride)) return;     \
        int64_t j = n0;                                                                                          \
        for (; j + 4 <= n1; j += 4) {                                                                            \
            float *o = out + (j - n0);                                                                           \
            int r = 0;                                                                                           \
            if (a->paired) {                                                                                     \
                kq_tile(SIX, FIVE, 4, 2, 1, w, row_bytes, j, a, 0, o, out_stride);                               \
                continue;                                                                                        \
            }                                                                                                    \
            for (; r + 4 <= a->m; r += 4) kq_tile(SIX, FIVE, 4, 4, 0, w, row_bytes, j, a, r, o, out_stride);     \
            switch (a->m - r) {                                                                                  \
            case 3: kq_tile(SIX, FIVE, 4, 3, 0, w, row_bytes, j, a, r, o, out_stride); break;                    \
            case 2: kq_tile(SIX, FIVE, 4, 2, 0, w, row_bytes, j, a, r, o, out_stride); break;                    \
            case 1: kq_tile(SIX, FIVE, 4, 1, 0, w, row_bytes, j, a, r, o, out_stride); break;                    \
            default: break;                                                                                      \
            }                                                                                                    \
        }                                                                                                        \
        for (; j < n1; ++j) {                                                                                    \
            float *o = out + (j - n0);                                                                           \
            int r = 0;                                                                                           \
            if (a->paired) {                                                                                     \
                kq_tile(SIX, FIVE, 1, 2, 1, w, row_bytes, j, a, 0, o, out_stride);                               \
                continue;                                                                                        \
            }                                                                                                    \
            for (; r + 4 <= a->m; r += 4) kq_tile(SIX, FIVE, 1, 4, 0, w, row_bytes, j, a, r, o, out_stride);     \
            for (; r < a->m; ++r) kq_tile(SIX, FIVE, 1, 1, 0, w, row_bytes, j, a, r, o, out_stride);             \
        }                                                                                                        \
    }
KQ_TILES(0, 0, 4, kq4_dot_rows)
KQ_TILES(0, 1, 5, kq5_dot_rows)
KQ_TILES(1, 0, 6, kq6_dot_rows)
#undef KQ_TILES

#else /* portable: dequantize a super-block, float dot with the dequantized activations */

static void kq_dot_rows_scalar(void (*deq)(const uint8_t *, int64_t, float *), int64_t bytes, const uint8_t *w,
                               int64_t row_bytes, int64_t n0, int64_t n1, const tl_act_q8 *a, float *out,
                               int64_t out_stride) {
    float wv[KQ_K];
    for (int64_t j = n0; j < n1; ++j)
        for (int r = 0; r < a->m; ++r) {
            float sum = 0.0f;
            for (int64_t b = 0; b < a->k / KQ_K; ++b) {
                deq(w + j * row_bytes + b * bytes, KQ_K, wv);
                for (int e = 0; e < KQ_K; ++e)
                    sum += wv[e] * a->d[r * (a->k / TL_QK) + (b * KQ_K + e) / TL_QK] * a->q[r * a->k + b * KQ_K + e];
            }
            out[(int64_t)r * out_stride + (j - n0)] = sum;
        }
}
static void kq4_dot_rows(const uint8_t *w, int64_t n, int64_t rb, int64_t n0, int64_t n1, const tl_act_q8 *a,
                         float *o, int64_t os) {
    (void)n;
    kq_dot_rows_scalar(kq4_dequant_row, KQ4_BYTES, w, rb, n0, n1, a, o, os);
}
static void kq5_dot_rows(const uint8_t *w, int64_t n, int64_t rb, int64_t n0, int64_t n1, const tl_act_q8 *a,
                         float *o, int64_t os) {
    (void)n;
    kq_dot_rows_scalar(kq5_dequant_row, KQ5_BYTES, w, rb, n0, n1, a, o, os);
}
static void kq6_dot_rows(const uint8_t *w, int64_t n, int64_t rb, int64_t n0, int64_t n1, const tl_act_q8 *a,
                         float *o, int64_t os) {
    (void)n;
    kq_dot_rows_scalar(kq6_dequant_row, KQ6_BYTES, w, rb, n0, n1, a, o, os);
}
#endif

#if KQ_VNNI
#define KQ_DEQ(name) name##_avx
#define KQ_U8(name) name
#else
#define KQ_DEQ(name) name
#define KQ_U8(name) NULL
#endif
/* The table's matrix-level forms of the per-row functions (a K type's row stays whole at w + r * row bytes). */
#define KQ_MATRIX_FNS(T, BYTES)                                                                                 \
    static void T##_dequant_at(const uint8_t *w, int64_t n, int64_t r, int64_t k, float *out) {                 \
        (void)n;                                                                                                \
        KQ_DEQ(T##_dequant_row)(w + r * (k / KQ_K * (BYTES)), k, out);                                          \
    }                                                                                                           \
    static int T##_repack(uint8_t *data, int64_t n, int64_t k) {                                                \
        for (int64_t r = 0; r < n; ++r) T##_repack_row(data + r * (k / KQ_K * (BYTES)), k);                     \
        return 0;                                                                                               \
    }
KQ_MATRIX_FNS(kq4, KQ4_BYTES)
KQ_MATRIX_FNS(kq5, KQ5_BYTES)
KQ_MATRIX_FNS(kq6, KQ6_BYTES)
#undef KQ_MATRIX_FNS
#if KQ_VNNI
#define KQ_U8_AT(T, BYTES)                                                                                      \
    static void T##_u8_at(const uint8_t *w, int64_t n, int64_t r, int64_t k, uint8_t *q, float *scale,          \
                          float *min) {                                                                         \
        (void)n;                                                                                                \
        T##_u8_row(w + r * (k / KQ_K * (BYTES)), k, q, scale, min);                                             \
    }
KQ_U8_AT(kq4, KQ4_BYTES)
KQ_U8_AT(kq5, KQ5_BYTES)
KQ_U8_AT(kq6, KQ6_BYTES)
#undef KQ_U8_AT
#endif
static const tl_quant_type kq_types[3] = {
    {TL_Q4_K, KQ_K, KQ4_BYTES, kq4_dot_rows, kq4_dequant_at, kq4_repack, KQ_U8(kq4_u8_at), 32},
    {TL_Q5_K, KQ_K, KQ5_BYTES, kq5_dot_rows, kq5_dequant_at, kq5_repack, KQ_U8(kq5_u8_at), 32},
    {TL_Q6_K, KQ_K, KQ6_BYTES, kq6_dot_rows, kq6_dequant_at, kq6_repack, KQ_U8(kq6_u8_at), 16},
};

static const tl_quant_type *tl_kquant_type(int type) {
    for (int i = 0; i < 3; ++i)
        if (kq_types[i].type == type) return &kq_types[i];
    return NULL;
}

/* ---------------------------------------------------------------- test entry points (tests/unit) */

/* One re-laid-out row (k columns) of `type` dequantized, by the table's function or (portable != 0) by the
 * portable C one that builds without AVX-512; -1 for a type not of this family or k not whole super-blocks. */
KERNEL_API int kquant_dequant_row(int type, const uint8_t *row, int64_t k, float *out, int portable) {
    const tl_quant_type *t = tl_kquant_type(type);
    if (t == NULL || k % KQ_K) return -1;
    if (portable) {
        static void (*const scalar[3])(const uint8_t *, int64_t, float *) = {kq4_dequant_row, kq5_dequant_row,
                                                                              kq6_dequant_row};
        scalar[t - kq_types](row, k, out);
    } else {
        t->dequant_row(row, 1, 0, k, out);
    }
    return 0;
}

/* One row re-laid out in place for the dot kernel (the type's repack); -1 as above. */
KERNEL_API int kquant_repack_row(int type, uint8_t *row, int64_t k) {
    const tl_quant_type *t = tl_kquant_type(type);
    if (t == NULL || k % KQ_K) return -1;
    t->repack(row, 1, k);
    return 0;
}

/* out[m, n] = A . W^T for an [n, k] weight and activations already quantized per the contract, weight rows
 * split over `threads` OpenMP threads in runs of 4; -1 for a bad type or shape. */
KERNEL_API int kquant_dot_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t n, const int8_t *q,
                               const float *d, const int32_t *s, int m, int64_t k, float *out, int threads) {
    const tl_quant_type *t = tl_kquant_type(type);
    if (t == NULL || k % KQ_K || m < 1 || row_bytes < k / KQ_K * t->block_size || threads < 1) return -1;
    const tl_act_q8 a = {q, d, s, m, k, NULL, 0};
    const int64_t units = (n + 3) / 4;
#pragma omp parallel num_threads(threads)
    {
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t n0 = units * id / nt * 4, n1 = units * (id + 1) / nt * 4 < n ? units * (id + 1) / nt * 4 : n;
        if (n0 < n1) t->dot_rows(w, n, row_bytes, n0, n1, &a, out + n0, n);
    }
    return 0;
}

#endif /* TOKENLOOM_QUANT_KQUANTS_C */
