/* 16-lane float vectors (GCC/clang vector extensions, lowered to whatever the machine has) and their loads, for
 * lowbit_cpu.c's vectorised split. */
#ifndef KVPRESS_VECTORS16_H
#define KVPRESS_VECTORS16_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint32_t v4u __attribute__((vector_size(16)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline float sum16(v16f x) { /* halves added, then quarters (no shuffle builtin: GCC < 12 has none) */
    v8f a, b;
    memcpy(&a, &x, sizeof a);
    memcpy(&b, (const char *)&x + sizeof a, sizeof b);
    a += b;
    v4f c, d;
    memcpy(&c, &a, sizeof c);
    memcpy(&d, (const char *)&a + sizeof c, sizeof d);
    c += d;
    return (c[0] + c[2]) + (c[1] + c[3]);
}

static inline v16f load16(const float *src) {
    v16f x;
    memcpy(&x, src, sizeof x);
    return x;
}

/* 16 fp16 values as floats: one conversion instruction where the machine has one (GCC 12 converts a vector of
 * _Float16 lane by lane), else lane by lane into registers (never stored as scalars and reloaded as a vector:
 * that stalls store forwarding) */
static inline v16f load16_half(const _Float16 *src) {
#if defined(__AVX512F__)
    return (v16f)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)src));
#elif defined(__F16C__)
    const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)src)),
                 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 8)));
    v16f x;
    memcpy(&x, &lo, sizeof lo);
    memcpy((char *)&x + sizeof lo, &hi, sizeof hi);
    return x;
#else
    return (v16f){src[0], src[1], src[2], src[3], src[4], src[5], src[6], src[7], src[8], src[9], src[10], src[11],
                  src[12], src[13], src[14], src[15]};
#endif
}

/* GEAR's rank-long rows (rank <= 4 in the vectorised split) as one vector, zero beyond the rank, built in
 * registers (no read past the row) */
#define MAX_RANK_VECTOR 4
static inline v4f rank_vector_half(const _Float16 *row, int64_t rank) {
    return (v4f){(float)row[0], rank > 1 ? (float)row[1] : 0.0f, rank > 2 ? (float)row[2] : 0.0f,
                 rank > 3 ? (float)row[3] : 0.0f};
}

static inline v4f rank_vector(const float *row, int64_t rank) {
    return (v4f){row[0], rank > 1 ? row[1] : 0.0f, rank > 2 ? row[2] : 0.0f, rank > 3 ? row[3] : 0.0f};
}

static inline float sum4(v4f x) { return (x[0] + x[2]) + (x[1] + x[3]); }

#endif
