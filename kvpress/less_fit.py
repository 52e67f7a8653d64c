"""LESS's feature maps (Dong et al. 2024, arXiv 2402.09398), fitted once per model and stored in its calibration file
(formats/calibration.py), read by the less policy (policies/less.py; the maps themselves: formats/less.py).

For every layer kvpress compresses, the post-RoPE queries and keys, the values and the layer's output projection are
recorded over the calibration texts. Then, as the official `train_kernels.py`, per layer and with the model frozen:
  - each query row i reads exactly the tokens H2O keeps at that step (the heavy hitters by attention accumulated
    over the rows before it, plus the `recent` newest: `h2o_masks`), and through the maps every other token before it;
  - the loss is the mean squared error between o_proj of that output and o_proj of full attention, over the rows past
    the first heavy + recent (the official loss);
  - Adam, learning rate 1e-3, dropout 0.3 on the maps' hidden layer.
The official run trains 40 epochs over 512 C4 sequences per layer on a GPU; this one takes `steps` Adam steps over
the calibration texts (a CPU calibration), and reports the held-out loss beside H2O's alone (the maps set to zero).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.nn.functional import gelu

from .cache import KVPressCache
from .formats.less import key_features, query_features
from .integrations.hf import with_cache
from .integrations.patching import patch_model
from .policies.context import Context
from .policies.protocol import Policy
from .progress import tracked


@dataclass
class _Recorder(Policy):
    """Evicts nothing; keeps each layer's prompt queries, keys and values (fp32, on the CPU) in `sink`."""

    name = "none"
    sink: dict = field(default=None, repr=False, compare=False)

    def observe(self, ctx: Context) -> None:
        if ctx.phase == "prefill":
            self.sink.setdefault(ctx.layer_idx, []).append(
                (ctx.query[0].float().cpu(), ctx.keys[0].float().cpu(), ctx.values[0].float().cpu(), ctx.scaling))


def h2o_masks(logits: torch.Tensor, group: int, heavy: int, recent: int) -> torch.Tensor:
    """[Hkv, T, T] which tokens each query row reads exactly under H2O: the first heavy + recent rows read every token
    before them; after that row i reads the `heavy` tokens before i - recent with the most attention accumulated over
    the rows before it (summed over the KV head's query heads; a token once evicted stays out) and the recent window
    [i - recent, i]. logits: [Hq, T, T] causal (-inf above the diagonal)."""
    heads_q, length, _ = logits.shape
    probs = logits.softmax(-1).view(heads_q // group, group, length, length).sum(1)  # [Hkv, T, T]
    start = min(heavy + recent, length)
    keep = torch.zeros(heads_q // group, length, length, dtype=torch.bool)
    keep[:, :start, :start] = torch.ones(start, start, dtype=torch.bool).tril()
    score = probs[:, :start].sum(1)  # accumulated attention of the first rows
    alive = torch.ones(heads_q // group, length, dtype=torch.bool)
    for i in range(start, length):
        candidates = score[:, :i - recent].masked_fill(~alive[:, :i - recent], -1.0)
        chosen = candidates.topk(min(heavy, i - recent), -1).indices
        row = torch.zeros(heads_q // group, length, dtype=torch.bool)
        row.scatter_(-1, chosen, True)
        row[:, i - recent:i + 1] = True
        keep[:, i] = row
        alive[:, :i - recent] &= row[:, :i - recent]
        score = (score + probs[:, i]) * keep[:, i]
    return keep


class Maps(torch.nn.Module):
    """The trainable maps of one layer (formats/less.py names and initial scales, as the official code)."""

    def __init__(self, heads_q: int, heads_kv: int, dim: int, hidden: int, rank: int, dropout: float):
        super().__init__()

        def uniform(*shape, fan):
            bound = math.sqrt(6 / fan)
            return torch.nn.Parameter(torch.empty(*shape).uniform_(-bound, bound))

        self.q1, self.k1 = uniform(heads_q, dim, hidden, fan=dim + hidden), uniform(heads_kv, dim, hidden, fan=dim + hidden)
        self.q2, self.k2 = uniform(heads_q, hidden, rank, fan=hidden + rank), uniform(heads_kv, hidden, rank,
                                                                                     fan=hidden + rank)
        self.interaction = uniform(heads_kv, rank, rank, fan=2 * rank)
        self.scale1 = torch.nn.Parameter(torch.full((heads_kv, rank), 1e-4))
        self.scale2 = torch.nn.Parameter(torch.full((heads_kv, rank), 1e-4))
        self.dropout = torch.nn.Dropout(dropout)

    def features(self, q, k):
        """phi(q) [Hq, T, R], psi(k) [Hkv, T, R] with dropout on the hidden layers while training (formats/less.py
        computes the same maps without it)."""
        if not self.training:
            maps = self.tensors()
            return query_features(q[None], maps)[0], key_features(k[None], maps)[0]
        phi = gelu(torch.einsum("htm,hmr->htr", gelu(self.dropout(torch.einsum("htd,hdm->htm", q, self.q1))),
                                self.q2)).abs()
        u = self.scale1.abs()[:, None] * gelu(torch.einsum(
            "htm,hmr->htr", gelu(self.dropout(torch.einsum("htd,hdm->htm", k, self.k1))), self.k2))
        return phi, (u + torch.einsum("htr,hrs->hts", u, self.interaction) * self.scale2[:, None]).abs()

    def tensors(self) -> dict:
        return {name: getattr(self, name).detach() for name in ("q1", "q2", "k1", "k2", "interaction", "scale1",
                                                                 "scale2")}


def _example(q, k, v, scaling, group, heavy, recent):
    """What a text gives a layer's fit: logits masked to H2O's kept tokens, their log-sum-exp and normalised output,
    the mask of every other token before each row, and full attention's output (all [Hq, T, ...])."""
    length = q.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    logits = (q @ k.transpose(-1, -2) * scaling).masked_fill(~causal, float("-inf"))
    kept = h2o_masks(logits, group, heavy, recent).repeat_interleave(group, 0)
    sparse = logits.masked_fill(~kept, float("-inf"))
    return dict(lse=sparse.logsumexp(-1), sparse_out=sparse.softmax(-1) @ v, others=causal & ~kept,
                full=logits.softmax(-1) @ v, v=v)


def _predict(maps: Maps, q, k, example, group):
    """LESS's output [Hq, T, D] of one layer on one text: the kept tokens' softmax and the maps' sums over the rest
    under one normaliser (the official KernelizedHeadAttention.forward)."""
    phi, psi = maps.features(q, k)
    scores = (phi @ psi.repeat_interleave(group, 0).transpose(-1, -2)) * example["others"]  # [Hq, T, T]
    norm = torch.logaddexp(torch.log(scores.sum(-1) + 1e-6), example["lse"])
    return (scores @ example["v"]) * torch.exp(-norm)[..., None] + example["sparse_out"] * torch.exp(
        example["lse"] - norm)[..., None]


def fit_maps(model, texts: list, layers: list, heavy_ratio: float = 0.1, recent_ratio: float = 0.1, rank: int = 8,
             hidden: int | None = None, steps: int = 240, held_out: int = 1, seed: int = 0, log=print) -> dict:
    """{"maps": {name: [L, heads, ...]}, "held_out_loss": [L], "h2o_loss": [L]} over `texts` (token id lists, the
    last `held_out` kept apart), for `layers` (the layers kvpress compresses, in order)."""
    sink: dict = {}
    device = next(model.parameters()).device
    with torch.no_grad(), patch_model(model, _Recorder(sink=sink)):
        for ids in tracked(texts, "less: recording", unit="text"):
            model(**with_cache(model, KVPressCache(model.config), input_ids=torch.tensor([ids], device=device),
                               use_cache=True, logits_to_keep=1))
    modules = {m.layer_idx: m for m in model.modules() if hasattr(m, "o_proj") and hasattr(m, "layer_idx")}
    fitted, held, baseline = [], [], []
    for layer in tracked(layers, "less: fitting", unit="layer"):
        records = sink[layer]
        q0, k0, _, scaling = records[0]
        group = q0.shape[0] // k0.shape[0]
        width = hidden or q0.shape[-1]
        o_proj = modules[layer].o_proj
        examples = []
        with torch.no_grad():
            for q, k, v, scaling in records:
                length = q.shape[1]
                heavy, recent = max(1, int(heavy_ratio * length)), max(1, int(recent_ratio * length))
                examples.append((q, k, _example(q, k, v, scaling, group, heavy, recent), heavy + recent))
        torch.manual_seed(seed + layer)
        maps = Maps(q0.shape[0], k0.shape[0], q0.shape[-1], width, rank, 0.3)
        optimizer = torch.optim.Adam(maps.parameters(), lr=1e-3)
        train = examples[:-held_out] if held_out else examples

        def loss_of(q, k, example, start, predicted=None):
            out = _predict(maps, q, k, example, group) if predicted is None else predicted
            project = lambda x: torch.nn.functional.linear(  # noqa: E731  (the model's weights stay frozen)
                x.transpose(0, 1).flatten(1), o_proj.weight.detach().float(),
                None if o_proj.bias is None else o_proj.bias.detach().float())
            return torch.nn.functional.mse_loss(project(out)[start:], project(example["full"])[start:])

        with torch.enable_grad():
            maps.train()
            for step in range(steps):
                q, k, example, start = train[step % len(train)]
                loss = loss_of(q, k, example, start)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        maps.eval()
        with torch.no_grad():
            held.append(sum(float(loss_of(*e)) for e in examples[-held_out:]) / held_out if held_out else float("nan"))
            baseline.append(sum(float(loss_of(*e, predicted=e[2]["sparse_out"])) for e in examples[-held_out:])
                            / held_out if held_out else float("nan"))
        fitted.append(maps.tensors())
        log(f"  layer {layer}: held-out loss {held[-1]:.3g} (H2O alone {baseline[-1]:.3g})")
    return {"maps": {name: torch.stack([f[name] for f in fitted]) for name in fitted[0]},
            "held_out_loss": held, "h2o_loss": baseline}
