// SubGen's streaming key clustering (kernels/clusters.py holds the same algorithm in torch, and says what it does):
// keys arrive in order; each joins the nearest center if it lies within `delta` or if `m` clusters already exist,
// else it opens a cluster of its own (its key the center); a cluster keeps its count and a uniform reservoir of up
// to `t` member indices (Algorithm R). Random numbers are a hash of (seed, token), the same in clusters.py. Distances
// are sums of squares in double, so this and the torch reference take the same decisions.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static uint64_t mix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static double uniform(uint64_t seed, uint64_t a) {
    return (double)(mix(seed ^ mix(a)) >> 11) * (1.0 / 9007199254740992.0);
}

static double dist2(const float *x, const float *y, int64_t d) {
    double s = 0.0;
    for (int64_t k = 0; k < d; k++) {
        const double diff = (double)x[k] - (double)y[k];
        s += diff * diff;
    }
    return s;
}

// keys [H, n, d] fp32, delta [H]; per head h: the cluster of every key assign [H, n], counts [H, m], reservoir
// [H, m, t] (-1: empty), and how many clusters were opened, clusters [H]
void cluster_keys(const float *keys, int64_t heads, int64_t n, int64_t d, int64_t m, int64_t t, const double *delta,
                  const int64_t *seeds, int64_t *clusters, int64_t *assign, int64_t *counts, int64_t *reservoir) {
#pragma omp parallel for schedule(dynamic)
    for (int64_t h = 0; h < heads; h++) {
        const float *x = keys + h * n * d;
        const double radius2 = delta[h] * delta[h];
        const uint64_t seed = (uint64_t)seeds[h];
        int64_t *center = malloc((size_t)(m > 0 ? m : 1) * sizeof(int64_t));
        int64_t *count = counts + h * m, *res = reservoir + h * m * t, *size = calloc((size_t)(m > 0 ? m : 1), sizeof(int64_t));
        int64_t k = 0;
        for (int64_t c = 0; c < m * t; c++) res[c] = -1;
        for (int64_t c = 0; c < m; c++) count[c] = 0;
        for (int64_t i = 0; i < n; i++) {
            int64_t best = -1;
            double best_d = INFINITY;
            for (int64_t c = 0; c < k; c++) {
                const double dd = dist2(x + i * d, x + center[c] * d, d);
                if (dd < best_d) best_d = dd, best = c;
            }
            if (best < 0 || (best_d > radius2 && k < m)) center[k] = i, best = k++;
            assign[h * n + i] = best;
            count[best] += 1;
            if (size[best] < t) {
                res[best * t + size[best]++] = i;
            } else {
                const int64_t r = (int64_t)(uniform(seed, (uint64_t)i) * (double)count[best]);
                if (r < t) res[best * t + r] = i;
            }
        }
        clusters[h] = k;
        free(center), free(size);
    }
}
