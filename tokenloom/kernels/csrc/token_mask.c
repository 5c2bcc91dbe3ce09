/* Grammar token masks (tokenloom/grammar/): set the float32 logits of the tokens a packed bitmask disallows
 * to -inf, in place.
 *
 *   apply_token_bitmask_f32: row i of `bitmask` ([n, words] int32, bit t % 32 of word t / 32 set: token t
 *   allowed, the layout xgrammar and llguidance fill) masks logits row rows[i]; columns at or past words * 32
 *   are disallowed too (an LM head wider than the grammar's vocabulary).
 *
 * A word with every bit set (the common case inside free text) costs one compare; -inf is stored as its bit
 * pattern, which -ffast-math cannot fold away. Rows are split over OpenMP threads when there are enough.
 */
#include <stdint.h>

#define NEG_INF_BITS 0xff800000u
#define MASK_PARALLEL_MIN_ROWS 8

KERNEL_API int apply_token_bitmask_f32(float *logits, int64_t stride, int64_t cols, const int32_t *bitmask,
                                       int64_t words, const int64_t *rows, int64_t n, int threads) {
    _Pragma("omp parallel for schedule(static) num_threads(n >= MASK_PARALLEL_MIN_ROWS && threads > 1 ? threads : 1)")
    for (int64_t i = 0; i < n; ++i) {
        uint32_t *row = (uint32_t *)(logits + rows[i] * stride);
        const uint32_t *bits = (const uint32_t *)(bitmask + i * words);
        int64_t full = cols / 32 < words ? cols / 32 : words;
        for (int64_t w = 0; w < full; ++w) {
            uint32_t m = bits[w];
            if (m == 0xffffffffu) continue;
            uint32_t *out = row + w * 32;
            for (int b = 0; b < 32; ++b)
                if (!((m >> b) & 1u)) out[b] = NEG_INF_BITS;
        }
        for (int64_t t = full * 32; t < cols; ++t) {
            int64_t w = t / 32;
            if (w >= words || !((bits[w] >> (t % 32)) & 1u)) row[t] = NEG_INF_BITS;
        }
    }
    return 0;
}
