// CommVQ's encoder (kernels/vq_search.py). nearest_code: for one residual, the code a * 64 + b minimising
// A[a] + B[b] + C[a][b] over the 64 x 64 codewords of one stage. C comes transposed (CT[b][a] = C[a][b]) so that the
// minimum over b of every a is one elementwise loop over a, which the compiler vectorises; then the best a, then its
// b by a scan. Each sum is the fp32 addition torch makes, and ties resolve to the lowest index as torch's argmin does.
// vq_encode runs every stage of every group for a row in one call: the terms A, B, the search and the residual update
// (fp32, summed in its own order: a near tie may resolve differently from torch's complex matmul).
#include <float.h>
#include <stdint.h>

#define ENTRIES 64
#define MAX_PAIRS 64

static inline int64_t nearest_code(const float *A, const float *B, const float *pair_t) {
    float m[ENTRIES];
    for (int a = 0; a < ENTRIES; a++) m[a] = FLT_MAX;
    for (int b = 0; b < ENTRIES; b++) {
        const float bb = B[b], *row = pair_t + b * ENTRIES;
        for (int a = 0; a < ENTRIES; a++) {
            const float d = bb + row[a];
            m[a] = d < m[a] ? d : m[a];
        }
    }
    float best = FLT_MAX;
    int best_a = 0;
    for (int a = 0; a < ENTRIES; a++) {
        const float d = A[a] + m[a];
        if (d < best) {
            best = d;
            best_a = a;
        }
    }
    float low = FLT_MAX;
    int best_b = 0;
    for (int b = 0; b < ENTRIES; b++) {
        const float d = B[b] + pair_t[b * ENTRIES + best_a];
        if (d < low) {
            low = d;
            best_b = b;
        }
    }
    return (int64_t)best_a * ENTRIES + best_b;
}

void vq_nearest(const float *a_term, const float *b_term, const float *pair_t, int64_t rows, int64_t *codes) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < rows; n++) codes[n] = nearest_code(a_term + n * ENTRIES, b_term + n * ENTRIES, pair_t);
}

/* Greedy codes [N, G, S] of residuals re, im [N, G, P] (the unit vectors' pairs) over tables t_re, t_im [G, S, P, 64]
 * with their transposed pair terms pair_t [G, S, 64, 64]: per stage A[a] = -2 Re(conj(r) t_a), B[b] = -2 Re(conj(r)
 * i t_b), the nearest code, then r -= t_a + i t_b. Returns 2 when P exceeds MAX_PAIRS, else 0. */
int vq_encode(const float *re, const float *im, const float *t_re, const float *t_im, const float *pair_t, int64_t rows,
              int64_t groups, int64_t stages, int64_t pairs, int64_t *codes) {
    if (pairs > MAX_PAIRS) return 2;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < rows; n++)
        for (int64_t g = 0; g < groups; g++) {
            float r_re[MAX_PAIRS], r_im[MAX_PAIRS];
            for (int64_t p = 0; p < pairs; p++)
                r_re[p] = re[(n * groups + g) * pairs + p], r_im[p] = im[(n * groups + g) * pairs + p];
            for (int64_t s = 0; s < stages; s++) {
                const int64_t table = (g * stages + s) * pairs * ENTRIES;
                const float *tr = t_re + table, *ti = t_im + table;
                float A[ENTRIES] = {0}, B[ENTRIES] = {0};
                for (int64_t p = 0; p < pairs; p++) {
                    const float x = r_re[p], y = r_im[p], *row_re = tr + p * ENTRIES, *row_im = ti + p * ENTRIES;
                    for (int e = 0; e < ENTRIES; e++) {
                        A[e] += x * row_re[e] + y * row_im[e];  /* Re(conj(r) t) */
                        B[e] += x * row_im[e] - y * row_re[e];  /* Im(conj(r) t) = -Re(conj(r) i t) */
                    }
                }
                for (int e = 0; e < ENTRIES; e++) A[e] *= -2.0f, B[e] *= 2.0f;
                const int64_t code = nearest_code(A, B, pair_t + (g * stages + s) * ENTRIES * ENTRIES);
                codes[(n * groups + g) * stages + s] = code;
                const int64_t a = code / ENTRIES, b = code % ENTRIES;
                for (int64_t p = 0; p < pairs; p++) { /* t_a + i t_b = (re_a - im_b) + i (im_a + re_b) */
                    r_re[p] -= tr[p * ENTRIES + a] - ti[p * ENTRIES + b];
                    r_im[p] -= ti[p * ENTRIES + a] + tr[p * ENTRIES + b];
                }
            }
        }
    return 0;
}
