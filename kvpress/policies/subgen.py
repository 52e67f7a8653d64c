"""SubGen (Zandieh, Han, Mirrokni, Karbasi 2024): the prompt's attention estimated from a sublinear sketch instead of
every token. At the end of the prompt, each layer's prompt becomes one sketch (cache/sketch.py, which also reads it);
per row (its real tokens) and KV head, with B = the budget (slots per KV head):
  1. the first `n_sink` and the last `recent` tokens stay exact;
  2. the softmax denominator of the rest (the span, K = B - n_sink - recent slots of it): its keys, in order, are
     clustered by the streaming rule of kernels/clusters.py (join the nearest center within delta = `radius` x the
     keys' RMS distance to their mean, else open a cluster; at most m clusters), each cluster keeping its count and
     a uniform reservoir of `cluster_samples` keys;
  3. the numerator: s = floor(`sample_share` x K) draws of (key, value) pairs with probability |v|^2 / sum |v|^2,
     with replacement, and m = (K - s) / `cluster_samples` clusters;
  4. a read estimates softmax(q K^T) V as N / Z from those weighted samples; generated tokens are appended exact.
Bytes held: every sampled key, the values of exact and numerator slots only, two fp32 weights and a position each.

Differences from the paper (arXiv 2402.06082; no official code was found), each named:
- delta is a share of the keys' spread and the clusters are capped at m (a key farther than delta from every center
  joins the nearest once m exist), so the sketch fits the budget; the paper fixes delta and lets m follow the data.
- The sinks and a recent window stay exact (the paper's algorithm streams every token into the sketch).
- The sketch is built at the end of the prompt, and generated tokens stay exact (the paper streams them into it).
- The draws are seeded per (seed, layer, KV head), so a run is repeatable and a padded row draws what it draws alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..cache.sketch import Sketch, store
from ..kernels.clusters import cluster_keys
from .budget import BudgetPolicy
from .context import Context
from .protocol import Needs
from .registry import register
from .roles import StorageTier


@register
@dataclass
class SubGen(BudgetPolicy, StorageTier):
    """SubGen: clustered key samples for the softmax denominator, l2-sampled (key, value) pairs for the numerator
    (module docstring)."""

    name = "subgen"
    n_sink: int = 4
    recent: int = 64
    sample_share: float = 0.5
    cluster_samples: int = 4
    radius: float = 1.0
    seed: int = 0

    def validate(self) -> None:
        super().validate()
        for field, least in (("n_sink", 0), ("recent", 0), ("cluster_samples", 1)):
            if getattr(self, field) < least:
                raise ValueError(f"subgen: {field}={getattr(self, field)!r}; allowed values: an int >= {least}")
        if not 0.0 <= self.sample_share <= 1.0:
            raise ValueError(f"subgen: sample_share={self.sample_share!r}; allowed values: a float in [0, 1]")
        if not (self.radius >= 0 and math.isfinite(self.radius)):
            raise ValueError(f"subgen: radius={self.radius!r}; allowed values: a finite float >= 0")

    def query_rows(self) -> int:
        return 0

    def needs(self) -> Needs:
        return Needs(all_heads=True)  # each KV head's draws are seeded by its number model-wide (tensor parallelism)

    def check_chunking(self, chunk_size: int) -> None:
        raise ValueError(f"prefill_chunk_size={chunk_size}: subgen builds each layer's sketch from its whole prompt at "
                         f"once; allowed values: None")

    def on_prefill(self, ctx: Context) -> None:
        layer = ctx.layer
        keys, values, valid = layer.keys_view(), layer.values_view(), layer.key_valid()
        n_real = valid[:, 0].sum(-1)
        layer.row_budget = self.row_budget(n_real)
        layer.decode_start = layer.seen
        batch, heads = keys.shape[:2]
        first = ctx.shards.rank * heads  # this process's first KV head, model-wide
        slots = [[self._head(keys[b, h][valid[b, h]], values[b, h][valid[b, h]], int(layer.row_budget[b]),
                             self._seed(ctx.layer_idx, first + h)) for h in range(heads)] for b in range(batch)]
        positions = layer.key_positions()
        # A: slots with a value (exact, numerator samples), then B: cluster samples alone; each padded to the widest
        width_a = max(len(s[0]) for row in slots for s in row)
        width_b = max(len(s[2]) for row in slots for s in row)
        dim, device = keys.shape[-1], keys.device
        out_keys = keys.new_zeros(batch, heads, width_a + width_b, dim)
        out_values = values.new_zeros(batch, heads, width_a, values.shape[-1])
        num_weight = torch.zeros(batch, heads, width_a, device=device)
        den_weight = torch.zeros(batch, heads, width_a + width_b, device=device)
        out_positions = torch.zeros(batch, heads, width_a + width_b, dtype=torch.int32, device=device)
        out_valid = torch.zeros(batch, heads, width_a + width_b, dtype=torch.bool, device=device)
        for b in range(batch):
            real_positions = positions[b, 0][valid[b, 0]]
            real = torch.nonzero(valid[b, 0]).flatten()
            for h in range(heads):
                with_value, num_w, only_keys, den_w = slots[b][h]
                for start, chosen in ((0, with_value), (width_a, only_keys)):
                    at = slice(start, start + len(chosen))
                    out_keys[b, h, at] = keys[b, h, real[chosen]]
                    out_positions[b, h, at] = real_positions[chosen].to(torch.int32)
                    out_valid[b, h, at] = True
                out_values[b, h, :len(with_value)] = values[b, h, real[with_value]]
                num_weight[b, h, :len(with_value)] = num_w
                den_weight[b, h, :len(with_value)] = den_w[:len(with_value)]
                den_weight[b, h, width_a:width_a + len(only_keys)] = den_w[len(with_value):]
        store(layer, Sketch(out_keys, out_values, num_weight, den_weight), out_positions, out_valid)

    def _seed(self, layer_idx: int, head: int) -> int:
        return (self.seed * 1_000_003 + layer_idx) * 1_000_003 + head

    def _head(self, keys: torch.Tensor, values: torch.Tensor, budget: int, seed: int):
        """One row and KV head: keys / values [n, D] of its real tokens in position order -> (indices of the slots
        with a value, their numerator weights, indices of the cluster samples without one, the denominator weights
        of both lists in that order)."""
        n = keys.shape[0]
        sinks = min(self.n_sink, budget)
        recent = min(self.recent, budget - sinks, max(n - sinks, 0))
        span = torch.arange(sinks, n - recent)
        exact = torch.cat([torch.arange(sinks), torch.arange(n - recent, n)])
        room = budget - sinks - recent
        if span.numel() <= room:  # the span fits: nothing to estimate
            every = torch.arange(n)
            return every, torch.ones(n), every[:0], torch.ones(n)
        draws = math.floor(self.sample_share * room)
        rest = room - draws
        per_cluster = min(self.cluster_samples, rest)
        clusters = rest // per_cluster if per_cluster else 0
        den_tokens, den_w = span[:0], torch.zeros(0)
        if clusters:
            span_keys = keys[span].float()
            spread = (span_keys - span_keys.mean(0)).square().sum(-1).mean().sqrt()
            _, _, counts, reservoir = cluster_keys(span_keys[None], clusters, per_cluster,
                                                   [self.radius * float(spread)], [seed])
            counts, reservoir = counts[0], reservoir[0]
            sizes = (reservoir >= 0).sum(-1)
            taken = reservoir >= 0
            den_tokens = span[reservoir[taken]]
            den_w = (counts.double() / sizes.clamp(min=1))[:, None].expand_as(reservoir)[taken].float()
        num_tokens, num_w = span[:0], torch.zeros(0)
        norms = values[span].float().square().sum(-1).double()
        total = float(norms.sum())
        if draws and total > 0:
            generator = torch.Generator().manual_seed(seed)
            picks = torch.multinomial(norms / total, draws, replacement=True, generator=generator)
            unique, times = picks.unique(return_counts=True)
            num_tokens = span[unique]
            num_w = (times.double() * total / (draws * norms[unique])).float()
        # a token drawn for the numerator that is also a cluster sample: one slot with both weights
        den_of = dict(zip(den_tokens.tolist(), den_w.tolist()))
        with_value = torch.cat([exact, num_tokens])
        order = with_value.argsort()
        with_value = with_value[order]
        numerators = torch.cat([torch.ones(exact.numel()), num_w])[order]
        shared = set(num_tokens.tolist())
        denominators = [1.0 if i < exact.numel() else den_of.get(int(t), 0.0) for i, t in
                        zip(order.tolist(), with_value.tolist())]
        only_keys = torch.tensor(sorted(t for t in den_of if t not in shared), dtype=torch.long)
        denominators += [den_of[int(t)] for t in only_keys]
        return with_value, numerators, only_keys, torch.tensor(denominators)
