from dataclasses import dataclass

import torch

from .base import Context, ScorerPolicy
from .registry import register


@register
@dataclass
class RandomPolicy(ScorerPolicy):
    """Keeps a uniformly random subset at prefill (baseline). Seeded per layer, so runs are repeatable."""

    name = "random"
    seed: int = 0

    def score(self, ctx: Context):
        generator = torch.Generator(device=ctx.keys.device).manual_seed(self.seed + ctx.layer_idx)
        return torch.rand(ctx.keys.shape[:3], generator=generator, device=ctx.keys.device)
