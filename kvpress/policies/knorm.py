from dataclasses import dataclass

from .base import Context, ScorerPolicy
from .registry import register


@register
@dataclass
class Knorm(ScorerPolicy):
    """Keeps the keys of smallest L2 norm (low-norm keys draw the most attention), at prefill."""

    name = "knorm"

    def query_rows(self) -> int:
        return 0  # keys alone

    def score(self, ctx: Context):
        return -ctx.keys.float().norm(dim=-1)
