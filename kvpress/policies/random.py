from dataclasses import dataclass

import torch

from .context import Context
from .protocol import Needs
from .scorer import ScorerPolicy
from .registry import register

_MASK_52 = (1 << 52) - 1


def uniform_hash(x: torch.Tensor) -> torch.Tensor:
    """A uniform number in [0, 1) per int64 entry of x (splitmix64's finaliser; int64 products wrap)."""
    x = x * -7046029254386353131  # 0x9E3779B97F4A7C15
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * -4658895280553007687  # 0xBF58476D1CE4E5B9
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * -7723592293110705685  # 0x94D049BB133111EB
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    return ((x >> 12) & _MASK_52).double().div_(float(1 << 52)).float()


@register
@dataclass
class RandomPolicy(ScorerPolicy):
    """Keeps a uniformly random subset at prefill (baseline). Each token's draw depends on (seed, layer, KV head,
    the token's index in its row) only: runs are repeatable, and a left-padded row or a chunk keeps what the row
    keeps alone or in one shot."""

    name = "random"
    seed: int = 0

    def query_rows(self) -> int:
        return 0

    def needs(self) -> Needs:
        return super().needs() | Needs(all_heads=True)  # each rank draws its own heads' block

    def score(self, ctx: Context):
        tokens = ctx.layer.token_index().long()  # [B, Hkv, T]: a left-padded row counts from its first real token
        every_head = torch.arange(tokens.shape[1] * ctx.shards.count, device=tokens.device)
        heads = ctx.shards.local(every_head, dim=0).view(1, -1, 1)  # this rank's KV heads, numbered model-wide
        key = ((self.seed * 1_000_003 + ctx.layer_idx) * 4099 + heads) * (1 << 40) + tokens
        return uniform_hash(key)
