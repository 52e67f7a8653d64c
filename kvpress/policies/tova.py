from dataclasses import dataclass

from .context import Context
from .protocol import Needs
from .roles import DecodeEviction
from .scorer import ScorerPolicy
from .registry import register


@register
@dataclass
class TOVA(ScorerPolicy, DecodeEviction):
    """TOVA (Oren et al. 2024): keep the slots the last query attends to most, averaged over all query heads;
    one index set shared by every KV head. Trims the prompt at prefill, then evicts one token per step."""

    name = "tova"

    def query_rows(self) -> int:
        return 1  # the last query's attention

    def needs(self) -> Needs:
        # every step's probabilities come with its attention when every step evicts; with slack, the few steps
        # that cut compute them from the stored keys (Context.attention_probs), and the others read with sdpa
        return super().needs() | Needs(probabilities=self.slack == 0, all_heads=True)

    def score(self, ctx: Context):
        probs = ctx.attention_probs(last=1)[:, :, 0]  # [B, Hq, T]
        if ctx.shards.count == 1:
            mean = probs.mean(1, keepdim=True)
        else:  # every query head of the model, not only this rank's: one all-reduce of [B, 1, T]
            mean = ctx.shards.sum(probs.sum(1, keepdim=True)) / (probs.shape[1] * ctx.shards.count)
        return mean.expand(-1, ctx.keys.shape[1], -1)
