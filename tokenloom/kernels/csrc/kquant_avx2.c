/*
 * The K types (Q4_K, Q5_K, Q6_K) of quant_avx2.c in the sub-block-per-lane layout: each super-block's quants
 * re-laid out once at load (same size: only the quant bytes move; the f16 scales and packed 6-bit scales stay
 * where the file has them) so that one vpmaddwd's eight int32 lanes each stay inside one sub-block.
 *
 * Lane order. A span of S elements (Q4_K / Q5_K: a super-block's 256, eight sub-blocks of 32; Q6_K: half a
 * super-block, 128, eight sub-blocks of 16) is multiplied as S / 16 vectors of 16 int16: vector t's lanes
 * 2j and 2j + 1 hold elements S/8 j + 2t and S/8 j + 2t + 1, sub-block j's t-th pair. The S / 16 vpmaddwd of
 * a span (weights against the activations' int16 terms in the same order) then add up, lane j, to sub-block
 * j's integer sum: no horizontal reduction per sub-block, one int->float conversion and one multiply-add per
 * span and activation row with a vector of per-lane scales (the weight sub-block scales times the activation
 * blocks' scales). Against the file layout with a horizontal-add tree per eight sub-blocks (Zen 3, one thread
 * from cache, 1B shapes): Q4_K four rows 0.62-0.67x the time, one row 0.89-1.0x; Q5_K 0.66-0.73x / 0.97x;
 * Q6_K 0.86-0.88x / 0.78-0.79x; two threads from memory, one row, Q4_K 0.92-0.96x, Q6_K 0.79-0.82x; a ~1B
 * Q4_K_M decode step 34.7 -> 30.7 ms. The sums are the same integers
 * and the same float operations in the same order as that form's for Q4_K / Q5_K (outputs bit-identical to
 * it); Q6_K now scales each 16-element sub-block on its own (its -32 offset enters as 32 times the
 * activations' per-16 sums, exact) instead of folding its scales into the int16 weights.
 *
 * The activations are quantized per 32 exactly as for the legacy types and then put into lane order
 * (avx2_lanes_act: a transpose of element pairs per span, once per call and row); the float32 tile (prefill)
 * dequantizes the weights in lane order and puts its activation rows into the same order (avx2_lanes_f32),
 * so every product meets its partner; embedding rows and dequantize put them back into file order.
 *
 * Re-laid quant bytes (p = 2j + e, a lane's byte within a 16-byte chunk):
 *   Q4_K qs (bytes 16-143) / Q5_K qs (48-175): chunk c, byte p: low nibble vector 2c's lane p, high nibble
 *        vector 2c + 1's.  Q5_K qh (16-47): chunk h (0, 1), byte p, bit b: vector 8h + b's fifth bit at lane p.
 *   Q6_K ql (0-127): chunk c as Q4_K's qs, low four bits (vectors 0-7 span 0, 8-15 span 1); qh (128-191):
 *        chunk h (0-3), byte p, bits 2s and 2s + 1: the top two bits of vector 4h + s at lane p.
 *
 * Included by quant_avx2.c (its activation struct and helpers).
 */

/* Elements per span of the lane order. */
static inline int avx2_k_span(int type) { return type == TL_Q6_K ? 128 : 256; }

/* Element i of a span in lane order comes from element avx2_k_natural(span, i) of file order. */
static inline int avx2_k_natural(int span, int i) {
    const int t = i / 16, j = (i % 16) / 2, e = i % 2;
    return span / 8 * j + 2 * t + e;
}

/* One span of int16 quants put from file order into lane order, in place (element pairs as 32-bit units). */
static void avx2_lanes_i16(int16_t *q, int span) {
    int16_t tmp[256];
    memcpy(tmp, q, sizeof(int16_t) * (size_t)span);
    for (int i = 0; i < span; i += 2) memcpy(q + i, tmp + avx2_k_natural(span, i), 2 * sizeof(int16_t));
}

/* k float32 values from file order into lane order, whole spans (the elements past the last one as they are;
 * src and dst apart). */
static void avx2_lanes_f32(const float *src, float *dst, int64_t k, int span) {
    int64_t s = 0;
    for (; s + span <= k; s += span)
        for (int i = 0; i < span; i += 2) memcpy(dst + s + i, src + s + avx2_k_natural(span, i), 2 * sizeof(float));
    memcpy(dst + s, src + s, sizeof(float) * (size_t)(k - s));
}

/* k float32 values from lane order back into file order (src and dst apart). */
static void avx2_natural_f32(const float *src, float *dst, int64_t k, int span) {
    int64_t s = 0;
    for (; s + span <= k; s += span)
        for (int i = 0; i < span; i += 2) memcpy(dst + s + avx2_k_natural(span, i), src + s + i, 2 * sizeof(float));
    memcpy(dst + s, src + s, sizeof(float) * (size_t)(k - s));
}

/* Activation row q (k int16 terms, file order) into lane order for `type` (whole spans; the legacy types' tail
 * of nb % 8 blocks stays in file order); for Q6_K first its per-16 sums,
 * s16[i] = the sum of elements 16 i .. 16 i + 15 (exact: |sum| <= 16 * 16384). */
static void avx2_lanes_act(int type, int16_t *q, int64_t k, int32_t *s16) {
    const int span = avx2_k_span(type);
    if (type == TL_Q6_K)
        for (int64_t i = 0; i < k / 16; ++i) {
            int32_t sum = 0;
            for (int e = 0; e < 16; ++e) sum += q[16 * i + e];
            s16[i] = sum;
        }
    for (int64_t s = 0; s + span <= k; s += span) avx2_lanes_i16(q + s, span);
}

/* The 256 quants of a file-layout super-block in file order (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63, unsigned). */
static void avx2_k_file_quants(int type, const uint8_t *blk, uint8_t *q) {
    if (type == TL_Q6_K) {
        for (int i = 0; i < 256; ++i) {
            const int h = i / 128, s = (i % 128) / 64, l = i % 64;
            const int low = (blk[64 * h + l] >> (4 * s)) & 15;
            const int high = (blk[128 + 32 * h + l % 32] >> (2 * (2 * s + l / 32))) & 3;
            q[i] = (uint8_t)(low | high << 4);
        }
        return;
    }
    const uint8_t *qs = blk + (type == TL_Q4_K ? 16 : 48);
    for (int i = 0; i < 256; ++i) {
        const int j = i / 32, l = i % 32;
        q[i] = (uint8_t)((qs[32 * (j / 2) + l] >> (4 * (j & 1))) & 15);
        if (type == TL_Q5_K) q[i] |= (uint8_t)(((blk[16 + l] >> j) & 1) << 4);
    }
}

/* One super-block's quant bytes re-laid out into lane order, in place (see the file comment). */
static void avx2_k_relay(int type, uint8_t *blk) {
    uint8_t q[256], lane[256]; /* the quants in file order, then in lane order */
    avx2_k_file_quants(type, blk, q);
    const int span = avx2_k_span(type);
    for (int i = 0; i < 256; ++i) lane[i] = q[i / span * span + avx2_k_natural(span, i % span)];
    uint8_t *qs = type == TL_Q6_K ? blk : blk + (type == TL_Q4_K ? 16 : 48);
    for (int c = 0; c < 8; ++c)
        for (int p = 0; p < 16; ++p)
            qs[16 * c + p] = (uint8_t)((lane[32 * c + p] & 15) | (lane[32 * c + 16 + p] & 15) << 4);
    if (type == TL_Q5_K)
        for (int h = 0; h < 2; ++h)
            for (int p = 0; p < 16; ++p) {
                int bits = 0;
                for (int b = 0; b < 8; ++b) bits |= (lane[16 * (8 * h + b) + p] >> 4) << b;
                blk[16 + 16 * h + p] = (uint8_t)bits;
            }
    if (type == TL_Q6_K)
        for (int h = 0; h < 4; ++h)
            for (int p = 0; p < 16; ++p) {
                int bits = 0;
                for (int s = 0; s < 4; ++s) bits |= (lane[16 * (4 * h + s) + p] >> 4) << (2 * s);
                blk[128 + 16 * h + p] = (uint8_t)bits;
            }
}

static int avx2_k_repack(int type, uint8_t *data, int64_t n, int64_t k) {
    const int bytes = type == TL_Q4_K ? 144 : type == TL_Q5_K ? 176 : 210;
    for (int64_t b = 0; b < n * (k / 256); ++b) avx2_k_relay(type, data + b * bytes);
    return 0;
}
static int avx2_q4_k_repack(uint8_t *data, int64_t n, int64_t k) { return avx2_k_repack(TL_Q4_K, data, n, k); }
static int avx2_q5_k_repack(uint8_t *data, int64_t n, int64_t k) { return avx2_k_repack(TL_Q5_K, data, n, k); }
static int avx2_q6_k_repack(uint8_t *data, int64_t n, int64_t k) { return avx2_k_repack(TL_Q6_K, data, n, k); }

/* Q5_K: vector t's fifth bits (bit t % 8 of hb, the widened qh chunk t / 8) at bit 4 of each int16 lane. */
static inline __m256i avx2_q5_bit(__m256i hb, const int b) {
    const __m256i at4 = b <= 4 ? _mm256_slli_epi16(hb, 4 - b) : _mm256_srli_epi16(hb, b - 4);
    return _mm256_and_si256(at4, _mm256_set1_epi16(0x10));
}

/* Q6_K: vector 4h + s's top two bits (bits 2s, 2s + 1 of hv, the widened qh chunk h) at bits 4-5. */
static inline __m256i avx2_q6_high(__m256i hv, const int s) {
    const __m256i at4 = s == 0 ? _mm256_slli_epi16(hv, 4)
                        : s == 1 ? _mm256_slli_epi16(hv, 2)
                        : s == 2 ? hv
                                 : _mm256_srli_epi16(hv, 2);
    return _mm256_and_si256(at4, _mm256_set1_epi16(0x30));
}

/* 16 bytes of nibbles at p widened to int16: the low nibbles into lo, the high ones into hi (0..15). */
static inline __attribute__((always_inline)) void avx2_nibble_pair(const uint8_t *p, __m256i *lo, __m256i *hi) {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm256_and_si256(v, _mm256_set1_epi16(0x0f));
    *hi = _mm256_srli_epi16(v, 4);
}

/* Q4_K / Q5_K super-block blk: vectors 2c and 2c + 1 of its weights as int16 (lane order); hb0 / hb1 Q5_K's
 * widened fifth-bit chunks. */
static inline __attribute__((always_inline)) void avx2_k4_vectors(const int type, const uint8_t *blk, const int c,
                                                                   __m256i hb0, __m256i hb1, __m256i *w0,
                                                                   __m256i *w1) {
    avx2_nibble_pair(blk + (type == TL_Q4_K ? 16 : 48) + 16 * c, w0, w1);
    if (type == TL_Q5_K) {
        const __m256i hb = c < 4 ? hb0 : hb1;
        *w0 = _mm256_or_si256(*w0, avx2_q5_bit(hb, (2 * c) % 8));
        *w1 = _mm256_or_si256(*w1, avx2_q5_bit(hb, (2 * c + 1) % 8));
    }
}

/* Q6_K super-block blk: vectors 2c and 2c + 1 (unsigned 0..63, lane order); hv its widened qh chunk c / 2. */
static inline __attribute__((always_inline)) void avx2_q6_vectors(const uint8_t *blk, const int c, __m256i hv,
                                                                   __m256i *w0, __m256i *w1) {
    avx2_nibble_pair(blk + 16 * c, w0, w1);
    *w0 = _mm256_or_si256(*w0, avx2_q6_high(hv, 2 * (c % 2)));
    *w1 = _mm256_or_si256(*w1, avx2_q6_high(hv, 2 * (c % 2) + 1));
}

/* isum[i] += vectors w0, w1 (at int16 offset `at` of the lane-ordered activation rows r0 + i) multiplied. */
static inline __attribute__((always_inline)) void avx2_lane_madd(const avx2_act *a, int64_t r0, const int MR,
                                                                  int64_t at, __m256i w0, __m256i w1,
                                                                  __m256i *isum) {
    for (int i = 0; i < MR; ++i) {
        const int16_t *xq = a->q + (r0 + i) * a->k + at;
        const __m256i p0 = _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)xq));
        const __m256i p1 = _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xq + 16)));
        isum[i] = _mm256_add_epi32(isum[i], _mm256_add_epi32(p0, p1));
    }
}

/* out[i] = Q4_K / Q5_K weight row `row` (lane order) . activation row r0 + i, i < MR: per super-block the 16
 * vectors' products summed per lane (= per sub-block), then acc += sums * (d sc_j) * d_x(j) and
 * offs += -dmin m_j * xs(j). */
static inline __attribute__((always_inline)) void avx2_k4_dot(const int type, const uint8_t *row, int64_t k,
                                                               const avx2_act *a, int64_t r0, const int MR,
                                                               float *out) {
    const int bytes = type == TL_Q4_K ? 144 : 176;
    const int64_t nb = k / 32;
    __m256 acc[4], offs[4];
    for (int i = 0; i < MR; ++i) acc[i] = offs[i] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < k / 256; ++sb) {
        const uint8_t *blk = row + sb * bytes;
        __m256i hb0 = _mm256_setzero_si256(), hb1 = hb0, isum[4];
        if (type == TL_Q5_K) {
            hb0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 16)));
            hb1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 32)));
        }
        for (int i = 0; i < MR; ++i) isum[i] = _mm256_setzero_si256();
#pragma GCC unroll 2 /* fully unrolled, gcc hoists all 16 weight vectors and spills them */
        for (int c = 0; c < 8; ++c) {
            __m256i w0, w1;
            avx2_k4_vectors(type, blk, c, hb0, hb1, &w0, &w1);
            avx2_lane_madd(a, r0, MR, 256 * sb + 32 * c, w0, w1, isum);
        }
        __m256 dw, off;
        avx2_k4_scale_off(blk, &dw, &off);
        for (int i = 0; i < MR; ++i) {
            const int64_t at = (r0 + i) * nb + 8 * sb;
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_mul_ps(dw, _mm256_loadu_ps(a->dc + at)),
                                     acc[i]);
            offs[i] = _mm256_fmadd_ps(off, _mm256_loadu_ps(a->xs + at), offs[i]);
        }
    }
    for (int i = 0; i < MR; ++i) out[i] = avx2_hsum(acc[i]) + (avx2_hsum(offs[i]) + 0.f);
}

/* Lanes 2l and 2l + 1: p[l] (l < 4). */
static inline __m256 avx2_dup4(const float *p) {
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(p)), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
}

/* out[i] = Q6_K weight row `row` (lane order) . activation row r0 + i, i < MR: per span of 128 the eight
 * vectors' products of the unsigned quants summed per lane (= per 16-element sub-block), minus 32 times the
 * sub-block's activation sum, then acc += sums * (d sc_j) * d_x(block of j). */
static inline __attribute__((always_inline)) void avx2_q6_dot(const uint8_t *row, int64_t k, const avx2_act *a,
                                                               int64_t r0, const int MR, float *out) {
    const int64_t nb = k / 32, n16 = k / 16;
    __m256 acc[4];
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < k / 256; ++sb) {
        const uint8_t *blk = row + sb * 210;
        const __m256 d = _mm256_set1_ps(avx2_h2f(blk + 208));
        for (int g = 0; g < 2; ++g) {
            __m256i isum[4];
            for (int i = 0; i < MR; ++i) isum[i] = _mm256_setzero_si256();
            for (int h = 2 * g; h < 2 * g + 2; ++h) {
                const __m256i hv = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 128 + 16 * h)));
                for (int c = 2 * h; c < 2 * h + 2; ++c) {
                    __m256i w0, w1;
                    avx2_q6_vectors(blk, c, hv, &w0, &w1);
                    avx2_lane_madd(a, r0, MR, 256 * sb + 32 * c, w0, w1, isum);
                }
            }
            const __m256 scale = _mm256_mul_ps(
                d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 192 + 8 * g)))));
            for (int i = 0; i < MR; ++i) {
                const __m256i sums = _mm256_loadu_si256((const __m256i *)(a->s16 + (r0 + i) * n16 + 16 * sb + 8 * g));
                const __m256i dot = _mm256_sub_epi32(isum[i], _mm256_slli_epi32(sums, 5));
                const __m256 dx = avx2_dup4(a->dc + (r0 + i) * nb + 8 * sb + 4 * g);
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(scale, dx), acc[i]);
            }
        }
    }
    for (int i = 0; i < MR; ++i) out[i] = avx2_hsum(acc[i]);
}

/* Dequantize, exact (see quant_avx2.c's: products and sums rounded one at a time, never fused). */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

/* o[0 .. 15] = the 16 int16 of q times per-lane scales (lanes 2l, 2l + 1: s[l], from s_lo for l < 4, s_hi
 * after), minus m_lo / m_hi likewise where has_min. */
static inline void avx2_emit16(float *o, __m256i q, __m256 s_lo, __m256 s_hi, const int has_min, __m256 m_lo,
                               __m256 m_hi) {
    __m256 lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(q))), s_lo);
    __m256 hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(q, 1))), s_hi);
    if (has_min) {
        lo = _mm256_sub_ps(lo, m_lo);
        hi = _mm256_sub_ps(hi, m_hi);
    }
    _mm256_storeu_ps(o, lo);
    _mm256_storeu_ps(o + 8, hi);
}

/* Lanes 2l, 2l + 1 of the result: v[l + 4 half] (half 0: v's first four lanes, 1: its last four). */
static inline __m256 avx2_pairs(__m256 v, const int half) {
    return half ? _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7))
                : _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
}

/* K-type row `row` (lane order) dequantized to float32 in lane order: the gguf package's values, bit for bit. */
static void avx2_k_dequant_lanes(int type, const uint8_t *row, int64_t k, float *out) {
    for (int64_t sb = 0; sb < k / 256; ++sb) {
        float *o = out + 256 * sb;
        if (type == TL_Q6_K) {
            const uint8_t *blk = row + sb * 210;
            const __m256 d = _mm256_set1_ps(avx2_h2f(blk + 208));
            for (int c = 0; c < 8; ++c) {
                const int g = c / 4;
                const __m256 sc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                       _mm_loadl_epi64((const __m128i *)(blk + 192 + 8 * g)))));
                const __m256i hv = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 128 + 16 * (c / 2))));
                __m256i w0, w1;
                avx2_q6_vectors(blk, c, hv, &w0, &w1);
                const __m256i off = _mm256_set1_epi16(32);
                const __m256 s_lo = avx2_pairs(sc, 0), s_hi = avx2_pairs(sc, 1), none = _mm256_setzero_ps();
                avx2_emit16(o + 32 * c, _mm256_sub_epi16(w0, off), s_lo, s_hi, 0, none, none);
                avx2_emit16(o + 32 * c + 16, _mm256_sub_epi16(w1, off), s_lo, s_hi, 0, none, none);
            }
            continue;
        }
        const uint8_t *blk = row + sb * (type == TL_Q4_K ? 144 : 176);
        const __m128i sm = avx2_k4_scales(blk + 4);
        const __m256 ds = _mm256_mul_ps(_mm256_set1_ps(avx2_h2f(blk)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)));
        const __m256 dm = _mm256_mul_ps(_mm256_set1_ps(avx2_h2f(blk + 2)),
                                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))));
        const __m256 s_lo = avx2_pairs(ds, 0), s_hi = avx2_pairs(ds, 1), m_lo = avx2_pairs(dm, 0),
                     m_hi = avx2_pairs(dm, 1);
        __m256i hb0 = _mm256_setzero_si256(), hb1 = hb0;
        if (type == TL_Q5_K) {
            hb0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 16)));
            hb1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 32)));
        }
        for (int c = 0; c < 8; ++c) {
            __m256i w0, w1;
            avx2_k4_vectors(type, blk, c, hb0, hb1, &w0, &w1);
            avx2_emit16(o + 32 * c, w0, s_lo, s_hi, 1, m_lo, m_hi);
            avx2_emit16(o + 32 * c + 16, w1, s_lo, s_hi, 1, m_lo, m_hi);
        }
    }
}
#pragma GCC pop_options
