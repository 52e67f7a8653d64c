"""SubGen's streaming key clustering (Zandieh et al. 2024): keys arrive in order; each joins the nearest cluster
center within a radius delta, or opens a cluster of its own with itself as the center. A cluster keeps how many keys
joined it and a uniform sample of up to `t` of them (reservoir sampling, Algorithm R), from which the softmax
denominator of any later query is estimated: sum over clusters of count / sample size x sum over the sample of
exp(q . k). The estimate is unbiased for any partition; tight clusters make it precise.

The paper fixes delta and lets the number of clusters follow the data (m of them for (m, delta)-clusterable keys);
here memory is capped at `m` clusters, as a cache budget needs: once m clusters exist, a key farther than delta from
every center joins the nearest one anyway. Random numbers are a hash of (seed, token): a row's clusters depend on its
own keys and seed alone.

`cluster_keys` runs clusters_cpu.c (built by native.py) where a compiler works; `cluster_keys_reference` is the same
algorithm in torch and Python (the same clusters: distances are sums of squares in float64 in both)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .native import NativeLibrary

SOURCE = Path(__file__).with_name("clusters_cpu.c")
MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def uniform(seed: int, token: int) -> float:
    """A number in [0, 1) from (seed, token): splitmix64 hashes, as clusters_cpu.c computes them."""
    return (_mix((seed & MASK) ^ _mix(token)) >> 11) / 9007199254740992.0


def cluster_keys_reference(keys: torch.Tensor, m: int, t: int, delta: list[float], seeds: list[int]):
    """keys [H, n, d] -> (clusters opened [H], the cluster of each key [H, n], counts [H, m], reservoir [H, m, t]
    of token indices, -1 where empty)."""
    heads, n, _ = keys.shape
    x = keys.double()
    clusters, assign = torch.zeros(heads, dtype=torch.long), torch.zeros(heads, n, dtype=torch.long)
    counts, reservoir = torch.zeros(heads, m, dtype=torch.long), torch.full((heads, m, t), -1, dtype=torch.long)
    for h in range(heads):
        centers, sizes = [], [0] * m
        for i in range(n):
            gaps = (x[h, i] - x[h, centers]).square().sum(-1) if centers else None
            best = int(gaps.argmin()) if centers else -1
            if best < 0 or (float(gaps[best]) > delta[h] ** 2 and len(centers) < m):
                centers.append(i)
                best = len(centers) - 1
            assign[h, i] = best
            counts[h, best] += 1
            if sizes[best] < t:
                reservoir[h, best, sizes[best]] = i
                sizes[best] += 1
            elif (r := int(uniform(seeds[h], i) * int(counts[h, best]))) < t:
                reservoir[h, best, r] = i
        clusters[h] = len(centers)
    return clusters, assign, counts, reservoir


def _declare(library) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.cluster_keys.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr]
    library.cluster_keys.restype = None


_native = NativeLibrary(SOURCE, _declare, "the CPU key clustering",
                        "SubGen clusters keys in Python instead (same clusters, much slower)")


def available() -> bool:
    return _native.get() is not None


def cluster_keys(keys: torch.Tensor, m: int, t: int, delta: list[float], seeds: list[int]):
    """cluster_keys_reference's clusters, by clusters_cpu.c where it builds (m, t >= 1)."""
    if m < 1 or t < 1:
        raise ValueError(f"cluster_keys: m={m}, t={t}; allowed values: ints >= 1")
    if not available():
        return cluster_keys_reference(keys, m, t, delta, seeds)
    heads, n, d = keys.shape
    x = keys.detach().to("cpu", torch.float32).contiguous()
    radius = torch.tensor(delta, dtype=torch.float64)
    seed = torch.tensor([(s & MASK) - ((s & MASK) >> 63 << 64) for s in seeds], dtype=torch.int64)
    clusters, assign = torch.zeros(heads, dtype=torch.long), torch.zeros(heads, n, dtype=torch.long)
    counts, reservoir = torch.zeros(heads, m, dtype=torch.long), torch.full((heads, m, t), -1, dtype=torch.long)
    _native.get().cluster_keys(x.data_ptr(), heads, n, d, m, t, radius.data_ptr(), seed.data_ptr(), clusters.data_ptr(),
                          assign.data_ptr(), counts.data_ptr(), reservoir.data_ptr())
    return clusters, assign, counts, reservoir
