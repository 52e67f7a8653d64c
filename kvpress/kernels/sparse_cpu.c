/* Attention of a few query rows over a selected subset of stored slots on CPU (a read view's decode step), one
 * call per layer: each selected key and value row is read in place from the cache (fp32, bf16 or fp16, converted
 * in registers), so no gathered copy of the selection is written. Work items are (head, split of the selection);
 * each leaves its online-softmax partial (max, sum, accumulator), and the call returns them merged. Built on first
 * use by kvpress/kernels/sparse_native.py; the torch reference with the same inputs is
 * `sparse_attention_state_reference` in sparse_attention.py.
 *
 * Inputs: keys/values [B, Hkv, T, D] given by strides in elements (a flat store shared by every head: strides 0),
 * positions [B, Hkv, T] int32 by strides, indices [BH, K] int64 slot numbers, ok uint8 [BH, K] or NULL (all real),
 * query rows fp32 [BH, M, D] (M = group x rows, row i at raw position q_pos[i % rows]). A slot is read by a row
 * when it is ok, its position <= the row's and, with a window, > the row's position - window. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "online_softmax.h"

#define BLOCK 64
#define MAX_DIM 1024

enum { F32 = 0, BF16 = 1, F16 = 2 };

/* The row at `offset` (elements) of `base` as fp32: the row itself for fp32, else converted into `buffer`. */
static inline const float *row_f32(const void *base, int dtype, int64_t offset, int64_t dim, float *buffer) {
    if (dtype == F32) return (const float *)base + offset;
    if (dtype == BF16) {
        const uint16_t *p = (const uint16_t *)base + offset;
        for (int64_t d = 0; d < dim; ++d) {
            uint32_t bits = (uint32_t)p[d] << 16;
            memcpy(buffer + d, &bits, sizeof bits);
        }
    } else {
        const _Float16 *p = (const _Float16 *)base + offset;
        for (int64_t d = 0; d < dim; ++d) buffer[d] = (float)p[d];
    }
    return buffer;
}

typedef struct {
    const void *keys, *values;
    int64_t k_stride[3], v_stride[3]; /* b, h, t */
    const int32_t *positions;
    int64_t p_stride[3];
    int dtype;
} store;

/* One work item: rows [M, D] of head (b, h) over indices[lo:hi]; writes m [M], l [M], acc [M, D]. */
static int attend_split(const store *s, int64_t b, int64_t h, const int64_t *indices, const uint8_t *ok,
                        int64_t lo, int64_t hi, const float *q, int64_t M, int64_t rows, const int64_t *q_pos,
                        int64_t D, float scaling, float softcap, int64_t window, float *m, float *l, float *acc) {
    float *logits = malloc(sizeof(float) * M * BLOCK);
    if (!logits) return 1;
    float kbuf[MAX_DIM], vbuf[MAX_DIM];
    for (int64_t i = 0; i < M; ++i) m[i] = -INFINITY, l[i] = 0.0f;
    memset(acc, 0, sizeof(float) * M * D);
    for (int64_t start = lo; start < hi; start += BLOCK) {
        const int64_t n = (hi - start < BLOCK) ? hi - start : BLOCK;
        for (int64_t j = 0; j < n; ++j) {
            const int64_t slot = indices[start + j];
            if (ok != NULL && !ok[start + j]) {  /* a padding entry: its slot number is not read */
                for (int64_t i = 0; i < M; ++i) logits[i * BLOCK + j] = -INFINITY;
                continue;
            }
            const int64_t pos = s->positions[b * s->p_stride[0] + h * s->p_stride[1] + slot * s->p_stride[2]];
            const float *k = row_f32(s->keys, s->dtype,
                                     b * s->k_stride[0] + h * s->k_stride[1] + slot * s->k_stride[2], D, kbuf);
            for (int64_t i = 0; i < M; ++i) {
                const int64_t qp = q_pos[i % rows];
                logits[i * BLOCK + j] = (pos <= qp && (window <= 0 || pos > qp - window))
                                            ? attention_logit(q + i * D, k, D, scaling, softcap) : -INFINITY;
            }
        }
        /* fold the block into each row's running max and sum; logits become probabilities under the new max */
        int any = 0;
        for (int64_t i = 0; i < M; ++i) {
            const float *row = logits + i * BLOCK;
            const float correction = fold_block(logits + i * BLOCK, n, m + i, l + i);
            for (int64_t j = 0; j < n && !any; ++j) any = row[j] != 0.0f;
            if (correction != 1.0f)
                for (int64_t d = 0; d < D; ++d) acc[i * D + d] *= correction;
        }
        if (!any) continue;
        for (int64_t j = 0; j < n; ++j) {  /* each value row read once, for every query row */
            const int64_t slot = indices[start + j];
            const float *v = NULL;
            for (int64_t i = 0; i < M; ++i) {
                const float p = logits[i * BLOCK + j];
                if (p == 0.0f) continue;
                if (v == NULL)
                    v = row_f32(s->values, s->dtype,
                                b * s->v_stride[0] + h * s->v_stride[1] + slot * s->v_stride[2], D, vbuf);
                float *a = acc + i * D;
                for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
            }
        }
    }
    free(logits);
    return 0;
}

/* The state m, l [B * Hkv, M], acc [B * Hkv, M, D] of every head: each (head, split) leaves its partial in the
 * work buffers, then each head's splits are merged. Returns nonzero when a work buffer failed. */
int sparse_attention(const void *keys, const void *values, int dtype, const int64_t *k_stride,
                     const int64_t *v_stride, const int32_t *positions, const int64_t *p_stride,
                     const int64_t *indices, const uint8_t *ok, int64_t K, const float *q, const int64_t *q_pos,
                     int64_t rows, int64_t M, int64_t D, int64_t batch, int64_t heads, float scaling, float softcap,
                     int64_t window, int64_t splits, int threads, float *m, float *l, float *acc) {
    if (D > MAX_DIM) return 2;
    store s = {keys, values, {k_stride[0], k_stride[1], k_stride[2]}, {v_stride[0], v_stride[1], v_stride[2]},
               positions, {p_stride[0], p_stride[1], p_stride[2]}, dtype};
    const int64_t items = batch * heads * splits;
    partials part;
    int failed = partials_alloc(&part, items, M, D);
    if (!failed) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(| : failed)
        for (int64_t item = 0; item < items; ++item) {
            const int64_t bh = item / splits;
            int64_t lo, hi;
            split_range(K, splits, item % splits, &lo, &hi);
            failed |= attend_split(&s, bh / heads, bh % heads, indices + bh * K, ok ? ok + bh * K : NULL, lo, hi,
                                   q + bh * M * D, M, rows, q_pos, D, scaling, softcap, window, part.m + item * M,
                                   part.l + item * M, part.acc + item * M * D);
        }
        if (!failed) merge_partials(part.m, part.l, part.acc, batch * heads, splits, M, D, m, l, acc);
        partials_free(&part);
    }
    return failed;
}

/* label_scores' work on slots t0..t1 of KV head kv, codes (bits < 16): every query head and row of the group at each
 * slot in turn, so the slot's best score stays in a register. */
static inline void label_scores_codes(const void *labels, const _Float16 *scale, const _Float16 *low,
                                      const int64_t row_bytes, int64_t capacity, const float *tables,
                                      const float *sums, int64_t rows, int64_t group, int64_t kv, int64_t t0,
                                      int64_t t1, int64_t T, float scaling, float *out) {
    for (int64_t t = t0; t < t1; ++t) {
        float best = -INFINITY;
        for (int64_t g = 0; g < group; ++g) {
            const int64_t h = kv * group + g;
            const uint8_t *row = (const uint8_t *)labels + (h * capacity + t) * row_bytes;
            const float s = (float)scale[h * capacity + t] * scaling, m = (float)low[h * capacity + t] * scaling;
            for (int64_t i = 0; i < rows; ++i) {
                const float *table = tables + (h * rows + i) * row_bytes * 256;
                float dot = 0.0f;
                for (int64_t j = 0; j < row_bytes; ++j) dot += table[j * 256 + row[j]];
                const float value = s * dot + m * sums[h * rows + i];
                best = value > best ? value : best;
            }
        }
        out[kv * T + t] = best;
    }
}

/* label_scores' work on slots t0..t1 of KV head kv, fp16 labels (bits 16). */
static void label_scores_f16(const void *labels, int64_t capacity, int64_t r, const float *q, int64_t rows,
                             int64_t group, int64_t kv, int64_t t0, int64_t t1, int64_t T, float scaling, float *out) {
    for (int64_t t = t0; t < t1; ++t) {
        float best = -INFINITY;
        for (int64_t g = 0; g < group; ++g) {
            const int64_t h = kv * group + g;
            const _Float16 *row = (const _Float16 *)labels + (h * capacity + t) * r;
            for (int64_t i = 0; i < rows; ++i) {
                const float *qi = q + (h * rows + i) * r;
                float dot = 0.0f;
                for (int64_t c = 0; c < r; ++c) dot += qi[c] * (float)row[c];
                best = dot * scaling > best ? dot * scaling : best;
            }
        }
        out[kv * T + t] = best;
    }
}

/* Double Sparsity's approximate scores from its packed label cache, read in place: out [BHkv, T] = scaling x the max,
 * over the KV head's `group` query heads h and `rows` query rows i, of q[h, i] . label[h, t], where label = code x
 * scale + min per (slot, query head) (bits 2, 4 or 8: codes uint8 [BHq, capacity, r * bits / 8], code c of byte j
 * is channel j * (8 / bits) + c, low bits first; fp16 scale and min [BHq, capacity]) or fp16 values [BHq, capacity,
 * r] (bits 16: scale and min NULL). Codes are never unpacked: for each query row, a table per byte position gives
 * that byte's share of q . code for all 256 byte values, so a slot's dot product is r * bits / 8 lookups, scaled
 * once: s (q . code) + min sum(q). */
int label_scores(const void *labels, const _Float16 *scale, const _Float16 *low, int bits, int64_t capacity,
                 int64_t T, int64_t r, const float *q, int64_t rows, int64_t group, int64_t kv_heads, float scaling,
                 float *out, int threads) {
    if (r > MAX_DIM) return 2;
    const int64_t row_bytes = bits == 16 ? 2 * r : r * bits / 8, chunk = 1024;
    const int64_t chunks = (T + chunk - 1) / chunk, heads = kv_heads * group;
    const int per_byte = bits == 16 ? 1 : 8 / bits, mask = bits == 16 ? 0 : (1 << bits) - 1;
    /* tables [heads, rows, row_bytes, 256] (bits < 16) and each row's sum(q) */
    float *tables = bits == 16 ? NULL : malloc(sizeof(float) * heads * rows * row_bytes * 256);
    float *sums = malloc(sizeof(float) * heads * rows);
    if ((bits != 16 && !tables) || !sums) {
        free(tables), free(sums);
        return 1;
    }
    for (int64_t hi = 0; hi < heads * rows; ++hi) {
        const float *qi = q + hi * r;
        float sum = 0.0f;
        for (int64_t c = 0; c < r; ++c) sum += qi[c];
        sums[hi] = sum;
        if (bits == 16) continue;
        for (int64_t j = 0; j < row_bytes; ++j)
            for (int byte = 0; byte < 256; ++byte) {
                float share = 0.0f;
                for (int c = 0; c < per_byte; ++c) share += qi[j * per_byte + c] * (float)((byte >> (bits * c)) & mask);
                tables[(hi * row_bytes + j) * 256 + byte] = share;
            }
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t item = 0; item < kv_heads * chunks; ++item) {
        const int64_t kv = item / chunks, t0 = (item % chunks) * chunk, t1 = t0 + chunk < T ? t0 + chunk : T;
        if (bits == 16) {
            label_scores_f16(labels, capacity, r, q, rows, group, kv, t0, t1, T, scaling, out);
        } else if (row_bytes == 4) {  /* the common shapes, with the byte loop's bound a constant */
            label_scores_codes(labels, scale, low, 4, capacity, tables, sums, rows, group, kv, t0, t1, T, scaling, out);
        } else if (row_bytes == 8) {
            label_scores_codes(labels, scale, low, 8, capacity, tables, sums, rows, group, kv, t0, t1, T, scaling, out);
        } else {
            label_scores_codes(labels, scale, low, row_bytes, capacity, tables, sums, rows, group, kv, t0, t1, T,
                               scaling, out);
        }
    }
    free(tables), free(sums);
    return 0;
}

/* The k-th largest of values[0:n] (k >= 1), by quickselect; `values` is reordered. */
static float kth_largest(float *values, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, target = k - 1;
    while (lo < hi) {
        const float pivot = values[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (values[i] > pivot) ++i;
            while (values[j] < pivot) --j;
            if (i <= j) {
                const float swap = values[i];
                values[i++] = values[j], values[j--] = swap;
            }
        }
        if (target <= j) hi = j;
        else if (target >= i) lo = i;
        else break;
    }
    return values[target];
}

/* A read view's selection from per-slot scores [BH, T]: in slot order, each head's real slots from `own_from` on
 * (the step's own tokens) and its `budget` highest-scoring other real slots with a finite score (ties: the older
 * slots). Writes the slot numbers to out [BH, budget + T - own_from] and each head's count to counts [BH]. */
int top_slots(const float *scores, const uint8_t *real, int64_t heads, int64_t T, int64_t budget, int64_t own_from,
              int64_t *out, int64_t *counts, int threads) {
    const int64_t width = budget + T - own_from;
    int failed = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(| : failed)
    for (int64_t h = 0; h < heads; ++h) {
        const float *s = scores + h * T;
        const uint8_t *r = real + h * T;
        float *candidates = malloc(sizeof(float) * (own_from > 0 ? own_from : 1));
        if (!candidates) {
            failed = 1;
            continue;
        }
        int64_t n = 0;
        for (int64_t t = 0; t < own_from; ++t)
            if (r[t] && s[t] > -INFINITY) candidates[n++] = s[t];
        /* take every candidate above the threshold, and as many equal to it (oldest first) as the budget allows */
        float threshold = -INFINITY;
        int64_t equal_left = n;
        if (n > budget && budget > 0) {
            threshold = kth_largest(candidates, n, budget);
            int64_t above = 0;
            for (int64_t t = 0; t < own_from; ++t) above += r[t] && s[t] > threshold;
            equal_left = budget - above;
        }
        int64_t count = 0;
        for (int64_t t = 0; t < T; ++t) {
            if (!r[t]) continue;
            int take = t >= own_from;
            if (!take && budget > 0 && s[t] > -INFINITY) {
                if (s[t] > threshold) take = 1;
                else if (s[t] == threshold && equal_left > 0) take = 1, --equal_left;
            }
            if (take) out[h * width + count++] = t;
        }
        counts[h] = count;
        free(candidates);
    }
    return failed;
}
