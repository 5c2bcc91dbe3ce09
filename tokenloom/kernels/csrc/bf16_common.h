/*
 * Helpers shared by the CPU kernels: exact bf16 -> float32 widening, float32 -> bf16 rounding to nearest
 * even (NaN kept NaN), and (with AVX-512) the batched horizontal sum of 16 vectors.
 */
#ifndef TOKENLOOM_BF16_COMMON_H
#define TOKENLOOM_BF16_COMMON_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Entry points called from Python. Never inlined: the native decode step calls the very same machine code
 * as the modular path, so -ffast-math cannot make the two round differently. */
#define KERNEL_API __attribute__((noinline, used))

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

#if defined(__AVX512F__)
/* Horizontal sums of 16 vectors in one pass (45 shuffles/adds instead of 16 x 8). Input slot i must hold the
 * vector of item 4 * (i % 4) + i / 4; lane j of the result is then the sum of item j. */
static inline __attribute__((always_inline)) __m512 reduce16(const __m512 *v) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; ++i)
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int j = 0; j < 4; ++j)
        b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xDD));
    const __m512 c0 = _mm512_add_ps(_mm512_unpacklo_ps(b[0], b[1]), _mm512_unpackhi_ps(b[0], b[1]));
    const __m512 c1 = _mm512_add_ps(_mm512_unpacklo_ps(b[2], b[3]), _mm512_unpackhi_ps(b[2], b[3]));
    return _mm512_add_ps(_mm512_shuffle_ps(c0, c1, 0x44), _mm512_shuffle_ps(c0, c1, 0xEE));
}

/* slot in reduce16's input for item t */
#define REDUCE16_SLOT(t) (4 * ((t) % 4) + (t) / 4)
#endif

#endif
