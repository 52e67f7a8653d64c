"""LESS (Dong, Yang, Zhang, Wang, Chi, Chen, ICML 2024): H2O's eviction, plus a constant-size state into which every
evicted token is folded, so that it still contributes to attention.

Per layer and KV head, with phi / psi the learned feature maps of formats/less.py (fitted once per model by
`kvpress calibrate`, stored in its calibration file):
  - a token evicted from the cache (at the prompt's cut or by a decode step) is added, once, to H += psi(k) v^T and
    z += psi(k) (R x (D + 1) numbers per KV head, held in the layer's policy statistics and counted in its bytes);
  - every later read of a query q adds phi(q) H to the softmax numerator and phi(q) . z to its denominator, in the
    same online softmax as the kept tokens (Policy.prior_state):
        out = (sum_kept e^(s_j) v_j + phi(q) H) / (sum_kept e^(s_j) + phi(q) . z).
The prompt's own forward reads every token (the maps come in after the first cut, as the official generation code).

Differences from the official code (hdong920/LESS@0e0cf98, `LlamaAttentionLESS`, `train_kernels.py`), each named:
- The maps are fitted by a calibration (kvpress/less_fit.py: LESS's loss, a few hundred Adam steps per layer on the
  calibration texts), not 40 epochs over 512 C4 sequences; the hidden width is the head's (64 on SmolLM2) rather
  than 512, so the shipped file stays small. The fit reports its held-out loss against H2O alone.
- Grouped-query attention: phi is per query head, psi and the state per KV head (the official models have none).
- Eviction is kvpress's H2O (budget, `recent`), per KV head, with the state per row of a padded batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..formats.calibration import Calibration
from ..formats.less import key_features, summary_state
from ..heads import HeadShards
from .context import Context
from .h2o import H2O
from .protocol import ModelInfo
from .registry import register
from .roles import Summarizer

_H, _Z = "less H", "less z"  # layer.policy_stats: [B, Hkv, R, D] and [B, Hkv, R] fp32, the evicted tokens' sums


@register
@dataclass
class LESS(H2O, Summarizer):
    """LESS: H2O + the low-rank state of what it evicted (module docstring)."""

    name = "less"
    calibration: str | None = None  # the model's calibration file (None: the one beside its weights)
    maps: Calibration | None = field(default=None, repr=False, compare=False)

    def for_model(self, model: ModelInfo) -> "LESS":
        if self.maps is not None:
            return self
        calibration = Calibration.for_model(model, self.calibration)
        if calibration.less is None:
            raise ValueError(f"less: calibration={self.calibration!r} holds no LESS feature maps; allowed values: a "
                             f"file with them (`kvpress calibrate --model {model.folder or '<model>'} --less-only` adds "
                             f"them, minutes on a CPU)")
        return dataclasses.replace(self, maps=calibration)

    def _maps(self, ctx: Context) -> dict:
        """This layer's maps, for the heads this process holds (tensor parallelism holds a block of them)."""
        rank = self.maps.layers.index(ctx.layer_idx)
        held = {"q": ctx.query.shape[1], "k": ctx.layer.num_kv_heads}  # query maps per query head, the rest per KV head
        out = {}
        for name, tensor in self.maps.less.items():
            part = tensor[rank]
            out[name] = HeadShards.of(held.get(name[0], held["k"]), part.shape[0]).local(part, dim=0).to(ctx.query.device)
        return out

    def compress(self, ctx: Context, scores: torch.Tensor, budget: torch.Tensor | None = None,
                 keep: torch.Tensor | None = None) -> None:
        """H2O's cut, then every slot it evicted folded into the state (read before the cut: an in-place eviction
        overwrites its victim)."""
        layer = ctx.layer
        keys, values = layer.keys_view().clone(), layer.values_view().clone()
        positions, valid = layer.key_positions().long(), layer.key_valid()
        super().compress(ctx, scores, budget, keep)
        kept = torch.zeros(*valid.shape[:2], layer.seen + 1, dtype=torch.bool, device=valid.device)
        after = layer.key_positions().long()
        kept.scatter_(-1, after.masked_fill(~layer.key_valid(), layer.seen), True)
        evicted = valid & ~kept.gather(-1, positions.clamp(max=layer.seen))
        if bool(evicted.any()):
            psi = key_features(keys, self._maps(ctx)) * evicted[..., None]  # [B, Hkv, T, R]
            big_h = psi.transpose(-1, -2) @ values.float()
            z = psi.sum(2)
            stats = layer.policy_stats
            stats[_H] = stats[_H] + big_h if _H in stats else big_h
            stats[_Z] = stats[_Z] + z if _Z in stats else z

    def prior_state(self, ctx: Context):
        stats = ctx.layer.policy_stats
        if _Z not in stats:
            return None
        maps, big_h, z = self._maps(ctx), stats[_H], stats[_Z]
        return lambda queries: summary_state(queries.values, maps, big_h, z)

    @property
    def decode_change(self) -> str:
        return "evicts tokens while decoding and folds them into its low-rank state"
