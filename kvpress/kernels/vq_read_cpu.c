/* Attention over CommVQ codes on CPU without a decoded copy of the cache (formats/commvq.py is the layout). Built
 * on first use by kvpress/kernels/vq_read.py, whose `vq_attention_state_reference` is the same computation in torch.
 *
 * Keys: a slot's unit key is the sum of its 2 S table rows per group (each stage's code is two 6-bit halves: row
 * s * 64 + a and row (S + s) * 64 + b of the decoder's weights, formats/commvq.bag_weights), rotated by RoPE at the
 * slot's RoPE position (cos/sin from a table by position: the codewords commute with RoPE) and scaled by its norm;
 * it lives in registers only, once per slot for every query row of its KV head.
 * Values: softmax(.) V = sum_j p_j n_j sum_rows W[row_j] = sum_rows (sum_j p_j n_j [row in row_j]) W[row], so each
 * query row accumulates p_j n_j into a histogram over the 2 S x 64 table rows per group (2 S additions per slot, no
 * value is decoded), and the histogram meets the table once, at the end of the work item.
 *
 * Inputs: codes uint8 [BH, T, code_bytes] (the key's G x Sk, then the value's G x Sv 12-bit codes, two per three
 * bytes), k_norm / v_norm fp16 [BH, T], rope int32 [BH, T], cos / sin fp32 [positions, D / 2], key weights fp32
 * [Hkv, G, 2 Sk 64, 2P] and value weights [Hkv, G, 2 Sv 64, 2P] (head bh % Hkv), queries fp32 [BH, M, D], allowed
 * uint8 [BH, M, T] or NULL (every row reads every slot). Work items are (head, split of the slots); each leaves its
 * online-softmax partial, merged before returning. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "online_softmax.h"

#define BLOCK 64
#define ENTRIES 64
#define MAX_DIM 1024

typedef struct {
    const uint8_t *codes;
    int64_t code_bytes, n_key_codes, n_codes;
    const _Float16 *k_norm, *v_norm;
    const int32_t *rope;
    const float *cos_table, *sin_table;
    const float *k_weights, *v_weights; /* this item's KV head's */
    int64_t groups, pairs, k_stages, v_stages;
} vq_store;

/* The slot's n_codes 12-bit codes (key codes first). */
static inline void unpack12(const uint8_t *packed, int64_t n, int32_t *out) {
    for (int64_t i = 0; i < n; i += 2) {
        const uint8_t *b = packed + 3 * (i / 2);
        out[i] = b[0] | ((b[1] & 0xF) << 8);
        if (i + 1 < n) out[i + 1] = (b[1] >> 4) | (b[2] << 4);
    }
}

/* x += a + b over n floats: two table rows. Not inlined: inlined into the loop over stages, GCC 12 vectorises
 * across stages with gathers (2x slower than plain vector loads of each contiguous row). */
static __attribute__((noinline)) void add_rows(float *restrict x, const float *restrict a, const float *restrict b,
                                               int64_t n) {
    for (int64_t d = 0; d < n; ++d) x[d] += a[d] + b[d];
}

/* key [D] (post-RoPE, times its norm) of slot t from its key codes. */
static void decode_key(const vq_store *s, int64_t t, const int32_t *codes, float *key) {
    const int64_t P = s->pairs, S = s->k_stages, half = s->groups * P, width = 2 * P;
    float part[MAX_DIM];
    for (int64_t g = 0; g < s->groups; ++g) {
        const float *w = s->k_weights + g * 2 * S * ENTRIES * width;
        float *x = part + g * width;
        memset(x, 0, sizeof(float) * width);
        for (int64_t st = 0; st < S; ++st) {
            const int32_t code = codes[g * S + st];
            add_rows(x, w + (st * ENTRIES + (code >> 6)) * width, w + ((S + st) * ENTRIES + (code & 63)) * width,
                     width);
        }
    }
    const float norm = (float)s->k_norm[t];
    const float *c = s->cos_table + (int64_t)s->rope[t] * half, *sn = s->sin_table + (int64_t)s->rope[t] * half;
    for (int64_t g = 0; g < s->groups; ++g)
        for (int64_t p = 0; p < P; ++p) {
            const int64_t i = g * P + p;
            const float re = part[g * width + p], im = part[g * width + P + p];
            key[i] = (re * c[i] - im * sn[i]) * norm;
            key[half + i] = (im * c[i] + re * sn[i]) * norm;
        }
}

/* One work item: rows q [M, D] of one head over its slots lo..hi; writes m [M], l [M], acc [M, D]. */
static int attend_split(const vq_store *s, const uint8_t *allowed, int64_t T, int64_t lo, int64_t hi, const float *q,
                        int64_t M, int64_t D, float scaling, float softcap, float *m, float *l, float *acc) {
    const int64_t P = s->pairs, width = 2 * P, bins = 2 * s->v_stages * ENTRIES, half = s->groups * P;
    float *logits = malloc(sizeof(float) * M * BLOCK);
    float *hist = calloc((size_t)(M * s->groups * bins), sizeof(float)); /* [M, G, bins] */
    int32_t *codes = malloc(sizeof(int32_t) * BLOCK * s->n_codes); /* the block's slots' codes; -1: not read */
    if (!logits || !hist || !codes) {
        free(logits), free(hist), free(codes);
        return 1;
    }
    float key[MAX_DIM];
    for (int64_t i = 0; i < M; ++i) m[i] = -INFINITY, l[i] = 0.0f;
    for (int64_t start = lo; start < hi; start += BLOCK) {
        const int64_t n = (hi - start < BLOCK) ? hi - start : BLOCK;
        for (int64_t j = 0; j < n; ++j) {
            const int64_t t = start + j;
            int any_row = allowed == NULL;
            for (int64_t i = 0; i < M && !any_row; ++i) any_row = allowed[i * T + t];
            if (!any_row) {  /* a filler or a future slot: its codes are not decoded */
                for (int64_t i = 0; i < M; ++i) logits[i * BLOCK + j] = -INFINITY;
                codes[j * s->n_codes] = -1;
                continue;
            }
            unpack12(s->codes + t * s->code_bytes, s->n_codes, codes + j * s->n_codes);
            decode_key(s, t, codes + j * s->n_codes, key);
            for (int64_t i = 0; i < M; ++i)
                logits[i * BLOCK + j] = (allowed == NULL || allowed[i * T + t])
                                            ? attention_logit(q + i * D, key, D, scaling, softcap) : -INFINITY;
        }
        /* fold the block into each row's running max and sum; logits become probabilities under the new max, and
         * the row's histogram is rescaled as an accumulator would be */
        for (int64_t i = 0; i < M; ++i) {
            const float correction = fold_block(logits + i * BLOCK, n, m + i, l + i);
            if (correction != 1.0f) {
                float *h = hist + i * s->groups * bins;
                for (int64_t b = 0; b < s->groups * bins; ++b) h[b] *= correction;
            }
        }
        for (int64_t j = 0; j < n; ++j) {  /* each slot's value codes into every row's histogram */
            if (codes[j * s->n_codes] < 0) continue;
            const int32_t *vc = codes + j * s->n_codes + s->n_key_codes;
            const float norm = (float)s->v_norm[start + j];
            for (int64_t i = 0; i < M; ++i) {
                const float w = logits[i * BLOCK + j] * norm;
                if (w == 0.0f) continue;
                float *h = hist + i * s->groups * bins;
                for (int64_t g = 0; g < s->groups; ++g, h += bins)
                    for (int64_t st = 0; st < s->v_stages; ++st) {
                        const int32_t code = vc[g * s->v_stages + st];
                        h[st * ENTRIES + (code >> 6)] += w;
                        h[(s->v_stages + st) * ENTRIES + (code & 63)] += w;
                    }
            }
        }
    }
    /* acc = histogram x table rows: real parts to the first half of D, imaginary parts to the second */
    float part[MAX_DIM];
    for (int64_t i = 0; i < M; ++i) {
        float *a = acc + i * D;
        const float *h = hist + i * s->groups * bins;
        for (int64_t g = 0; g < s->groups; ++g, h += bins) {
            const float *w = s->v_weights + g * bins * width;
            memset(part, 0, sizeof(float) * width);
            for (int64_t b = 0; b < bins; ++b) {
                const float c = h[b];
                if (c == 0.0f) continue;
                for (int64_t d = 0; d < width; ++d) part[d] += c * w[b * width + d];
            }
            for (int64_t p = 0; p < P; ++p) a[g * P + p] = part[p], a[half + g * P + p] = part[P + p];
        }
    }
    free(logits), free(hist), free(codes);
    return 0;
}

/* The state m, l [BH, M], acc [BH, M, D] of every head over its T slots. Returns 2 when D exceeds this file's
 * buffers, 1 when a work buffer could not be allocated, else 0. */
int vq_attention(const uint8_t *codes, int64_t code_bytes, const _Float16 *k_norm, const _Float16 *v_norm,
                 const int32_t *rope, const float *cos_table, const float *sin_table, const float *k_weights,
                 const float *v_weights, int64_t kv_heads, int64_t groups, int64_t pairs, int64_t k_stages,
                 int64_t v_stages, const float *q, const uint8_t *allowed, int64_t BH, int64_t T, int64_t M,
                 float scaling, float softcap, int64_t splits, int threads, float *m, float *l, float *acc) {
    const int64_t D = 2 * groups * pairs, n_codes = groups * (k_stages + v_stages);
    if (D > MAX_DIM) return 2;
    const int64_t k_head = groups * 2 * k_stages * ENTRIES * 2 * pairs;
    const int64_t v_head = groups * 2 * v_stages * ENTRIES * 2 * pairs;
    const int64_t items = BH * splits;
    partials part;
    int failed = partials_alloc(&part, items, M, D);
    if (!failed) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(| : failed)
        for (int64_t item = 0; item < items; ++item) {
            const int64_t bh = item / splits, head = bh % kv_heads;
            int64_t lo, hi;
            split_range(T, splits, item % splits, &lo, &hi);
            const vq_store s = {codes + bh * T * code_bytes, code_bytes, groups * k_stages, n_codes,
                                k_norm + bh * T, v_norm + bh * T, rope + bh * T, cos_table, sin_table,
                                k_weights + head * k_head, v_weights + head * v_head, groups, pairs, k_stages,
                                v_stages};
            failed |= attend_split(&s, allowed ? allowed + bh * M * T : NULL, T, lo, hi, q + bh * M * D, M, D,
                                   scaling, softcap, part.m + item * M, part.l + item * M, part.acc + item * M * D);
        }
        if (!failed) merge_partials(part.m, part.l, part.acc, BH, splits, M, D, m, l, acc);
        partials_free(&part);
    }
    return failed;
}
