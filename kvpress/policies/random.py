from dataclasses import dataclass

import torch

from .base import Context, Needs, ScorerPolicy
from .registry import register


@register
@dataclass
class RandomPolicy(ScorerPolicy):
    """Keeps a uniformly random subset at prefill (baseline). Seeded per layer, so runs are repeatable."""

    name = "random"
    seed: int = 0

    def needs(self) -> Needs:
        return super().needs() | Needs(all_heads=True)  # the draw covers every head, each rank keeps its block

    def score(self, ctx: Context):
        generator = torch.Generator(device=ctx.keys.device).manual_seed(self.seed + ctx.layer_idx)
        batch, heads, length = ctx.keys.shape[:3]
        draw = torch.rand(batch, heads * ctx.shards.count, length, generator=generator, device=ctx.keys.device)
        return ctx.shards.local(draw)
