/* Attention over bit-packed KIVI / GEAR codes on CPU, one call per layer: each packed row is unpacked (into
 * registers, or a small stack buffer for the generic shapes) and used at once (keys: dot products with the
 * scaled queries; values: accumulated under the probabilities), so no full-precision copy of the codes is ever
 * written to memory. Work items are (head, split of the slots) and each head's full-precision tail (the layer's
 * newest tokens); each leaves its online-softmax partial (max, sum, accumulator), and the call returns them
 * merged. GEAR's low-rank term and outliers enter in the same pass. The common shapes take the vectorised split
 * of lowbit_vectors.h, the others one_split below. Built on first use by
 * kvpress/kernels/lowbit_native.py; the torch reference with the same inputs is `codes_domain_attention_state`
 * in quant_attention.py.
 *
 * Layout (contiguous): codes uint8 [BH, T, D * bits / 8], channel j * (8 / bits) + i is code i of byte j (low
 * bits first); fp16 key scale/min [BH, Ng, D] (per channel, per key group of slots: slot / group, or the
 * slot's k_group), value scale/min [BH, T, C] (per slot, per group of channels); fp32 query rows [BH, R, D];
 * allowed uint8 [BH, R, T], or NULL: every slot. Flat codes (per-(row, head) runs of one store) are the same
 * arrays with one data head of all the runs' slots, each run read by its own (row, head)'s queries. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gear_terms.h"
#include "lowbit_span.h"
#include "lowbit_vectors.h"
#include "online_softmax.h"

#define MAX_DIM 1024

/* BITS is a constant in each instance, so the per-byte loop unrolls and the loop over bytes vectorises. */
#define DEFINE_UNPACK(BITS)                                                                                    \
    static inline void unpack_##BITS(const uint8_t *row, int64_t dim, float *out) {                            \
        for (int64_t j = 0; j < dim / (8 / BITS); ++j) {                                                       \
            const uint8_t byte = row[j];                                                                       \
            for (int i = 0; i < 8 / BITS; ++i)                                                                 \
                out[j * (8 / BITS) + i] = (float)((byte >> (BITS * i)) & ((1 << BITS) - 1));                   \
        }                                                                                                      \
    }
DEFINE_UNPACK(2)
DEFINE_UNPACK(4)
DEFINE_UNPACK(8)

static inline void unpack(const uint8_t *row, int bits, int64_t dim, float *out) {
    if (bits == 2) unpack_2(row, dim, out);
    else if (bits == 4) unpack_4(row, dim, out);
    else unpack_8(row, dim, out);
}

/* The full-precision rectangle after the codes (the layer's newest tokens) of head h, read in the same call:
 * keys/values [BH, stride, D] of which each head's first n slots are read (stride >= n: the filled prefix of a
 * buffer with spare room is read in place), query rows [BH, R, D], allowed [BH, R, n] or NULL. */
static void tail_split(const float *query, const float *keys, const float *values, const uint8_t *allowed,
                       float scaling, float *m_out, float *l_out, float *acc_out, int64_t n, int64_t stride,
                       int64_t dim, int64_t rows, int64_t h, float *p) {
    for (int64_t t = 0; t < n; ++t) {
        const float *k = keys + (h * stride + t) * dim;
        for (int64_t r = 0; r < rows; ++r) {
            const float *q = query + (h * rows + r) * dim;
            float dot = 0.0f;
            for (int64_t d = 0; d < dim; ++d) dot += q[d] * k[d];
            const int ok = allowed == NULL || allowed[(h * rows + r) * n + t];
            p[r * n + t] = ok ? dot * scaling : -INFINITY;
        }
    }
    start_rows(p, rows, n, m_out, l_out);
    memset(acc_out, 0, sizeof(float) * rows * dim);
    for (int64_t t = 0; t < n; ++t) {
        const float *v = values + (h * stride + t) * dim;
        for (int64_t r = 0; r < rows; ++r) {
            const float weight = p[r * n + t];
            float *o = acc_out + r * dim;
            for (int64_t d = 0; d < dim; ++d) o[d] += weight * v[d];
        }
    }
}

static void one_split(const uint8_t *k_codes, const _Float16 *k_scale, const _Float16 *k_min, const int32_t *k_group,
                      const uint8_t *v_codes, const _Float16 *v_scale, const _Float16 *v_min, const float *query,
                      const uint8_t *allowed, float scaling, float *m_out, float *l_out, float *acc_out,
                      int64_t length, int64_t n_groups, int64_t dim, int64_t rows, int64_t group, int64_t n_chan,
                      int bits, span at, const gear_terms *gear, float *p, int64_t *met) {
    float code[MAX_DIM];
    const int64_t rank = gear ? gear->rank : 0, n_chunks = gear ? gear->n_chunks : 0;
    const int64_t row_bytes = dim * bits / 8, width = dim / n_chan;
    const int64_t dh = at.dh, qh = at.qh, t0 = at.t0, t1 = at.t1, n = t1 - t0;
    const int32_t *groups = k_group ? k_group + dh * length : NULL; /* NULL: slot / group */
    const uint8_t *allow = allowed ? allowed + qh * rows * at.a_width : NULL; /* [R, a_width] */
    float *w = p + rows * (n + n_chan), *b = w + rows * dim; /* one key group's [R, D] weights and [R] bias */
    /* GEAR: the chunks met, in slot order ([n] at most), and per chunk met the query rows times its key basis
     * ([n, R, rank]) and the probabilities times the slots' row factors ([n, R, rank]) */
    float *q_basis = b + rows, *by_chunk = q_basis + n * rows * rank;
    int64_t n_met = 0;
    /* logits of the split's slots, [R, n]: the queries take each key group's per-channel scale and mins, once
     * per run of consecutive slots of one group */
    int64_t current = -1;
    for (int64_t t = t0; t < t1; ++t) {
        const int64_t g = groups ? groups[t] : t / group;
        if (g != current) {
            const _Float16 *sc = k_scale + (dh * n_groups + g) * dim, *mn = k_min + (dh * n_groups + g) * dim;
            for (int64_t r = 0; r < rows; ++r) {
                const float *q = query + (qh * rows + r) * dim;
                float bias = 0.0f;
                for (int64_t d = 0; d < dim; ++d) {
                    w[r * dim + d] = q[d] * (float)sc[d];
                    bias += q[d] * (float)mn[d];
                }
                b[r] = bias;
            }
            current = g;
        }
        unpack(k_codes + (dh * length + t) * row_bytes, bits, dim, code);
        if (gear && (n_met == 0 || met[n_met - 1] != gear->chunk[dh * length + t])) {
            const int64_t c = gear->chunk[dh * length + t];
            gear_query_basis(query + qh * rows * dim, gear->k_basis + (dh * n_chunks + c) * dim * rank, rows, dim,
                             rank, q_basis + n_met * rows * rank);
            met[n_met++] = c;
        }
        for (int64_t r = 0; r < rows; ++r) {
            const float *wr = w + r * dim;
            float dot = 0.0f;
            for (int64_t d = 0; d < dim; ++d) dot += wr[d] * code[d];
            if (gear) {
                const float *qb = q_basis + ((n_met - 1) * rows + r) * rank;
                const _Float16 *lr = gear->k_lr + (dh * length + t) * rank;
                for (int64_t k = 0; k < rank; ++k) dot += (float)lr[k] * qb[k];
            }
            const int ok = allow == NULL || allow[r * at.a_width + (t - at.a0)];
            p[r * n + (t - t0)] = ok ? (dot + b[r]) * scaling : -INFINITY;
        }
    }
    if (gear)
        gear_key_outliers(gear, at, k_codes, k_scale, k_min, groups, group, length, n_groups, dim, bits,
                          query + qh * rows * dim, rows, scaling, p, n);
    start_rows(p, rows, n, m_out, l_out);
    /* values under the probabilities; the mins' part per channel group, spread over its channels at the end */
    float *low = p + rows * n;  /* [R, C] */
    memset(acc_out, 0, sizeof(float) * rows * dim);
    memset(low, 0, sizeof(float) * rows * n_chan);
    memset(by_chunk, 0, sizeof(float) * n_met * rows * rank);
    int64_t at_chunk = -1; /* which chunk met the slot belongs to (the same walk through the slots) */
    for (int64_t t = t0; t < t1; ++t) {
        unpack(v_codes + (dh * length + t) * row_bytes, bits, dim, code);
        const _Float16 *sc = v_scale + (dh * length + t) * n_chan, *mn = v_min + (dh * length + t) * n_chan;
        if (gear && (at_chunk < 0 || met[at_chunk] != gear->chunk[dh * length + t])) ++at_chunk;
        for (int64_t r = 0; r < rows; ++r) {
            const float weight = p[r * n + (t - t0)];
            if (weight == 0.0f) continue;
            float *o = acc_out + r * dim;
            for (int64_t c = 0; c < n_chan; ++c) {
                const float a = weight * (float)sc[c];
                low[r * n_chan + c] += weight * (float)mn[c];
                for (int64_t d = c * width; d < (c + 1) * width; ++d) o[d] += a * code[d];
            }
            if (gear) {
                const _Float16 *lr = gear->v_lr + (dh * length + t) * rank;
                float *mine = by_chunk + (at_chunk * rows + r) * rank;
                for (int64_t k = 0; k < rank; ++k) mine[k] += weight * (float)lr[k];
                gear_value_outliers(gear, dh * length + t, dh, gear->chunk[dh * length + t], code, sc, mn, width, dim,
                                    weight, o);
            }
        }
    }
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 0; d < dim; ++d) acc_out[r * dim + d] += low[r * n_chan + d / width];
    if (gear) gear_value_low_rank(gear, dh, met, n_met, by_chunk, rows, dim, acc_out);
}

/* m/l [BH, R], acc [BH, R, D]: each head's online-softmax state over its codes and its full-precision tail
 * (n_tail slots of tail_stride per head), computed in work items of `splits` consecutive slot ranges of the
 * codes and one for the tail, whose partials are merged here. run_start / run_length [BH] (NULL: rectangular
 * codes [BH, length]): flat codes, one store of `length` slots in which head h's slots are run_length[h] slots
 * from run_start[h], its allowed columns [R, allowed_width] counted from there. k_group (NULL: slot / group)
 * gives each slot's key group. Returns 0, or -1 when a work buffer could not be allocated. */
int lowbit_attention(const uint8_t *k_codes, const _Float16 *k_scale, const _Float16 *k_min, const int32_t *k_group,
                     int64_t n_groups, const uint8_t *v_codes, const _Float16 *v_scale, const _Float16 *v_min,
                     const float *query, const uint8_t *allowed, float scaling, float *m_out, float *l_out,
                     float *acc_out, int64_t heads, int64_t length, int64_t dim, int64_t rows, int64_t group,
                     int64_t n_chan, int bits, int64_t splits, int threads, const int64_t *run_start,
                     const int64_t *run_length, int64_t allowed_width, const float *tail_keys,
                     const float *tail_values, const uint8_t *tail_allowed, int64_t n_tail, int64_t tail_stride,
                     const gear_terms *gear) {
    const int64_t items = heads * (splits + 1);
    /* vector_rows' shapes: head_dim 64 / 128, 2 / 4 bits, value groups of whole vectors */
    const int vector_fast = (dim == 64 || dim == 128) && (bits == 2 || bits == 4) && n_chan > 0
        && dim % n_chan == 0 && (dim / n_chan) % 16 == 0 && (gear == NULL || gear->rank <= MAX_RANK_VECTOR);
    const int64_t rank = gear ? gear->rank : 0, n_k = gear ? gear->n_k : 0;
    /* the work items' partials [BH, S + 1, R(, D)] */
    partials part;
    if (partials_alloc(&part, items, rows, dim)) return -1;
    float *m_part = part.m, *l_part = part.l, *acc_part = part.acc;
    int failed = 0;
    /* A flat store's key outliers come in flush order: list them run by run once (entries of run h are
     * entries[first[h]] .. entries[first[h + 1] - 1]), so each work item looks only through its own run's. */
    int64_t *entries = NULL, *first = NULL;
    if (run_start && n_k) {
        entries = malloc(sizeof(int64_t) * n_k);
        first = calloc(heads + 2, sizeof(int64_t));
        int64_t *owner = malloc(sizeof(int64_t) * n_k);
        if (entries == NULL || first == NULL || owner == NULL) {
            free(entries), free(first), free(owner), partials_free(&part);
            return -1;
        }
        for (int64_t e = 0; e < n_k; ++e) { /* the run holding its slot: the last one starting at or before it */
            const int64_t slot = gear->k_out_slot[e];
            int64_t lo = 0, hi = heads - 1;
            while (lo < hi) {
                const int64_t mid = (lo + hi + 1) / 2;
                if (run_start[mid] <= slot) lo = mid;
                else hi = mid - 1;
            }
            owner[e] = slot < 0 || heads == 0 || slot >= run_start[lo] + run_length[lo] ? -1 : lo;
            if (owner[e] >= 0) ++first[owner[e] + 2];
        }
        for (int64_t h = 0; h < heads; ++h) first[h + 2] += first[h + 1];
        for (int64_t e = 0; e < n_k; ++e) /* counting sort; first[h + 1] ends as the end of run h's entries */
            if (owner[e] >= 0) entries[first[owner[e] + 1]++] = e;
        free(owner);
    }
    /* every head's code splits first, then the (short) tails, handed out one at a time: threads stay balanced */
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(| : failed)
    for (int64_t order = 0; order < items; ++order) {
        const int64_t h = order < heads * splits ? order / splits : order - heads * splits;
        const int64_t s = order < heads * splits ? order % splits : splits;
        const int64_t item = h * (splits + 1) + s; /* where its partial goes */
        const int64_t start = run_start ? run_start[h] : 0, count = run_length ? run_length[h] : length;
        /* splits cut at whole key groups (of slot-ordered codes) */
        const int64_t per_split = (((count + group - 1) / group + splits - 1) / splits) * group;
        const int64_t lo = s * per_split < count ? s * per_split : count;
        const int64_t hi = lo + per_split < count ? lo + per_split : count;
        const span at = {run_start ? 0 : h, h, start + lo, start + hi, start, run_start ? allowed_width : length,
                         entries ? first[h] : h * n_k, entries ? first[h + 1] : (h + 1) * n_k, entries};
        const int64_t n = s < splits ? hi - lo : n_tail;
        /* probabilities [R, n], the values' mins [R, C], a key group's weights [R, D] and bias [R]; GEAR: two
         * [n, R, rank] arrays, and the chunks met [n] */
        float *p = malloc(sizeof(float) * rows * (n + n_chan + dim + 1 + 2 * n * rank));
        int64_t *met = rank ? malloc(sizeof(int64_t) * (n + 1)) : NULL;
        if (p == NULL || (rank && met == NULL)) {
            free(p);
            free(met);
            failed = 1;
            continue;
        }
        if (s < splits && vector_fast) {
            for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROW_BLOCK) {
#define ROWS(DIM, BITS, RB, GEAR)                                                                              \
    vector_rows(k_codes, k_scale, k_min, k_group, v_codes, v_scale, v_min, query, allowed, scaling,             \
                m_part + item * rows, l_part + item * rows, acc_part + item * rows * dim, length, n_groups, DIM,  \
                rows, r0, RB, group, n_chan, BITS, at, gear, GEAR, p, met)
#define BLOCK(DIM, BITS, GEAR)                                                                                 \
    switch (rows - r0 < MAX_ROW_BLOCK ? rows - r0 : MAX_ROW_BLOCK) {                                          \
    case 1: ROWS(DIM, BITS, 1, GEAR); break;                                                                   \
    case 2: ROWS(DIM, BITS, 2, GEAR); break;                                                                   \
    case 3: ROWS(DIM, BITS, 3, GEAR); break;                                                                   \
    default: ROWS(DIM, BITS, 4, GEAR);                                                                         \
    }
#define SHAPES(GEAR)                                                                                           \
    if (dim == 64 && bits == 4) BLOCK(64, 4, GEAR)                                                             \
    else if (dim == 64 && bits == 2) BLOCK(64, 2, GEAR)                                                        \
    else if (dim == 128 && bits == 4) BLOCK(128, 4, GEAR)                                                      \
    else BLOCK(128, 2, GEAR)
                if (gear) SHAPES(1)
                else SHAPES(0)
#undef SHAPES
#undef BLOCK
#undef ROWS
            }
        }
        else if (s < splits) {
            /* the generic split: any head_dim, 8 bits, narrow value groups, GEAR ranks above 4 */
            one_split(k_codes, k_scale, k_min, k_group, v_codes, v_scale, v_min, query, allowed, scaling,
                      m_part + item * rows, l_part + item * rows, acc_part + item * rows * dim, length, n_groups, dim,
                      rows, group, n_chan, bits, at, gear, p, met);
        }
        else
            tail_split(query, tail_keys, tail_values, tail_allowed, scaling, m_part + item * rows,
                       l_part + item * rows, acc_part + item * rows * dim, n_tail, tail_stride, dim, rows, h, p);
        free(p);
        free(met);
    }
    free(entries);
    free(first);
    if (!failed) merge_partials(m_part, l_part, acc_part, heads, splits + 1, rows, dim, m_out, l_out, acc_out);
    partials_free(&part);
    return failed ? -1 : 0;
}
