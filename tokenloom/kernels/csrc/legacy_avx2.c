/*
 * The legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: blocks of 32 with an f16 scale d, Q4_1 / Q5_1 an f16 min m
 * too) of quant_avx2.c in kquant_avx2.c's lane order. A row's blocks are re-laid out once at load (same size)
 * in spans of eight (256 elements) and one tail of the last nb % 8, each a run of its own, one after another:
 *   span: its quants in lane order (Q4: chunk c's byte p, low nibble vector 2c's lane p, high nibble vector
 *         2c + 1's; Q8_0: vector t's lane p at byte 16 t + p; Q5: chunk c is 20 bytes, a 32-bit word whose bit
 *         2p / 2p + 1 is the fifth bit of vector 2c's / 2c + 1's lane p, then the Q4 chunk's 16 bytes), then its
 *         eight f16 d, then (Q4_1, Q5_1) its eight m;
 *   tail: its blocks' quants one block after another (Q4: the file's 16 bytes, low nibbles the first 16
 *         elements; Q5: the fifth bits' word as a chunk's, elements 0-15 and 16-31 its two vectors, then the
 *         file's 16 bytes), then their d, then (Q4_1, Q5_1) their m.
 * A Q5 chunk and a Q5 tail block thus read alike: the word spread to one byte a bit is, as int16 lanes, the first
 * vector's fifth bit in lane p's low byte and the second's in its high byte (avx2_legacy_pair: a broadcast, a
 * byte shuffle, an or and a compare for 32 quants, then an and (and a shift) per vector on top of the Q4
 * nibbles). llama-quantize writes Q5_0 / Q5_1 for Q4_K / Q5_K tensors whose rows are not whole super-blocks:
 * most of a Q4_K_M file of SmolLM2 or Qwen2.5-0.5B.
 * Per span and activation row the 16 vpmaddwd add up, lane j, to block j's integer sum, scaled by d_j d_x(j) in
 * one multiply-add; the offsets (Q4_0's -8 d_j, Q4_1's m_j) multiply the activation blocks' sums. These are
 * the integers and float operations, in the same order, of the form this replaced (all quants of a row, then
 * all d, then all m, with a horizontal-add tree per eight blocks): outputs bit-identical to it. Against that
 * form (Zen 3, SmolLM2 and 1B shapes): one thread from cache, one row 0.74-0.99x the time, four rows
 * 0.50-0.74x; two threads from memory, one row 0.88-1.0x, and 0.57x (Q4_1) / 0.75x (Q8_0) at k = 8192, whose
 * rows the three separate runs of the old layout (4 KiB and more of quants, then the scales) had left to the
 * hardware prefetchers at half the rate: each row is now one forward stream.
 *
 * Included by quant_avx2.c after kquant_avx2.c (the lane order and its helpers).
 */

static inline int avx2_legacy_is_q5(int type) { return type == TL_Q5_0 || type == TL_Q5_1; }
static inline int avx2_legacy_has_min(int type) { return type == TL_Q4_1 || type == TL_Q5_1; }
static inline int avx2_legacy_qbytes(int type) { return type == TL_Q8_0 ? 32 : avx2_legacy_is_q5(type) ? 20 : 16; }
static inline int avx2_legacy_bytes(int type) {
    return type == TL_Q4_0 ? 18 : type == TL_Q4_1 ? 20 : type == TL_Q5_0 ? 22 : type == TL_Q5_1 ? 24 : 34;
}
/* The offset each block's quants carry, as a multiple of d (Q4_0's -8, Q5_0's -16), for the types without m. */
static inline float avx2_legacy_zero(int type) { return type == TL_Q4_0 ? -8.0f : type == TL_Q5_0 ? -16.0f : 0.0f; }

/* Element i (< 32) of a file-layout block's quants: Q4 0..15, Q5 0..31, Q8_0 -127..127. */
static inline int avx2_legacy_file_quant(int type, const uint8_t *blk, int i) {
    if (type == TL_Q8_0) return (int8_t)blk[2 + i];
    const int fields = avx2_legacy_has_min(type) ? 4 : 2; /* d (and m) first */
    const uint8_t *qs = blk + fields + (avx2_legacy_is_q5(type) ? 4 : 0);
    const int low = i < 16 ? qs[i] & 15 : qs[i - 16] >> 4;
    if (!avx2_legacy_is_q5(type)) return low;
    uint32_t qh;
    memcpy(&qh, blk + fields, 4);
    return low | (int)((qh >> i) & 1) << 4;
}

/* A Q5 word of fifth bits for 32 quants q (vector lo's lanes 0-15 = q[0..15], vector hi's = q[16..31]): bit 2p
 * holds lo lane p's, bit 2p + 1 hi lane p's, so that the word expanded to one byte a bit is, read as 16 int16
 * lanes, lo's bit in lane p's low byte and hi's in its high byte (avx2_legacy_pair). */
static uint32_t avx2_q5_word(const int *q) {
    uint32_t bits = 0;
    for (int p = 0; p < 16; ++p)
        bits |= (uint32_t)(q[p] >> 4 & 1) << (2 * p) | (uint32_t)(q[16 + p] >> 4 & 1) << (2 * p + 1);
    return bits;
}

/* Re-lays the n rows of a legacy type out in place (see the file comment); 0, or -1 without memory. */
static int avx2_legacy_repack(int type, uint8_t *data, int64_t n, int64_t k) {
    const int bs = avx2_legacy_bytes(type), qb = avx2_legacy_qbytes(type);
    const int64_t nb = k / 32, row_bytes = nb * bs;
    uint8_t *copy = malloc((size_t)row_bytes);
    if (copy == NULL) return -1;
    for (int64_t r = 0; r < n; ++r) {
        uint8_t *row = data + r * row_bytes;
        memcpy(copy, row, (size_t)row_bytes);
        for (int64_t b0 = 0; b0 < nb; b0 += 8) {
            const int cnt = nb - b0 < 8 ? (int)(nb - b0) : 8;
            const uint8_t *blk = copy + b0 * bs;
            uint8_t *out = row + b0 * bs;
            if (cnt == 8) {
                int lane[256];
                for (int i = 0; i < 256; ++i) {
                    const int e = avx2_k_natural(256, 2, i);
                    lane[i] = avx2_legacy_file_quant(type, blk + e / 32 * bs, e % 32);
                }
                if (avx2_legacy_is_q5(type)) {
                    for (int c = 0; c < 8; ++c) { /* chunk c: the fifth bits' word, then the nibbles */
                        const uint32_t bits = avx2_q5_word(lane + 32 * c);
                        memcpy(out + 20 * c, &bits, 4);
                        for (int p = 0; p < 16; ++p)
                            out[20 * c + 4 + p] =
                                (uint8_t)((lane[32 * c + p] & 15) | (lane[32 * c + 16 + p] & 15) << 4);
                    }
                } else {
                    for (int i = 0; i < (type == TL_Q8_0 ? 256 : 128); ++i) {
                        const int low = i / 16 * 32 + i % 16; /* Q4: chunk i / 16, lane i % 16 of its two vectors */
                        out[i] = (uint8_t)(type == TL_Q8_0 ? lane[i] : lane[low] | lane[low + 16] << 4);
                    }
                }
            } else {
                for (int j = 0; j < cnt; ++j) {
                    memcpy(out + j * qb, blk + j * bs + bs - qb, (size_t)qb);
                    if (avx2_legacy_is_q5(type)) { /* the file's fifth bits in the word's order */
                        int q[32];
                        for (int i = 0; i < 32; ++i) q[i] = avx2_legacy_file_quant(type, blk + j * bs, i);
                        const uint32_t bits = avx2_q5_word(q);
                        memcpy(out + j * qb, &bits, 4);
                    }
                }
            }
            for (int j = 0; j < cnt; ++j) {
                memcpy(out + cnt * qb + 2 * j, blk + j * bs, 2);
                if (avx2_legacy_has_min(type)) memcpy(out + cnt * qb + 2 * cnt + 2 * j, blk + j * bs + 2, 2);
            }
        }
    }
    free(copy);
    return 0;
}
static int avx2_q4_0_repack(uint8_t *data, int64_t n, int64_t k) { return avx2_legacy_repack(TL_Q4_0, data, n, k); }
static int avx2_q4_1_repack(uint8_t *data, int64_t n, int64_t k) { return avx2_legacy_repack(TL_Q4_1, data, n, k); }
static int avx2_q8_0_repack(uint8_t *data, int64_t n, int64_t k) { return avx2_legacy_repack(TL_Q8_0, data, n, k); }
static int avx2_q5_0_repack(uint8_t *data, int64_t n, int64_t k) { return avx2_legacy_repack(TL_Q5_0, data, n, k); }
static int avx2_q5_1_repack(uint8_t *data, int64_t n, int64_t k) { return avx2_legacy_repack(TL_Q5_1, data, n, k); }

/* The 32-bit word at p expanded to 32 bytes, byte j 0xFF where bit j is set, else 0 (a broadcast, a byte
 * shuffle, an or and a compare). */
static inline __m256i avx2_bit_bytes(const uint8_t *p) {
    uint32_t word;
    memcpy(&word, p, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)word),
                                               _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2,
                                                                2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe); /* byte i: every bit but bit i */
    return _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi64x(-1));
}

/* 32 quants at p as two int16 vectors (Q8_0's signed, the Q4 types' 0..15, the Q5 types' 0..31): a span's
 * vectors 2c and 2c + 1 at p = span + c * qbytes (lane order), or a tail block's elements 0-15 and 16-31 at its
 * quants. */
static inline __attribute__((always_inline)) void avx2_legacy_pair(const int type, const uint8_t *p, __m256i *lo,
                                                                    __m256i *hi) {
    if (type == TL_Q8_0) {
        *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
        *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)));
    } else if (avx2_legacy_is_q5(type)) {
        const __m256i bits = avx2_bit_bytes(p), sixteen = _mm256_set1_epi16(16);
        avx2_nibble_pair(p + 4, lo, hi);
        *lo = _mm256_or_si256(*lo, _mm256_and_si256(bits, sixteen));
        *hi = _mm256_or_si256(*hi, _mm256_and_si256(_mm256_srli_epi16(bits, 8), sixteen));
    } else {
        avx2_nibble_pair(p, lo, hi);
    }
}

/* out[i] = legacy weight row `row` (k columns, the layout above) . activation row r0 + i, i < MR (the
 * activations' spans in lane order, their tail in file order). */
static inline __attribute__((always_inline)) void avx2_legacy_dot(const int type, const uint8_t *row, int64_t k,
                                                                   const avx2_act *a, int64_t r0, const int MR,
                                                                   float *out, int64_t ahead) {
    const int bs = avx2_legacy_bytes(type), qb = avx2_legacy_qbytes(type);
    const int64_t nb = k / 32, spans = nb / 8;
    __m256 acc[4], offs[4];
    float tail[4] = {0.f, 0.f, 0.f, 0.f};
    for (int i = 0; i < MR; ++i) acc[i] = offs[i] = _mm256_setzero_ps();
    for (int64_t s = 0; s < spans; ++s) {
        const uint8_t *span = row + s * 8 * bs;
        if (ahead > 0) avx2_prefetch_bytes(span + ahead, 8 * bs);
        __m256i isum[4];
        for (int i = 0; i < MR; ++i) isum[i] = _mm256_setzero_si256();
#pragma GCC unroll 2
        for (int c = 0; c < 8; ++c) {
            __m256i w0, w1;
            avx2_legacy_pair(type, span + c * qb, &w0, &w1);
            avx2_lane_madd(a, r0, MR, 256 * s + 32 * c, w0, w1, isum);
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(span + 8 * qb)));
        const __m256 off = avx2_legacy_has_min(type)
                               ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(span + 8 * qb + 16)))
                               : _mm256_mul_ps(dw, _mm256_set1_ps(avx2_legacy_zero(type)));
        for (int i = 0; i < MR; ++i) {
            const int64_t at = (r0 + i) * nb + 8 * s;
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_mul_ps(dw, _mm256_loadu_ps(a->dc + at)),
                                     acc[i]);
            if (type != TL_Q8_0) offs[i] = _mm256_fmadd_ps(off, _mm256_loadu_ps(a->xs + at), offs[i]);
        }
    }
    const int cnt = (int)(nb - 8 * spans); /* the tail, block by block */
    const uint8_t *tq = row + spans * 8 * bs, *td = tq + cnt * qb, *tm = td + 2 * cnt;
    for (int b = 0; b < cnt; ++b) {
        __m256i lo, hi;
        avx2_legacy_pair(type, tq + b * qb, &lo, &hi);
        const float dw = avx2_h2f(td + 2 * b);
        const float off = avx2_legacy_has_min(type) ? avx2_h2f(tm + 2 * b) : avx2_legacy_zero(type) * dw;
        for (int i = 0; i < MR; ++i) {
            const int64_t at = (r0 + i) * nb + 8 * spans + b;
            const int16_t *xq = a->q + (r0 + i) * k + 32 * (8 * spans + b);
            const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)xq)),
                                                 _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 16))));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * a->dc[at]), acc[i]);
            if (type != TL_Q8_0) tail[i] += off * a->xs[at];
        }
    }
    for (int i = 0; i < MR; ++i) out[i] = avx2_hsum(acc[i]) + (avx2_hsum(offs[i]) + tail[i]);
}

/* Dequantize, exact (quant_avx2.c's rule: products and sums rounded one at a time, never fused). */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

/* Legacy row `row` dequantized to float32 in lane order (spans in lane order, the tail in file order): the gguf
 * package's values, bit for bit (Q4_0 d (q - 8), Q5_0 d (q - 16), Q4_1 / Q5_1 d q + m, Q8_0 d q). */
static void avx2_legacy_dequant_lanes(int type, const uint8_t *row, int64_t k, float *out) {
    const int bs = avx2_legacy_bytes(type), qb = avx2_legacy_qbytes(type);
    const int64_t nb = k / 32, spans = nb / 8;
    const __m256 none = _mm256_setzero_ps();
    const int has_min = avx2_legacy_has_min(type);
    const __m256i zero = _mm256_set1_epi16((short)avx2_legacy_zero(type)); /* the quants' offset: -8, -16 or 0 */
    for (int64_t s = 0; s < spans; ++s) {
        const uint8_t *span = row + s * 8 * bs;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(span + 8 * qb)));
        /* Q4_1 / Q5_1 add m: emit16 subtracts, so its negation (exact) */
        const __m256 nm = has_min ? _mm256_sub_ps(none, _mm256_cvtph_ps(_mm_loadu_si128(
                                                      (const __m128i *)(span + 8 * qb + 16))))
                                  : none;
        const __m256 s_lo = avx2_pairs(d, 0), s_hi = avx2_pairs(d, 1), m_lo = avx2_pairs(nm, 0),
                     m_hi = avx2_pairs(nm, 1);
        for (int c = 0; c < 8; ++c) {
            __m256i w0, w1;
            avx2_legacy_pair(type, span + c * qb, &w0, &w1);
            w0 = _mm256_add_epi16(w0, zero);
            w1 = _mm256_add_epi16(w1, zero);
            float *o = out + 256 * s + 32 * c;
            avx2_emit16(o, w0, s_lo, s_hi, has_min, m_lo, m_hi);
            avx2_emit16(o + 16, w1, s_lo, s_hi, has_min, m_lo, m_hi);
        }
    }
    const int cnt = (int)(nb - 8 * spans);
    const uint8_t *tq = row + spans * 8 * bs, *td = tq + cnt * qb, *tm = td + 2 * cnt;
    for (int b = 0; b < cnt; ++b) {
        __m256i lo, hi;
        avx2_legacy_pair(type, tq + b * qb, &lo, &hi);
        lo = _mm256_add_epi16(lo, zero);
        hi = _mm256_add_epi16(hi, zero);
        const __m256 d = _mm256_set1_ps(avx2_h2f(td + 2 * b));
        const __m256 nm = _mm256_set1_ps(has_min ? -avx2_h2f(tm + 2 * b) : 0.f);
        float *o = out + 256 * spans + 32 * b;
        avx2_emit16(o, lo, d, d, has_min, nm, nm);
        avx2_emit16(o + 16, hi, d, d, has_min, nm, nm);
    }
}
#pragma GCC pop_options
