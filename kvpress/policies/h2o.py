from dataclasses import dataclass

import torch

from .context import Context
from .protocol import Needs
from .roles import DecodeEviction
from .scorer import ScorerPolicy
from .selection import last_slots
from .registry import register

_STATE = "h2o_accumulated_attention"


@register
@dataclass
class H2O(ScorerPolicy, DecodeEviction):
    """H2O (Zhang et al. 2023): keep the heavy hitters (highest attention accumulated over every query so far,
    summed over each GQA group, fp32) plus the `recent` newest tokens. Cuts the prompt to the budget at
    prefill (column sums computed in query chunks), then evicts at every decode step to hold the budget.
    `recent` defaults to half the budget (the paper's 1:1 heavy:recent split)."""

    name = "h2o"
    recent: int | None = None

    def validate(self) -> None:
        super().validate()
        if self.recent is not None and self.recent < 0:
            raise ValueError(f"h2o: recent={self.recent!r}; allowed values: an int >= 0")
        if self.budget is not None and self.recent is not None and self.budget < self.recent:
            raise ValueError(
                f"h2o: budget={self.budget} is smaller than recent={self.recent}; allowed values: budget >= recent"
            )

    def query_rows(self) -> int:
        return 0  # observe sums every row's attention as the rows pass

    def needs(self) -> Needs:
        return super().needs() | Needs(probabilities=True)

    def observe(self, ctx: Context) -> None:
        # Accumulate this forward's attention into the per-slot state the layer carries between steps.
        ctx.layer.add_state(_STATE, ctx.to_kv_heads(ctx.attention_column_sums(), "sum"))

    def score(self, ctx: Context):
        return ctx.layer.get_state(_STATE)

    def protected(self, ctx: Context, n_keep: torch.Tensor):
        recent = n_keep // 2 if self.recent is None else torch.full_like(n_keep, self.recent)
        return last_slots(ctx.layer, torch.minimum(recent, n_keep))
