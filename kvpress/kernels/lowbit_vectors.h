/* lowbit_cpu.c's vectorised split (included by it alone). */
#ifndef KVPRESS_LOWBIT_VECTORS_H
#define KVPRESS_LOWBIT_VECTORS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "gear_terms.h"
#include "lowbit_span.h"
#include "online_softmax.h"
#include "vectors16.h"

/* The common shapes, vectorised by hand (GCC/clang vector extensions, lowered to whatever the machine has):
 * head_dim 64 or 128, 2 or 4 bits, value groups of a multiple of 16 channels, `RB` <= 4 query rows per pass. A
 * code row is unpacked straight into channel order, 16 channels per vector; the rows' key weights and the value
 * accumulators stay in registers for the whole split. Same inputs and results as one_split, for rows
 * [r0, r0 + RB) of the item; GEAR's terms (with_gear, a constant in each copy) through the same helpers. */
#define MAX_VECTORS 8 /* head_dim 128 */
#define MAX_ROW_BLOCK 4

/* a code row of `dim` channels -> dim / 16 vectors of channels 16v .. 16v + 15. Code i of byte j is channel
 * j * (8 / bits) + i, so in a little-endian 32-bit word of the row channel c's code is bits [c * bits, (c + 1) *
 * bits) from the word's first channel: each lane shifts its word(s) by its own amount and masks. */
static inline __attribute__((always_inline)) void unpack_vectors(const uint8_t *row, const int dim, const int bits,
                                                                 v16f *out) {
    for (int chunk = 0; chunk < dim * bits / 128; ++chunk) { /* 4 words each */
        v4u w;
        memcpy(&w, row + 16 * chunk, sizeof w);
        if (bits == 4) { /* 16 channels in two words */
            const v16u shift = {0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28};
            for (int i = 0; i < 2; ++i) {
                const uint32_t a = w[2 * i], b = w[2 * i + 1];
                const v16u words = {a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b};
                out[2 * chunk + i] = __builtin_convertvector((v16i)((words >> shift) & 15), v16f);
            }
        } else { /* 2 bits: 16 channels in one word */
            const v16u shift = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
            for (int i = 0; i < 4; ++i) {
                const v16u word = {w[i], w[i], w[i], w[i], w[i], w[i], w[i], w[i], w[i], w[i], w[i], w[i], w[i],
                                   w[i], w[i], w[i]};
                out[4 * chunk + i] = __builtin_convertvector((v16i)((word >> shift) & 3), v16f);
            }
        }
    }
}

static inline __attribute__((always_inline)) void vector_rows(
    const uint8_t *k_codes, const _Float16 *k_scale, const _Float16 *k_min, const int32_t *k_group,
    const uint8_t *v_codes, const _Float16 *v_scale, const _Float16 *v_min, const float *query,
    const uint8_t *allowed, float scaling, float *m_out, float *l_out, float *acc_out, int64_t length,
    int64_t n_groups, const int dim, int64_t rows, int64_t r0, const int RB, int64_t group, int64_t n_chan,
    const int bits, span at, const gear_terms *gear, const int with_gear, float *p, int64_t *met) {
    const int nv = dim / 16;
    const int64_t row_bytes = dim * bits / 8, width = dim / n_chan;
    const int64_t dh = at.dh, qh = at.qh, t0 = at.t0, t1 = at.t1, n = t1 - t0;
    const int64_t rank = with_gear ? gear->rank : 0, n_chunks = with_gear ? gear->n_chunks : 0;
    const int32_t *groups = k_group ? k_group + dh * length : NULL;
    const uint8_t *allow = allowed ? allowed + (qh * rows + r0) * at.a_width : NULL; /* [RB, a_width] */
    const float *q = query + (qh * rows + r0) * dim;                              /* [RB, D] */
    /* GEAR: the current chunk's rows times its key basis (q_basis [RB, rank], scratch: only the vectors taken
     * from it are read) and, as in one_split, per chunk met the probabilities times the slots' row factors
     * (by_chunk [n, RB, rank], read by gear_value_low_rank) */
    float *q_basis = p + RB * n, *by_chunk = q_basis + n * RB * rank;
    int64_t n_met = 0;
    v4f q_basis_now[MAX_ROW_BLOCK];
    v16f code[MAX_VECTORS], w[MAX_ROW_BLOCK][MAX_VECTORS];
    float bias[MAX_ROW_BLOCK];
    int64_t current = -1;
    for (int64_t t = t0; t < t1; ++t) { /* logits [RB, n] */
        const int64_t g = groups ? groups[t] : t / group;
        if (g != current) { /* the key group's per-channel scales into the queries; its mins into a bias */
            const _Float16 *sc = k_scale + (dh * n_groups + g) * dim, *mn = k_min + (dh * n_groups + g) * dim;
            v16f scale[MAX_VECTORS], min[MAX_VECTORS];
            for (int v = 0; v < nv; ++v) scale[v] = load16_half(sc + 16 * v), min[v] = load16_half(mn + 16 * v);
            for (int r = 0; r < RB; ++r) {
                v16f b = {0};
                for (int v = 0; v < nv; ++v) {
                    const v16f qv = load16(q + r * dim + 16 * v);
                    w[r][v] = qv * scale[v];
                    b += qv * min[v];
                }
                bias[r] = sum16(b);
            }
            current = g;
        }
        unpack_vectors(k_codes + (dh * length + t) * row_bytes, dim, bits, code);
        if (with_gear && (n_met == 0 || met[n_met - 1] != gear->chunk[dh * length + t])) {
            const int64_t c = gear->chunk[dh * length + t];
            gear_query_basis(q, gear->k_basis + (dh * n_chunks + c) * dim * rank, RB, dim, rank, q_basis);
            for (int r = 0; r < RB; ++r) q_basis_now[r] = rank_vector(q_basis + r * rank, rank);
            met[n_met++] = c;
        }
        const v4f factors = with_gear ? rank_vector_half(gear->k_lr + (dh * length + t) * rank, rank) : (v4f){0};
        for (int r = 0; r < RB; ++r) {
            v16f dot = w[r][0] * code[0];
            for (int v = 1; v < nv; ++v) dot += w[r][v] * code[v];
            float logit = sum16(dot) + bias[r];
            if (with_gear) logit += sum4(q_basis_now[r] * factors);
            const int ok = allow == NULL || allow[r * at.a_width + (t - at.a0)];
            p[r * n + (t - t0)] = ok ? logit * scaling : -INFINITY;
        }
    }
    if (with_gear)
        gear_key_outliers(gear, at, k_codes, k_scale, k_min, groups, group, length, n_groups, dim, bits, q, RB,
                          scaling, p, n);
    start_rows(p, RB, n, m_out + r0, l_out + r0);
    /* values under the probabilities: each slot's codes times its groups' scales, then weighted per row; the
     * mins' part summed per (row, group) and spread over the group's channels at the end; GEAR's value
     * outliers into their own [RB, D] */
    v16f acc[MAX_ROW_BLOCK][MAX_VECTORS];
    float low[MAX_ROW_BLOCK][MAX_VECTORS], outliers[MAX_ROW_BLOCK][16 * MAX_VECTORS];
    for (int r = 0; r < RB; ++r)
        for (int v = 0; v < nv; ++v) acc[r][v] = (v16f){0}, low[r][v] = 0.0f;
    if (with_gear) memset(outliers, 0, sizeof outliers);
    int64_t at_chunk = -1; /* which chunk met the slot belongs to (the same walk through the slots) */
    v4f by_chunk_now[MAX_ROW_BLOCK]; /* the current chunk's part of by_chunk, in registers until the chunk ends */
    for (int64_t t = t0; t < t1; ++t) {
        if (with_gear && (at_chunk < 0 || met[at_chunk] != gear->chunk[dh * length + t])) {
            if (at_chunk >= 0)
                for (int r = 0; r < RB; ++r)
                    memcpy(by_chunk + (at_chunk * RB + r) * rank, &by_chunk_now[r], sizeof(float) * rank);
            ++at_chunk;
            for (int r = 0; r < RB; ++r) by_chunk_now[r] = (v4f){0};
        }
        float weight[MAX_ROW_BLOCK];
        int any = 0;
        for (int r = 0; r < RB; ++r) weight[r] = p[r * n + (t - t0)], any |= weight[r] != 0.0f;
        if (!any) continue; /* masked for every row */
        unpack_vectors(v_codes + (dh * length + t) * row_bytes, dim, bits, code);
        const _Float16 *sc = v_scale + (dh * length + t) * n_chan, *mn = v_min + (dh * length + t) * n_chan;
        for (int v = 0; v < nv; ++v) {
            const int64_t c = 16 * v / width;
            const v16f scaled = code[v] * (float)sc[c];
            const float min = (float)mn[c];
            for (int r = 0; r < RB; ++r) {
                acc[r][v] += weight[r] * scaled;
                if (16 * v % width == 0) low[r][c] += weight[r] * min; /* once per group */
            }
        }
        if (with_gear) {
            float unpacked[16 * MAX_VECTORS]; /* the value outliers' codes, read by channel */
            if (gear->n_v) memcpy(unpacked, code, sizeof(float) * dim);
            const v4f factors = rank_vector_half(gear->v_lr + (dh * length + t) * rank, rank);
            for (int r = 0; r < RB; ++r) {
                by_chunk_now[r] += weight[r] * factors;
                if (gear->n_v && weight[r] != 0.0f)
                    gear_value_outliers(gear, dh * length + t, dh, met[at_chunk], unpacked, sc, mn, width, dim,
                                        weight[r], outliers[r]);
            }
        }
    }
    if (with_gear && at_chunk >= 0)
        for (int r = 0; r < RB; ++r)
            memcpy(by_chunk + (at_chunk * RB + r) * rank, &by_chunk_now[r], sizeof(float) * rank);
    for (int r = 0; r < RB; ++r)
        for (int v = 0; v < nv; ++v) {
            v16f out = acc[r][v] + low[r][16 * v / width];
            if (with_gear) out += load16(outliers[r] + 16 * v);
            memcpy(acc_out + (r0 + r) * dim + 16 * v, &out, sizeof out);
        }
    if (with_gear) gear_value_low_rank(gear, dh, met, n_met, by_chunk, RB, dim, acc_out + r0 * dim);
}

#endif
