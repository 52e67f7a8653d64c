/* GEAR's terms on top of KIVI's codes, for lowbit_cpu.c: the arrays (gear_terms) and the out-of-line helpers both
 * of its splits call. */
#ifndef KVPRESS_GEAR_TERMS_H
#define KVPRESS_GEAR_TERMS_H

#include <stdint.h>
#include <string.h>

#include "lowbit_span.h"

/* GEAR's terms on top of the codes (NULL for KIVI): a rank-r correction per slot (its row factor against its
 * encoded chunk's basis) and exact outliers (keys: sparse (slot, channel, value) entries, slot -1 once evicted;
 * values: n_v channels per slot), each replacing the approximation at its entry. A split meets only its own
 * chunks (a head's slots run through its chunks in order): the queries times each one's key basis are computed
 * when it is met, and the values' low-rank part is summed per chunk met, so the work does not grow with the
 * chunks of other heads (a flat store's chunk list holds every run's). */
typedef struct {
    const _Float16 *k_lr, *v_lr;           /* [BH, T, rank] */
    const _Float16 *k_basis, *v_basis;     /* [BH, Nc, D, rank] */
    const int32_t *chunk;                  /* [BH, T] */
    const int32_t *k_out_slot, *k_out_chan; /* [BH, n_k]; flat codes: [n_k], every run's entries */
    const _Float16 *k_out_val;             /* [BH, n_k] */
    const int32_t *v_out_idx;              /* [BH, T, n_v] */
    const _Float16 *v_out_val;             /* [BH, T, n_v] */
    int64_t rank, n_chunks, n_k, n_v;
} gear_terms;

static inline float low_rank(const _Float16 *lr, const _Float16 *basis, int64_t rank) {
    float sum = 0.0f;
    for (int64_t k = 0; k < rank; ++k) sum += (float)lr[k] * (float)basis[k];
    return sum;
}

static inline float low_rank_f(const float *weights, const _Float16 *basis, int64_t rank) {
    float sum = 0.0f;
    for (int64_t k = 0; k < rank; ++k) sum += weights[k] * (float)basis[k];
    return sum;
}

/* GEAR's helpers are called per chunk, per outlier entry or once per split: kept out of line, so the copies
 * of the vectorised split do not each inline them (that tripled the build time) */
#define OUT_OF_LINE static __attribute__((noinline))

/* GEAR: query rows q [R, D] times a chunk's key basis [D, rank] -> qb [R, rank] */
OUT_OF_LINE void gear_query_basis(const float *q, const _Float16 *basis, int64_t rows, int64_t dim, int64_t rank,
                                  float *qb) {
    memset(qb, 0, sizeof(float) * rows * rank);
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 0; d < dim; ++d)
            for (int64_t k = 0; k < rank; ++k) qb[r * rank + k] += q[r * dim + d] * (float)basis[d * rank + k];
}

/* GEAR: each key outlier of the split's head in its slots [t0, t1): its exact value instead of the
 * approximation, in the logits p [R, n] of query rows q [R, D] */
OUT_OF_LINE void gear_key_outliers(const gear_terms *gear, span at, const uint8_t *k_codes, const _Float16 *k_scale,
                                   const _Float16 *k_min, const int32_t *groups, int64_t group, int64_t length,
                                   int64_t n_groups, int64_t dim, int bits, const float *q, int64_t rows, float scaling,
                                   float *p, int64_t n) {
    const int64_t dh = at.dh, rank = gear->rank, row_bytes = dim * bits / 8, per_byte = 8 / bits;
    for (int64_t i = at.e0; i < at.e1; ++i) {
        const int64_t e = at.entries ? at.entries[i] : i;
        const int64_t slot = gear->k_out_slot[e], chan = gear->k_out_chan[e];
        if (slot < at.t0 || slot >= at.t1) continue;
        const int byte = k_codes[(dh * length + slot) * row_bytes + chan / per_byte];
        const float stored = (float)((byte >> (bits * (chan % per_byte))) & ((1 << bits) - 1));
        const int64_t g = groups ? groups[slot] : slot / group, c = gear->chunk[dh * length + slot];
        const float approx = stored * (float)k_scale[(dh * n_groups + g) * dim + chan]
            + (float)k_min[(dh * n_groups + g) * dim + chan]
            + low_rank(gear->k_lr + (dh * length + slot) * rank,
                       gear->k_basis + ((dh * gear->n_chunks + c) * dim + chan) * rank, rank);
        const float delta = (float)gear->k_out_val[e] - approx;
        for (int64_t r = 0; r < rows; ++r)
            p[r * n + (slot - at.t0)] += q[r * dim + chan] * delta * scaling; /* -inf stays */
    }
}

/* GEAR: slot `at_slot` (dh * length + t) of chunk c, its codes unpacked in `code` [D] and its value groups'
 * scale/min: each value outlier's exact value instead of the approximation, under `weight`, into o [D] */
OUT_OF_LINE void gear_value_outliers(const gear_terms *gear, int64_t at_slot, int64_t dh, int64_t c,
                                     const float *code, const _Float16 *sc, const _Float16 *mn, int64_t width,
                                     int64_t dim, float weight, float *o) {
    const int64_t rank = gear->rank;
    const _Float16 *lr = gear->v_lr + at_slot * rank;
    for (int64_t e = 0; e < gear->n_v; ++e) {
        const int64_t at_v = at_slot * gear->n_v + e, d = gear->v_out_idx[at_v];
        const float approx = code[d] * (float)sc[d / width] + (float)mn[d / width]
            + low_rank(lr, gear->v_basis + ((dh * gear->n_chunks + c) * dim + d) * rank, rank);
        o[d] += weight * ((float)gear->v_out_val[at_v] - approx);
    }
}

/* GEAR: the values' low-rank part, per chunk met (the probabilities times its slots' row factors, by_chunk
 * [n_met, R, rank]) times the chunk's value basis, added to acc [R, D] */
OUT_OF_LINE void gear_value_low_rank(const gear_terms *gear, int64_t dh, const int64_t *met, int64_t n_met,
                                     const float *by_chunk, int64_t rows, int64_t dim, float *acc) {
    const int64_t rank = gear->rank;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 0; d < dim; ++d) {
            float sum = 0.0f;
            for (int64_t i = 0; i < n_met; ++i)
                sum += low_rank_f(by_chunk + (i * rows + r) * rank,
                                  gear->v_basis + ((dh * gear->n_chunks + met[i]) * dim + d) * rank, rank);
            acc[r * dim + d] += sum;
        }
}

#endif
