/*
 * The K types (Q4_K, Q5_K, Q6_K) of quant_avx2.c in a sub-block-per-lane layout: each super-block's quants
 * re-laid out once at load so that every int32 lane of the products stays inside one sub-block. Q6_K keeps the
 * file's size; Q4_K / Q5_K also unpack their twelve bytes of 6-bit scales and mins to sixteen, one byte each
 * (148 / 180 bytes a super-block where the file has 144 / 176: 2.8% / 2.3% more): the unpack (about eleven
 * vector instructions) was a third of the per-super-block work at one row (one thread from cache, against the
 * packed form: Q4_K 0.84-0.88x the time at one row, 0.87-0.95x at 2-7; Q5_K 0.89-0.95x).
 *
 * Lane order. A span of S elements (Q4_K / Q5_K: a super-block's 256, eight sub-blocks of 32; Q6_K: half a
 * super-block, 128, eight sub-blocks of 16) is cut into vectors whose int32 lane j holds G consecutive
 * elements of sub-block j (avx2_k_natural):
 *   Q4_K, G = 2 (int16 form): S / 16 vectors of 16 int16, vector t's lanes 2j, 2j + 1 elements S/8 j + 2t,
 *        + 1; the nibbles widened to int16 meet the activations as int16 (128 h + l joined) in vpmaddwd.
 *   Q5_K / Q6_K, G = 4 (byte form): S / 32 vectors of 32 bytes, vector t's bytes 4j .. 4j + 3 elements
 *        S/8 j + 4t .. + 3; vpmaddubsw multiplies the unsigned quants by each of the activations' two int8
 *        terms (h, l: q = 128 h + l), the int16 pair sums add up over two (Q6_K) / four (Q5_K) vectors below
 *        32768, and one vpmaddwd per term (by 128 and by 1) widens them into the sub-block's int32 lane.
 * Either way a span's products add up, lane j, to sub-block j's integer sum: no horizontal reduction, one
 * int->float conversion and one multiply-add per span and activation row with a vector of per-lane scales
 * (the weight sub-block scales times the activation blocks' scales).
 * Measured (Zen 3, bench/ab_kernels.py): the int16 form against the file layout with an add tree, one thread
 * from cache, Q4_K four rows 0.62-0.67x the time, one row 0.89-1.0x, a ~1B Q4_K_M decode step 34.7 -> 30.7 ms;
 * the byte form against the int16 one, one row: Q5_K 0.57-0.62x (one thread from cache) / 0.62-0.75x (two
 * threads from memory), Q6_K 0.73-0.79x / 0.78-0.80x; two rows 0.78-0.95x; three rows Q5_K 0.82-0.90x, Q6_K
 * level; four rows Q5_K level, Q6_K 1.13-1.18x (four rows' int16 sums do not fit the registers: two passes of
 * two, each repeating the unpack and scale work); the ~1B Q4_K_M step 33.1 -> 31.5 ms (its Q6_K).
 * Q4_K stays in the int16 form: the byte form measured level at one row and 1.2-1.4x slower at 2-7 (the
 * nibble unpack it saves is small against the super-block's scale work). Both forms make the same integer sums
 * and the same float operations in the same order: below quant_tile_m rows outputs are bit-identical between
 * them (the float32 tile sums a Q5_K / Q6_K row in the byte form's order: other roundings). Q6_K scales each
 * 16-element sub-block on its own (its -32 offset enters as 32 times the activations' per-16 sums, exact).
 *
 * The activations are quantized per 32 exactly as for the legacy types (avx2_lanes_act: the int16 form's in
 * lane order in place, the byte form's split into the two int8 terms in lane order, once per call and row);
 * the float32 tile (prefill) dequantizes the weights in lane order and puts its activation rows into the same
 * order (avx2_lanes_f32), so every product meets its partner; embedding rows and dequantize put them back.
 *
 * Re-laid super-blocks:
 *   Q4_K / Q5_K: bytes 0-3 f16 d and dmin, 4-11 the scales of sub-blocks 0-7, 12-19 their mins (6 bits each).
 *   Q4_K qs (bytes 20-147): chunk c of 16, byte p: low nibble vector 2c's lane p, high nibble vector 2c + 1's.
 *   Q5_K qs (52-179) / Q6_K ql (0-127): chunk c of 32, byte p: low nibble vector 2c's byte p, high nibble
 *        vector 2c + 1's (Q6_K: vectors 0-3 span 0, 4-7 span 1). Q5_K qh (20-51): byte p, bit b: vector b's
 *        fifth bit at byte p. Q6_K qh (128-191): chunk h of 32, byte p, bits 2s, 2s + 1: the top two bits of
 *        vector 4h + s at byte p; scales and d where the file has them.
 *
 * Included by quant_avx2.c (its activation struct and helpers).
 */

/* Elements per span of the lane order. */
static inline int avx2_k_span(int type) { return type == TL_Q6_K ? 128 : 256; }

/* Consecutive elements a lane holds: 4 for the K types (bytes of vpmaddubsw's u8 vectors, an int32 lane after
 * vpmaddwd), 2 for the legacy types (legacy_avx2.c: int16 pairs). */
static inline int avx2_k_group(int type) { return type == TL_Q5_K || type == TL_Q6_K ? 4 : 2; }

/* Element i of a span in lane order comes from element avx2_k_natural(span, group, i) of file order. */
static inline __attribute__((always_inline)) int avx2_k_natural(int span, int group, int i) {
    const int t = i / (8 * group), j = (i % (8 * group)) / group, e = i % group;
    return span / 8 * j + group * t + e;
}

/* k float32 values of a `type` row between file order and lane order (to_lanes: into it, else back), whole
 * spans (the elements past the last one as they are; src and dst apart). */
static void avx2_reorder_f32(const float *src, float *dst, int64_t k, int type, const int to_lanes) {
    const int span = avx2_k_span(type);
    int64_t s = 0;
#define AVX2_REORDER(GROUP)                                                                                    \
    for (; s + span <= k; s += span)                                                                           \
        for (int i = 0; i < span; i += 2) {                                                                    \
            const int e = avx2_k_natural(span, GROUP, i);                                                      \
            memcpy(dst + s + (to_lanes ? i : e), src + s + (to_lanes ? e : i), 2 * sizeof(float));            \
        }
    if (avx2_k_group(type) == 4) {
        AVX2_REORDER(4)
    } else {
        AVX2_REORDER(2)
    }
#undef AVX2_REORDER
    memcpy(dst + s, src + s, sizeof(float) * (size_t)(k - s));
}
static void avx2_lanes_f32(const float *src, float *dst, int64_t k, int type) {
    avx2_reorder_f32(src, dst, k, type, 1);
}
static void avx2_natural_f32(const float *src, float *dst, int64_t k, int type) {
    avx2_reorder_f32(src, dst, k, type, 0);
}

/* Activation row q (k int16 terms, file order) prepared for `type`. Legacy types: put into lane order in place
 * (whole spans of eight blocks; the tail of nb % 8 blocks stays in file order). K types: split into two int8
 * terms, q = 128 h + l with h = floor((q + 64) / 128) at most 127 and l in [-64, 64] (the same integer
 * products whatever the terms were), h at q8[0 .. k), l at q8[k .. 2k), both in lane order; for Q6_K first its
 * per-16 sums, s16[i] = the sum of elements 16 i .. 16 i + 15 (exact: |sum| <= 16 * 16384). */
static void avx2_lanes_act(int type, int16_t *q, int64_t k, int32_t *s16, int8_t *q8) {
    const int span = avx2_k_span(type), group = avx2_k_group(type);
    if (type == TL_Q6_K)
        for (int64_t i = 0; i < k / 16; ++i) {
            int32_t sum = 0;
            for (int e = 0; e < 16; ++e) sum += q[16 * i + e];
            s16[i] = sum;
        }
    if (group == 2) {
        int16_t tmp[256];
        for (int64_t s = 0; s + span <= k; s += span) {
            memcpy(tmp, q + s, sizeof(int16_t) * (size_t)span);
            for (int i = 0; i < span; i += 2)
                memcpy(q + s + i, tmp + avx2_k_natural(span, 2, i), 2 * sizeof(int16_t));
        }
        return;
    }
    for (int64_t s = 0; s < k; s += span) { /* K rows are whole spans */
        int8_t h[256], l[256];
        for (int i = 0; i < span; ++i) {
            const int hi = (q[s + i] + 64) >> 7; /* 128 at q = 16320: then 127 and l = 64 */
            h[i] = (int8_t)(hi > 127 ? 127 : hi);
            l[i] = (int8_t)(q[s + i] - 128 * h[i]);
        }
        for (int i = 0; i < span; i += 4) {
            memcpy(q8 + s + i, h + avx2_k_natural(span, 4, i), 4);
            memcpy(q8 + k + s + i, l + avx2_k_natural(span, 4, i), 4);
        }
    }
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

/* One file-layout super-block's quant bytes re-laid out into lane order, in place (see the file comment). */
static void avx2_k_relay(int type, uint8_t *blk) {
    uint8_t q[256], lane[256]; /* the quants in file order, then in lane order */
    avx2_k_file_quants(type, blk, q);
    const int span = avx2_k_span(type), group = avx2_k_group(type);
    for (int i = 0; i < 256; ++i) lane[i] = q[i / span * span + avx2_k_natural(span, group, i % span)];
    uint8_t *qs = type == TL_Q6_K ? blk : blk + (type == TL_Q4_K ? 16 : 48);
    if (type == TL_Q4_K) { /* int16 lanes: chunk c of 16 bytes, low nibbles vector 2c, high 2c + 1 */
        for (int c = 0; c < 8; ++c)
            for (int p = 0; p < 16; ++p) qs[16 * c + p] = (uint8_t)(lane[32 * c + p] | lane[32 * c + 16 + p] << 4);
        return;
    }
    for (int c = 0; c < 4; ++c)
        for (int p = 0; p < 32; ++p)
            qs[32 * c + p] = (uint8_t)((lane[64 * c + p] & 15) | (lane[64 * c + 32 + p] & 15) << 4);
    if (type == TL_Q5_K)
        for (int p = 0; p < 32; ++p) {
            int bits = 0;
            for (int b = 0; b < 8; ++b) bits |= (lane[32 * b + p] >> 4) << b;
            blk[16 + p] = (uint8_t)bits;
        }
    if (type == TL_Q6_K)
        for (int h = 0; h < 2; ++h)
            for (int p = 0; p < 32; ++p) {
                int bits = 0;
                for (int s = 0; s < 4; ++s) bits |= (lane[32 * (4 * h + s) + p] >> 4) << (2 * s);
                blk[128 + 32 * h + p] = (uint8_t)bits;
            }
}

/* The n x k / 256 super-blocks of data (file layout at its start; room for the re-laid-out size) re-laid out in
 * place: Q6_K's at the same size; Q4_K's / Q5_K's grow by 4 bytes (their packed scales unpacked), so they go
 * last to first: a super-block's new place never reaches a later one's file bytes still to be read. */
static int avx2_k_repack(int type, uint8_t *data, int64_t n, int64_t k) {
    const int file = type == TL_Q4_K ? 144 : type == TL_Q5_K ? 176 : 210;
    const int bytes = type == TL_Q4_K ? AVX2_Q4K_BYTES : type == TL_Q5_K ? AVX2_Q5K_BYTES : 210;
    for (int64_t b = n * (k / 256) - 1; b >= 0; --b) {
        uint8_t tmp[256]; /* the file super-block (and 4 bytes the scale unpack reads past its 12) */
        memcpy(tmp, data + b * file, (size_t)file);
        avx2_k_relay(type, tmp);
        uint8_t *dst = data + b * bytes;
        if (type == TL_Q6_K) {
            memcpy(dst, tmp, (size_t)file);
            continue;
        }
        memcpy(dst, tmp, 4);                                         /* d, dmin */
        _mm_storeu_si128((__m128i *)(dst + 4), avx2_k4_scales(tmp + 4)); /* sc0-7, mn0-7 */
        memcpy(dst + AVX2_K4_QUANTS, tmp + 16, (size_t)(file - 16));     /* (qh,) qs */
    }
    return 0;
}
static int avx2_q4_k_repack(uint8_t *data, int64_t n, int64_t k) { return avx2_k_repack(TL_Q4_K, data, n, k); }
static int avx2_q5_k_repack(uint8_t *data, int64_t n, int64_t k) { return avx2_k_repack(TL_Q5_K, data, n, k); }
static int avx2_q6_k_repack(uint8_t *data, int64_t n, int64_t k) { return avx2_k_repack(TL_Q6_K, data, n, k); }

/* Q5_K: vector b's fifth bits (bit b of each byte of qh, its 32 bytes) at bit 4 of each byte. */
static inline __m256i avx2_q5_bit(__m256i qh, const int b) {
    const __m256i at4 = b <= 4 ? _mm256_slli_epi16(qh, 4 - b) : _mm256_srli_epi16(qh, b - 4);
    return _mm256_and_si256(at4, _mm256_set1_epi8(0x10));
}

/* Q6_K: vector 4h + s's top two bits (bits 2s, 2s + 1 of each byte of hv, qh chunk h) at bits 4-5. */
static inline __m256i avx2_q6_high(__m256i hv, const int s) {
    const __m256i at4 = s == 0 ? _mm256_slli_epi16(hv, 4)
                        : s == 1 ? _mm256_slli_epi16(hv, 2)
                        : s == 2 ? hv
                                 : _mm256_srli_epi16(hv, 2);
    return _mm256_and_si256(at4, _mm256_set1_epi8(0x30));
}

/* 32 bytes of nibbles at p: the low nibbles into lo, the high ones into hi (bytes, 0..15). */
static inline __attribute__((always_inline)) void avx2_nibbles_u8(const uint8_t *p, __m256i *lo, __m256i *hi) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p), m4 = _mm256_set1_epi8(0x0f);
    *lo = _mm256_and_si256(v, m4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
}

/* Q5_K super-block blk: vectors 2c and 2c + 1 of its weights as bytes (lane order); qh its fifth bits. */
static inline __attribute__((always_inline)) void avx2_q5_vectors(const uint8_t *blk, const int c, __m256i qh,
                                                                   __m256i *w0, __m256i *w1) {
    avx2_nibbles_u8(blk + AVX2_K4_QUANTS + 32 + 32 * c, w0, w1);
    *w0 = _mm256_or_si256(*w0, avx2_q5_bit(qh, 2 * c));
    *w1 = _mm256_or_si256(*w1, avx2_q5_bit(qh, 2 * c + 1));
}

/* Q6_K super-block blk: vectors 2c and 2c + 1 (bytes, unsigned 0..63, lane order); hv its qh chunk c / 2. */
static inline __attribute__((always_inline)) void avx2_q6_vectors(const uint8_t *blk, const int c, __m256i hv,
                                                                   __m256i *w0, __m256i *w1) {
    avx2_nibbles_u8(blk + 32 * c, w0, w1);
    *w0 = _mm256_or_si256(*w0, avx2_q6_high(hv, 2 * (c % 2)));
    *w1 = _mm256_or_si256(*w1, avx2_q6_high(hv, 2 * (c % 2) + 1));
}

/* 16 bytes of nibbles at p widened to int16: the low nibbles into lo, the high ones into hi (0..15). */
static inline __attribute__((always_inline)) void avx2_nibble_pair(const uint8_t *p, __m256i *lo, __m256i *hi) {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm256_and_si256(v, _mm256_set1_epi16(0x0f));
    *hi = _mm256_srli_epi16(v, 4);
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

/* Q4_K / Q5_K super-block sb (at blk) of a row: its per-sub-block integer sums isum[i] (lane j = sub-block j) of
 * activation rows r0 + i scaled into acc[i] += isum * (d sc_j) * d_x(j), and offs[i] += -dmin m_j * xs(j). */
static inline __attribute__((always_inline)) void avx2_k4_scale_rows(const uint8_t *blk, const avx2_act *a,
                                                                      int64_t r0, const int MR, int64_t nb,
                                                                      int64_t sb, const __m256i *isum, __m256 *acc,
                                                                      __m256 *offs) {
    __m256 dw, dm;
    avx2_k4_scale_min(blk, &dw, &dm);
    for (int i = 0; i < MR; ++i) {
        const int64_t at = (r0 + i) * nb + 8 * sb;
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_mul_ps(dw, _mm256_loadu_ps(a->dc + at)), acc[i]);
        offs[i] = _mm256_fnmadd_ps(dm, _mm256_loadu_ps(a->xs + at), offs[i]); /* exactly fma(-dm, xs, offs) */
    }
}

/* out[i] = Q4_K weight row `row` (int16 lane order) . activation row r0 + i, i < MR: per super-block the 16
 * vectors' products summed per lane (= per sub-block), then acc += sums * (d sc_j) * d_x(j) and
 * offs += -dmin m_j * xs(j). */
static inline __attribute__((always_inline)) void avx2_q4k_dot(const uint8_t *row, int64_t k, const avx2_act *a,
                                                                int64_t r0, const int MR, float *out,
                                                                int64_t ahead) {
    const int bytes = AVX2_Q4K_BYTES;
    const int64_t nb = k / 32;
    __m256 acc[4], offs[4];
    for (int i = 0; i < MR; ++i) acc[i] = offs[i] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < k / 256; ++sb) {
        const uint8_t *blk = row + sb * bytes;
        if (ahead > 0) avx2_prefetch_bytes(blk + ahead, bytes);
        __m256i isum[4];
        for (int i = 0; i < MR; ++i) isum[i] = _mm256_setzero_si256();
#pragma GCC unroll 2 /* fully unrolled, gcc hoists all 16 weight vectors and spills them */
        for (int c = 0; c < 8; ++c) {
            __m256i w0, w1;
            avx2_nibble_pair(blk + AVX2_K4_QUANTS + 16 * c, &w0, &w1);
            avx2_lane_madd(a, r0, MR, 256 * sb + 32 * c, w0, w1, isum);
        }
        avx2_k4_scale_rows(blk, a, r0, MR, nb, sb, isum, acc, offs);
    }
    for (int i = 0; i < MR; ++i) out[i] = avx2_hsum(acc[i]) + (avx2_hsum(offs[i]) + 0.f);
}

/* The int16 sums of a few vectors' products, per activation row: h[i] the first int8 terms', l[i] the second's. */
typedef struct {
    __m256i h[4], l[4];
} avx2_u8_acc;

/* acc += weight bytes w (unsigned) times the int8 terms of the lane-ordered activation rows r0 + i at offset
 * `at`: vpmaddubsw, pairs of products in int16 (no saturation: |pair| <= 2 * 63 * 127; the callers widen
 * before a lane could pass 32767). */
static inline __attribute__((always_inline)) void avx2_u8_madd(const avx2_act *a, int64_t r0, const int MR,
                                                                int64_t at, __m256i w, avx2_u8_acc *acc) {
    for (int i = 0; i < MR; ++i) {
        const int8_t *x = a->q8 + 2 * (r0 + i) * a->k + at;
        acc->h[i] = _mm256_add_epi16(acc->h[i], _mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)x)));
        acc->l[i] = _mm256_add_epi16(acc->l[i],
                                     _mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)(x + a->k))));
    }
}

/* isum[i] += 128 acc.h[i] + acc.l[i], each int32 lane the sum of its two int16 lanes (one sub-block's); acc
 * cleared. */
static inline __attribute__((always_inline)) void avx2_u8_widen(const int MR, avx2_u8_acc *acc, __m256i *isum) {
    for (int i = 0; i < MR; ++i) {
        const __m256i h = _mm256_madd_epi16(acc->h[i], _mm256_set1_epi16(128));
        const __m256i l = _mm256_madd_epi16(acc->l[i], _mm256_set1_epi16(1));
        isum[i] = _mm256_add_epi32(isum[i], _mm256_add_epi32(h, l));
        acc->h[i] = acc->l[i] = _mm256_setzero_si256();
    }
}

/* out[i] = Q5_K weight row `row` (byte lane order) . activation row r0 + i, i < MR: per super-block the 8
 * vectors' products summed per lane (= per sub-block) in int16 four at a time (4 * 2 * 31 * 127 < 32768), then
 * acc += sums * (d sc_j) * d_x(j) and offs += -dmin m_j * xs(j). */
static inline __attribute__((always_inline)) void avx2_q5k_dot(const uint8_t *row, int64_t k, const avx2_act *a,
                                                                int64_t r0, const int MR, float *out,
                                                                int64_t ahead) {
    const int bytes = AVX2_Q5K_BYTES;
    const int64_t nb = k / 32;
    __m256 acc[4], offs[4];
    for (int i = 0; i < MR; ++i) acc[i] = offs[i] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < k / 256; ++sb) {
        const uint8_t *blk = row + sb * bytes;
        if (ahead > 0) avx2_prefetch_bytes(blk + ahead, bytes);
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + AVX2_K4_QUANTS));
        __m256i isum[4];
        avx2_u8_acc sums;
        for (int i = 0; i < MR; ++i) isum[i] = sums.h[i] = sums.l[i] = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
            __m256i w0, w1;
            avx2_q5_vectors(blk, c, qh, &w0, &w1);
            avx2_u8_madd(a, r0, MR, 256 * sb + 64 * c, w0, &sums);
            avx2_u8_madd(a, r0, MR, 256 * sb + 64 * c + 32, w1, &sums);
            if (c % 2) avx2_u8_widen(MR, &sums, isum);
        }
        avx2_k4_scale_rows(blk, a, r0, MR, nb, sb, isum, acc, offs);
    }
    for (int i = 0; i < MR; ++i) out[i] = avx2_hsum(acc[i]) + (avx2_hsum(offs[i]) + 0.f);
}

/* Lanes 2l and 2l + 1: p[l] (l < 4). */
static inline __m256 avx2_dup4(const float *p) {
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(p)), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
}

/* out[i] = Q6_K weight row `row` (lane order) . activation row r0 + i, i < MR: per span of 128 the four
 * vectors' products of the unsigned quants summed per lane (= per 16-element sub-block; in int16 two vectors
 * at a time, 2 * 2 * 63 * 127 < 32768), minus 32 times the sub-block's activation sum, then
 * acc += sums * (d sc_j) * d_x(block of j). */
static inline __attribute__((always_inline)) void avx2_q6_dot(const uint8_t *row, int64_t k, const avx2_act *a,
                                                               int64_t r0, const int MR, float *out,
                                                               int64_t ahead) {
    const int64_t nb = k / 32, n16 = k / 16;
    __m256 acc[4];
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < k / 256; ++sb) {
        const uint8_t *blk = row + sb * 210;
        if (ahead > 0) avx2_prefetch_bytes(blk + ahead, 210);
        const __m256 d = _mm256_set1_ps(avx2_h2f(blk + 208));
/* both loops unrolled (gcc kept them as loops with their counters): one thread from cache 0.80-0.87x the time */
#pragma GCC unroll 2
        for (int g = 0; g < 2; ++g) {
            __m256i isum[4];
            avx2_u8_acc sums;
            for (int i = 0; i < MR; ++i) isum[i] = sums.h[i] = sums.l[i] = _mm256_setzero_si256();
            const __m256i hv = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * g));
#pragma GCC unroll 2
            for (int c = 2 * g; c < 2 * g + 2; ++c) {
                __m256i w0, w1;
                avx2_q6_vectors(blk, c, hv, &w0, &w1);
                avx2_u8_madd(a, r0, MR, 256 * sb + 64 * c, w0, &sums);
                avx2_u8_madd(a, r0, MR, 256 * sb + 64 * c + 32, w1, &sums);
                avx2_u8_widen(MR, &sums, isum);
            }
            const __m256 scale = _mm256_mul_ps(
                d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 192 + 8 * g)))));
            for (int i = 0; i < MR; ++i) {
                const __m256i s = _mm256_loadu_si256((const __m256i *)(a->s16 + (r0 + i) * n16 + 16 * sb + 8 * g));
                const __m256i dot = _mm256_sub_epi32(isum[i], _mm256_slli_epi32(s, 5));
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

/* o[0 .. 31] = the 32 bytes of w (unsigned) minus `bias`, times per-lane scales s[q] for o[8 q .. 8 q + 7] (lanes
 * 0-3 one sub-block's, 4-7 the next one's), minus m[q] likewise where has_min. */
static inline void avx2_emit32(float *o, __m256i w, const __m256 *s, const int has_min, const __m256 *m,
                               const int bias) {
    const __m128i half[2] = {_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)};
    for (int q = 0; q < 4; ++q) {
        const __m128i bytes = q % 2 ? _mm_srli_si128(half[q / 2], 8) : half[q / 2];
        const __m256i v = _mm256_sub_epi32(_mm256_cvtepu8_epi32(bytes), _mm256_set1_epi32(bias));
        __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(v), s[q]);
        if (has_min) f = _mm256_sub_ps(f, m[q]);
        _mm256_storeu_ps(o + 8 * q, f);
    }
}

/* Lanes 0-3 of result q: v[2 q + 4 half], lanes 4-7: v[2 q + 1 + 4 half] (q < 4, half 0: v's first four lanes
 * feed q = 0, 1; see avx2_k_dequant_lanes). */
static inline void avx2_quads(__m256 v, __m256 *out) {
    for (int q = 0; q < 4; ++q)
        out[q] = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(2 * q, 2 * q, 2 * q, 2 * q, 2 * q + 1, 2 * q + 1,
                                                               2 * q + 1, 2 * q + 1));
}

/* K-type row `row` (lane order) dequantized to float32 in lane order: the gguf package's values, bit for bit. */
static void avx2_k_dequant_lanes(int type, const uint8_t *row, int64_t k, float *out) {
    for (int64_t sb = 0; sb < k / 256; ++sb) {
        float *o = out + 256 * sb;
        if (type == TL_Q6_K) {
            const uint8_t *blk = row + sb * 210;
            const __m256 d = _mm256_set1_ps(avx2_h2f(blk + 208));
            for (int g = 0; g < 2; ++g) {
                __m256 s[4];
                avx2_quads(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                _mm_loadl_epi64((const __m128i *)(blk + 192 + 8 * g))))),
                           s);
                const __m256i hv = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * g));
                for (int c = 2 * g; c < 2 * g + 2; ++c) {
                    __m256i w0, w1;
                    avx2_q6_vectors(blk, c, hv, &w0, &w1);
                    avx2_emit32(o + 64 * c, w0, s, 0, s, 32);
                    avx2_emit32(o + 64 * c + 32, w1, s, 0, s, 32);
                }
            }
            continue;
        }
        const uint8_t *blk = row + sb * (type == TL_Q4_K ? AVX2_Q4K_BYTES : AVX2_Q5K_BYTES);
        const __m128i sm = _mm_loadu_si128((const __m128i *)(blk + 4));
        const __m256 ds = _mm256_mul_ps(_mm256_set1_ps(avx2_h2f(blk)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)));
        const __m256 dm = _mm256_mul_ps(_mm256_set1_ps(avx2_h2f(blk + 2)),
                                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))));
        if (type == TL_Q4_K) {
            const __m256 s_lo = avx2_pairs(ds, 0), s_hi = avx2_pairs(ds, 1), m_lo = avx2_pairs(dm, 0),
                         m_hi = avx2_pairs(dm, 1);
            for (int c = 0; c < 8; ++c) {
                __m256i w0, w1;
                avx2_nibble_pair(blk + AVX2_K4_QUANTS + 16 * c, &w0, &w1);
                avx2_emit16(o + 32 * c, w0, s_lo, s_hi, 1, m_lo, m_hi);
                avx2_emit16(o + 32 * c + 16, w1, s_lo, s_hi, 1, m_lo, m_hi);
            }
            continue;
        }
        __m256 s[4], m[4];
        avx2_quads(ds, s);
        avx2_quads(dm, m);
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + AVX2_K4_QUANTS));
        for (int c = 0; c < 4; ++c) {
            __m256i w0, w1;
            avx2_q5_vectors(blk, c, qh, &w0, &w1);
            avx2_emit32(o + 64 * c, w0, s, 1, m, 0);
            avx2_emit32(o + 64 * c + 32, w1, s, 1, m, 0);
        }
    }
}
#pragma GCC pop_options
