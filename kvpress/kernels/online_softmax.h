/* What the C read kernels share, as kernels/online_softmax.py is for the torch ones: a softmax state is (running max,
 * running sum, accumulator), and partial states over disjoint slot ranges are merged under their common max.
 * Included by lowbit_cpu.c, sparse_cpu.c and vq_read_cpu.c (native.py rebuilds a kernel when this file changes). */
#ifndef KVPRESS_ONLINE_SOFTMAX_H
#define KVPRESS_ONLINE_SOFTMAX_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* exp(x) for x <= 0 (a logit minus its row's max), written out so that loops over it vectorise (libm's expf is
 * one call per element): exp(x) = 2^k e^r with k = round(x / ln 2), |r| <= ln 2 / 2, e^r by Cephes' degree-6
 * polynomial (about 1 ulp). Below -87 (and at -inf, a masked slot) it is 0: a term under 2^-125 of a sum that
 * holds 1. */
static inline float exp_nonpositive(float x) {
    const float clamped = x < -87.0f ? -87.0f : x;
    const float k = floorf(clamped * 1.44269504088896341f + 0.5f);
    const float r = clamped - k * 0.693359375f + k * 2.12194440e-4f; /* ln 2 in two parts: r stays exact */
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    const int32_t exponent = ((int32_t)k + 127) << 23; /* 2^k, k in [-126, 0] */
    float scale;
    memcpy(&scale, &exponent, sizeof scale);
    return x < -87.0f ? 0.0f : y * scale;
}

/* One query row's logit against one key: scaled dot product, then softcap (softcap <= 0: none). */
static inline float attention_logit(const float *q, const float *k, int64_t dim, float scaling, float softcap) {
    float dot = 0.0f;
    for (int64_t d = 0; d < dim; ++d) dot += q[d] * k[d];
    const float logit = dot * scaling;
    return softcap > 0.0f ? tanhf(logit / softcap) * softcap : logit;
}

/* Folds one row's block of n logits (-inf: not read) into its running max *m and sum *l: the logits become
 * probabilities under the new max, and the factor the row's accumulator must be multiplied by is returned (1 when
 * the max did not move). A block with no readable logit leaves m and l as they were and zeroes the row. */
static inline float fold_block(float *row, int64_t n, float *m, float *l) {
    float block_max = -INFINITY;
    for (int64_t j = 0; j < n; ++j) block_max = row[j] > block_max ? row[j] : block_max;
    if (block_max == -INFINITY) {
        for (int64_t j = 0; j < n; ++j) row[j] = 0.0f;
        return 1.0f;
    }
    const float new_max = *m > block_max ? *m : block_max;
    const float correction = exp_nonpositive(*m - new_max); /* m = -inf: 0 */
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) sum += (row[j] = exp_nonpositive(row[j] - new_max));
    *l = *l * correction + sum;
    *m = new_max;
    return correction;
}

/* The states of `rows` rows whose first block is p [rows, n]: fold_block from an empty state (m = -inf, l = 0). */
static inline void start_rows(float *p, int64_t rows, int64_t n, float *m_out, float *l_out) {
    for (int64_t r = 0; r < rows; ++r) {
        m_out[r] = -INFINITY, l_out[r] = 0.0f;
        fold_block(p + r * n, n, m_out + r, l_out + r);
    }
}

/* Work item `split` of `splits` over n slots reads [*lo, *hi): runs of ceil(n / splits), the last ones shorter or
 * empty. */
static inline void split_range(int64_t n, int64_t splits, int64_t split, int64_t *lo, int64_t *hi) {
    const int64_t per_split = (n + splits - 1) / splits;
    *hi = (split + 1) * per_split < n ? (split + 1) * per_split : n;
    *lo = split * per_split < *hi ? split * per_split : *hi;
}

/* The partial states that `items` work items leave, `rows` query rows each: m, l [items, rows], acc [items, rows,
 * dim], in one buffer. partials_alloc returns nonzero (and holds nothing) when it could not be allocated. */
typedef struct {
    float *m, *l, *acc;
} partials;

static inline int partials_alloc(partials *p, int64_t items, int64_t rows, int64_t dim) {
    p->m = malloc(sizeof(float) * items * rows * (dim + 2));
    p->l = p->m ? p->m + items * rows : NULL;
    p->acc = p->m ? p->l + items * rows : NULL;
    return p->m == NULL;
}

static inline void partials_free(partials *p) {
    free(p->m);
    p->m = p->l = p->acc = NULL;
}

/* Partial states m/l [heads, parts, rows], acc [heads, parts, rows, dim] -> each head's state m/l [heads, rows], acc
 * [heads, rows, dim]: each row's partials rescaled to their common max and summed (a partial over no slot has max
 * -inf and weighs 0). */
static void merge_partials(const float *m_part, const float *l_part, const float *acc_part, int64_t heads,
                           int64_t parts, int64_t rows, int64_t dim, float *m_out, float *l_out, float *acc_out) {
    for (int64_t h = 0; h < heads; ++h)
        for (int64_t r = 0; r < rows; ++r) {
            const float *m_s = m_part + h * parts * rows + r, *l_s = l_part + h * parts * rows + r;
            const float *acc_s = acc_part + (h * parts * rows + r) * dim;
            float m = -INFINITY, l = 0.0f, *acc = acc_out + (h * rows + r) * dim;
            for (int64_t s = 0; s < parts; ++s) m = m_s[s * rows] > m ? m_s[s * rows] : m;
            const float safe = isinf(m) ? 0.0f : m;
            memset(acc, 0, sizeof(float) * dim);
            for (int64_t s = 0; s < parts; ++s) {
                const float w = exp_nonpositive(m_s[s * rows] - safe);
                l += l_s[s * rows] * w;
                for (int64_t d = 0; d < dim; ++d) acc[d] += acc_s[s * rows * dim + d] * w;
            }
            m_out[h * rows + r] = m;
            l_out[h * rows + r] = l;
        }
}

#endif
