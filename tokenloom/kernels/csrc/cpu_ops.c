/*
 * Row-wise elementwise kernels of the decoder layer on the CPU, one native call each instead of the 5-15
 * small aten ops (and their dtype conversions) that the torch expressions need:
 *
 *   rms_norm:      [residual_out =] x (+ residual);  out = residual_out * rsqrt(mean(residual_out^2) + eps) * w
 *   rms_norm_bf16_res32: the same with a float32 residual stream (bf16 x, w and out): the sum is kept in float32
 *                  and normalized unrounded, so rounding error does not accumulate along the residual stream
 *   silu_and_mul:  out[:, i] = silu(x[:, i]) * x[:, inter + i]
 *   rope:          rotate-half rotary embedding of every head of x, in place, from float32 cos/sin tables
 *   rope_part:     the same on the first rot_dim elements of each head only (partial rotary, Phi-4-mini)
 *   qk_head_norm:  per-head RMSNorm of the q and k heads of packed qkv rows, in place (Qwen3's q_norm/k_norm)
 *   argmax_rows:   index of each float32 row's maximum, as torch.argmax gives it (first maximum; a NaN wins)
 *   apply_token_bitmask: -inf into the float32 logits a packed grammar bitmask disallows (constrained decoding)
 *
 * Every value is computed in float32 and rounded once to the storage type (bf16: round to nearest even); a
 * residual sum is rounded before it is normalized, so the stored residual is exactly what was normalized.
 * Rows are independent: a row's input may start at any stride (packed qkv / gate_up outputs), the elements
 * of one row are contiguous. Rows are split over OpenMP threads (torch's libgomp) when there are enough.
 */
#include "bf16_common.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PARALLEL_MIN_ELEMENTS 32768 /* below this a step runs on the calling thread only */

/* silu(v) = v / (1 + e^-v), its exponent capped at 88 (e^88 < FLT_MAX): under -ffast-math the division by an
 * overflowed e^-v (v below about -88.7) came out NaN where the value is -0; from -88 down the result is a few
 * times 1e-36 either way, above it unchanged. Every SwiGLU here (silu_and_mul, the MoE experts) uses it. */
static inline float silu_f32(float v) { return v / (1.f + expf(-(v < -88.f ? -88.f : v))); }

/* A float32 [gate | up] row of 2 inter values turned in place into silu(gate) * up in its first inter (the MoE
 * calls' SwiGLU between their projections). */
static inline void swiglu_row_f32(float *row, int64_t inter) {
    for (int64_t j = 0; j < inter; ++j) row[j] = silu_f32(row[j]) * row[inter + j];
}


#define LOAD_f32(x) (x)
#define STORE_f32(x) (x)
#define LOAD_bf16(x) bf16_to_f32(x)
#define STORE_bf16(x) f32_to_bf16(x)

/* Threads for a loop over `rows` rows of `elements` in all: never more than rows (a thread with no row still
 * costs the fork and the join: on a loaded machine, the wait for a preempted thread to be scheduled). */
static inline int use_threads(int64_t rows, int64_t elements, int threads) {
    if (elements < PARALLEL_MIN_ELEMENTS || threads <= 1 || rows <= 1) return 1;
    return rows < threads ? (int)rows : threads;
}

#define DEFINE_OPS(SUFFIX, T)                                                                                  \
KERNEL_API int rms_norm_##SUFFIX(const T *x, int64_t x_stride, const T *residual, int64_t residual_stride,    \
                                 const T *w, T *out, T *residual_out, int64_t rows, int64_t hidden, float eps, \
                                 int threads) {                                                                \
    _Pragma("omp parallel for schedule(static) num_threads(use_threads(rows, rows * hidden, threads))")        \
    for (int64_t r = 0; r < rows; ++r) {                                                                       \
        const T *src = x + r * x_stride; /* the row that is normalized (after the residual add) */            \
        if (residual != NULL) {                                                                                \
            const T *rr = residual + r * residual_stride;                                                      \
            T *ro = residual_out + r * hidden;                                                                 \
            for (int64_t i = 0; i < hidden; ++i)                                                               \
                ro[i] = STORE_##SUFFIX(LOAD_##SUFFIX(src[i]) + LOAD_##SUFFIX(rr[i]));                          \
            src = ro;                                                                                          \
        }                                                                                                      \
        /* a separate read-only pass: its summation order cannot depend on whether residual_out aliases an     \
         * input (the compiler vectorizes a possibly-aliased loop differently) */                              \
        float ss = 0.f;                                                                                        \
        for (int64_t i = 0; i < hidden; ++i) {                                                                 \
            const float v = LOAD_##SUFFIX(src[i]);                                                             \
            ss += v * v;                                                                                       \
        }                                                                                                      \
        const float inv = 1.f / sqrtf(ss / (float)hidden + eps);                                               \
        T *o = out + r * hidden;                                                                               \
        for (int64_t i = 0; i < hidden; ++i)                                                                   \
            o[i] = STORE_##SUFFIX(LOAD_##SUFFIX(src[i]) * inv * LOAD_##SUFFIX(w[i]));                          \
    }                                                                                                          \
    return 0;                                                                                                  \
}                                                                                                              \
                                                                                                               \
KERNEL_API int silu_and_mul_##SUFFIX(const T *x, int64_t x_stride, T *out, int64_t rows, int64_t inter,      \
                                     int threads) {                                                            \
    _Pragma("omp parallel for schedule(static) num_threads(use_threads(rows, rows * inter, threads))")         \
    for (int64_t r = 0; r < rows; ++r) {                                                                       \
        const T *gate = x + r * x_stride, *up = gate + inter;                                                  \
        T *o = out + r * inter;                                                                                \
        for (int64_t i = 0; i < inter; ++i) {                                                                  \
            const float g = LOAD_##SUFFIX(gate[i]);                                                            \
            o[i] = STORE_##SUFFIX(silu_f32(g) * LOAD_##SUFFIX(up[i]));                                          \
        }                                                                                                      \
    }                                                                                                          \
    return 0;                                                                                                  \
}                                                                                                              \
                                                                                                               \
KERNEL_API int rope_part_##SUFFIX(T *x, int64_t x_stride, const int64_t *positions, const float *cos_table,   \
                                  const float *sin_table, int64_t rows, int heads, int head_stride,            \
                                  int rot_dim, int threads) {                                                  \
    /* the first rot_dim elements of each head (head_stride apart) rotate; the rest pass (partial rotary) */  \
    const int half = rot_dim / 2;                                                                              \
    _Pragma("omp parallel for schedule(static) num_threads(use_threads(rows, rows * heads * rot_dim, threads))") \
    for (int64_t r = 0; r < rows; ++r) {                                                                       \
        /* cos_table rows are [cos | cos], sin_table rows [-sin | sin] (rotate-half layout) */                  \
        const float *c = cos_table + positions[r] * rot_dim, *s = sin_table + positions[r] * rot_dim + half;   \
        for (int h = 0; h < heads; ++h) {                                                                      \
            T *xh = x + r * x_stride + (int64_t)h * head_stride;                                               \
            for (int d = 0; d < half; ++d) {                                                                   \
                const float x1 = LOAD_##SUFFIX(xh[d]), x2 = LOAD_##SUFFIX(xh[d + half]);                      \
                xh[d] = STORE_##SUFFIX(x1 * c[d] - x2 * s[d]);                                                 \
                xh[d + half] = STORE_##SUFFIX(x2 * c[d] + x1 * s[d]);                                          \
            }                                                                                                  \
        }                                                                                                      \
    }                                                                                                          \
    return 0;                                                                                                  \
}                                                                                                              \
                                                                                                               \
KERNEL_API int rope_##SUFFIX(T *x, int64_t x_stride, const int64_t *positions, const float *cos_table,        \
                             const float *sin_table, int64_t rows, int heads, int head_dim, int threads) {     \
    return rope_part_##SUFFIX(x, x_stride, positions, cos_table, sin_table, rows, heads, head_dim, head_dim,   \
                              threads);                                                                        \
}

DEFINE_OPS(f32, float)
DEFINE_OPS(bf16, uint16_t)

KERNEL_API int rms_norm_bf16_res32(const uint16_t *x, int64_t x_stride, const float *residual,
                                   int64_t residual_stride, const uint16_t *w, uint16_t *out, float *residual_out,
                                   int64_t rows, int64_t hidden, float eps, int threads) {
    _Pragma("omp parallel for schedule(static) num_threads(use_threads(rows, rows * hidden, threads))")
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t *src = x + r * x_stride;
        const float *rr = residual + r * residual_stride;
        float *ro = residual_out + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) ro[i] = bf16_to_f32(src[i]) + rr[i];
        float ss = 0.f; /* a separate read-only pass, as in rms_norm above */
        for (int64_t i = 0; i < hidden; ++i) ss += ro[i] * ro[i];
        const float inv = 1.f / sqrtf(ss / (float)hidden + eps);
        uint16_t *o = out + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) o[i] = f32_to_bf16(ro[i] * inv * bf16_to_f32(w[i]));
    }
    return 0;
}

/* Qwen3's q_norm / k_norm: in each row of qkv (row r at qkv + r * stride: q_heads heads then kv_heads heads of
 * head_dim, contiguous), every q head is RMS-normalized and scaled by q_w, every k head by k_w (weights of
 * head_dim), in place; the v heads after them are not touched. transformers' order and roundings: normalize in
 * float32, round to bf16, multiply by the weight, round again (Qwen3RMSNorm). */
KERNEL_API int qk_head_norm_bf16(uint16_t *qkv, int64_t stride, int64_t rows, int q_heads, int kv_heads,
                                 int head_dim, const uint16_t *q_w, const uint16_t *k_w, float eps, int threads) {
    const int heads = q_heads + kv_heads;
    _Pragma("omp parallel for schedule(static) num_threads(use_threads(rows, rows * heads * head_dim, threads))")
    for (int64_t r = 0; r < rows; ++r) {
        for (int h = 0; h < heads; ++h) {
            uint16_t *x = qkv + r * stride + (int64_t)h * head_dim;
            const uint16_t *w = h < q_heads ? q_w : k_w;
            float ss = 0.f;
            for (int i = 0; i < head_dim; ++i) {
                const float v = bf16_to_f32(x[i]);
                ss += v * v;
            }
            const float inv = 1.f / sqrtf(ss / (float)head_dim + eps);
            for (int i = 0; i < head_dim; ++i)
                x[i] = f32_to_bf16(bf16_to_f32(w[i]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(x[i]) * inv)));
        }
    }
    return 0;
}

/* out[r] = torch.argmax(x[r]) for float32 rows: the first index of the maximum, or of the first NaN when the
 * row has one (NaN is detected on the bit pattern, which -ffast-math cannot optimize away). torch's CPU
 * argmax over a vocabulary-wide row is a scalar loop; this is a vectorized max then a search for it. */
KERNEL_API int argmax_rows_f32(const float *x, int64_t x_stride, int64_t rows, int64_t cols, int64_t *out,
                               int threads) {
    _Pragma("omp parallel for schedule(static) num_threads(use_threads(rows, rows * cols, threads))")
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * x_stride;
        const uint32_t *bits = (const uint32_t *)xr;
        float m = -INFINITY;
        uint32_t nan = 0;
        for (int64_t i = 0; i < cols; ++i) {
            m = xr[i] > m ? xr[i] : m;
            nan |= (bits[i] & 0x7fffffffu) > 0x7f800000u;
        }
        int64_t at = 0;
        if (nan) {
            while ((bits[at] & 0x7fffffffu) <= 0x7f800000u) ++at;
        } else {
            while (at < cols - 1 && xr[at] != m) ++at;
        }
        out[r] = at;
    }
    return 0;
}


/* Constrained decoding's token mask: for each bitmask row i (bit t of int32 word t / 32 set: token t allowed),
 * logits[rows[i] (or i when rows is NULL)][t] = -inf for every t < vocab it disallows, including every column at
 * or past words * 32 (a logits row wider than the grammar's vocabulary: padded LM heads). Words with every bit
 * set are skipped, so a mostly-allowed row costs one read of its bitmask. -inf is written as its bit pattern
 * (-ffast-math may not assume infinities exist). Runs on the calling thread: the work is one pass over the
 * masked rows, memory-bound, and the sampler calls it between other single-threaded steps. */
KERNEL_API int apply_token_bitmask_f32(float *logits, int64_t logits_stride, int64_t vocab, const int32_t *bitmask,
                                       int64_t words, const int64_t *rows, int64_t n_rows) {
    const uint32_t NEG_INF = 0xff800000u;
    const int64_t covered = words * 32 < vocab ? words * 32 : vocab;
    for (int64_t i = 0; i < n_rows; ++i) {
        uint32_t *row = (uint32_t *)(logits + (rows != NULL ? rows[i] : i) * logits_stride);
        const uint32_t *bits = (const uint32_t *)(bitmask + i * words);
        int64_t t = 0;
#ifdef __AVX512F__
        const __m512i ninf = _mm512_set1_epi32((int)NEG_INF);
        for (; t + 32 <= covered; t += 32) {
            const uint32_t disallowed = ~bits[t / 32];
            if (disallowed == 0) continue;
            _mm512_mask_storeu_epi32(row + t, (__mmask16)(disallowed & 0xffffu), ninf);
            _mm512_mask_storeu_epi32(row + t + 16, (__mmask16)(disallowed >> 16), ninf);
        }
#endif
        for (; t < covered; ++t)
            if (!((bits[t / 32] >> (t % 32)) & 1u)) row[t] = NEG_INF;
        for (t = covered; t < vocab; ++t) row[t] = NEG_INF;
    }
    return 0;
}
