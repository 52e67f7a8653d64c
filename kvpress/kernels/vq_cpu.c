// CommVQ's nearest-codeword search (kernels/vq_search.py): for each residual row, the code a * 64 + b minimising
// A[a] + B[b] + C[a][b] over the 64 x 64 codewords of one stage. C comes transposed (CT[b][a] = C[a][b]) so that the
// minimum over b of every a is one elementwise loop over a, which the compiler vectorises; then the best a, then its
// b by a scan. Each sum is the fp32 addition torch makes, and ties resolve to the lowest index as torch's argmin does.
#include <float.h>
#include <stdint.h>

#define ENTRIES 64

void vq_nearest(const float *a_term, const float *b_term, const float *pair_t, int64_t rows, int64_t *codes) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < rows; n++) {
        const float *A = a_term + n * ENTRIES, *B = b_term + n * ENTRIES;
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
        codes[n] = (int64_t)best_a * ENTRIES + best_b;
    }
}
