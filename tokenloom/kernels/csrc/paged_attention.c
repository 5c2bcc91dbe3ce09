/*
 * Paged decode attention for the CPU: one query token per request, reading each request's K/V rows straight
 * from the paged KV pool (no gathered copy), so every KV byte is read once per step.
 *
 * Layout: q/out [B, Hq, D]; k/v pool [Hkv, rows, D]; request b's slots are indices[indptr[b] .. indptr[b+1]).
 * Work is split over (request, kv head) pairs with OpenMP (torch's own runtime, same soname). Scores,
 * softmax and the weighted sum of V are computed in float32; bf16 inputs are widened exactly and the output
 * is rounded to nearest even.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#define MAX_GROUP 16
#define MAX_DIM 256

#define DEFINE_KERNEL(NAME, T, LOAD, STORE)                                                               \
void NAME(const T *q, const T *k, const T *v, const int64_t *indptr, const int64_t *indices, T *out,          \
          int batch, int num_heads, int num_kv_heads, int head_dim, int64_t rows, float scale, int threads) { \
    const int group = num_heads / num_kv_heads;                                                          \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")                                \
    for (int64_t job = 0; job < (int64_t)batch * num_kv_heads; ++job) {                                   \
        const int b = (int)(job / num_kv_heads), h = (int)(job % num_kv_heads);                          \
        const int64_t start = indptr[b], len = indptr[b + 1] - start;                                     \
        float qf[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM], row[MAX_DIM];                                \
        float *scores = (float *)malloc(sizeof(float) * (size_t)(len > 0 ? len : 1) * group);            \
        for (int g = 0; g < group; ++g) {                                                                 \
            const T *qp = q + ((int64_t)b * num_heads + (int64_t)h * group + g) * head_dim;               \
            for (int d = 0; d < head_dim; ++d) { qf[g][d] = LOAD(qp[d]) * scale; acc[g][d] = 0.f; }       \
        }                                                                                                 \
        float mx[MAX_GROUP];                                                                              \
        for (int g = 0; g < group; ++g) mx[g] = -INFINITY;                                                \
        const T *kh = k + (int64_t)h * rows * head_dim, *vh = v + (int64_t)h * rows * head_dim;           \
        for (int64_t l = 0; l < len; ++l) {                                                               \
            const T *kp = kh + indices[start + l] * head_dim;                                             \
            for (int d = 0; d < head_dim; ++d) row[d] = LOAD(kp[d]);                                      \
            for (int g = 0; g < group; ++g) {                                                             \
                float s = 0.f;                                                                            \
                for (int d = 0; d < head_dim; ++d) s += qf[g][d] * row[d];                                \
                scores[(int64_t)g * len + l] = s;                                                         \
                if (s > mx[g]) mx[g] = s;                                                                 \
            }                                                                                             \
        }                                                                                                 \
        float denom[MAX_GROUP];                                                                           \
        for (int g = 0; g < group; ++g) {                                                                 \
            float sum = 0.f;                                                                              \
            for (int64_t l = 0; l < len; ++l) {                                                           \
                float e = expf(scores[(int64_t)g * len + l] - mx[g]);                                     \
                scores[(int64_t)g * len + l] = e;                                                         \
                sum += e;                                                                                 \
            }                                                                                             \
            denom[g] = sum > 0.f ? 1.f / sum : 0.f;                                                       \
        }                                                                                                 \
        for (int64_t l = 0; l < len; ++l) {                                                               \
            const T *vp = vh + indices[start + l] * head_dim;                                             \
            for (int d = 0; d < head_dim; ++d) row[d] = LOAD(vp[d]);                                      \
            for (int g = 0; g < group; ++g) {                                                             \
                const float p = scores[(int64_t)g * len + l];                                             \
                for (int d = 0; d < head_dim; ++d) acc[g][d] += p * row[d];                               \
            }                                                                                             \
        }                                                                                                 \
        for (int g = 0; g < group; ++g) {                                                                 \
            T *op = out + ((int64_t)b * num_heads + (int64_t)h * group + g) * head_dim;                   \
            for (int d = 0; d < head_dim; ++d) op[d] = STORE(acc[g][d] * denom[g]);                       \
        }                                                                                                 \
        free(scores);                                                                                     \
    }                                                                                                     \
}

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
DEFINE_KERNEL(paged_decode_attention_f32, float, LOAD_F32, STORE_F32)
DEFINE_KERNEL(paged_decode_attention_bf16, uint16_t, bf16_to_f32, f32_to_bf16)

int kernel_limits(int *max_group, int *max_dim) {
    *max_group = MAX_GROUP;
    *max_dim = MAX_DIM;
    return 0;
}
