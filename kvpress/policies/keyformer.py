from dataclasses import dataclass
from typing import ClassVar

import torch

from .context import Context
from .protocol import Needs
from .roles import DecodeEviction
from .scorer import ScorerPolicy
from .selection import last_slots
from .registry import register

_STATE = "keyformer_accumulated_score"


@register
@dataclass
class Keyformer(ScorerPolicy, DecodeEviction):
    """Keyformer (Adnan et al., MLSys 2024): keep a recent window plus the "key tokens" with the highest score
    accumulated over every query so far, where a query's score is a Gumbel softmax of its logits,
    softmax((x + G) / tau) with G i.i.d. Gumbel(0, 1), instead of its attention (summed over each GQA group, fp32).
    tau rises by `tau_delta` per decode step from `tau_init` at the prompt (step 0). The budget comes from the prompt
    (compression_ratio or budget, as every scorer here), and generated tokens compete for the same slots; the newest
    floor(recent_ratio * budget) slots are always kept.

    Differences from the official code (d-matrix-ai/keyformer-llm), each named:
    - The prompt is cut to the budget right after its own forward; the reference masks from the first decode step,
      which still reads the whole prompt once. Bytes are freed here; the reference only masks.
    - Scores are per row (the reference sums them over the batch; it runs batch 1).
    - The noise is a hash of (seed, layer, query head, the query's and the key's index in their row), so a run is
      repeatable and a left-padded row draws what it draws alone.
    - tau is scheduled per step (`tau_delta`, the configs' 0.01) rather than from max_new_tokens, which a cache
      policy does not know; the summarization script's tau_end 2 over n tokens is tau_delta = 1 / n.
    With noise=False, tau_init=1 and tau_delta=0 the score is H2O's accumulated attention."""

    name = "keyformer"
    # observe reads every stored key's logits with Python-sized blocks: not inside a captured step (cache/room.py)
    observe_captures: ClassVar[bool] = False
    recent_ratio: float = 0.3
    tau_init: float = 1.0
    tau_delta: float = 0.01
    noise: bool = True
    seed: int = 0

    def validate(self) -> None:
        super().validate()
        if not 0.0 <= self.recent_ratio <= 1.0:
            raise ValueError(f"keyformer: recent_ratio={self.recent_ratio!r}; allowed values: a float in [0, 1]")
        if not self.tau_init > 0:
            raise ValueError(f"keyformer: tau_init={self.tau_init!r}; allowed values: a float > 0")
        if not self.tau_delta >= 0:
            raise ValueError(f"keyformer: tau_delta={self.tau_delta!r}; allowed values: a float >= 0")

    def needs(self) -> Needs:
        return super().needs() | Needs(all_heads=True)  # the noise is drawn per query head, numbered model-wide

    def query_rows(self) -> int:
        return 0  # observe accumulates every row's score as the rows pass

    def observe(self, ctx: Context) -> None:
        sums = ctx.attention_column_sums(perturb=self._perturbation(ctx))
        ctx.layer.add_state(_STATE, ctx.to_kv_heads(sums, "sum"))

    def score(self, ctx: Context):
        return ctx.layer.get_state(_STATE)

    def protected(self, ctx: Context, n_keep: torch.Tensor):
        recent = torch.floor(n_keep.double() * self.recent_ratio).long()
        return last_slots(ctx.layer, recent)

    def temperature(self, ctx: Context) -> torch.Tensor:
        """[r] tau of each query row of this forward: tau_init at the prompt, + tau_delta per decode step."""
        positions = ctx.query_positions().float()
        if ctx.phase == "prefill":
            return torch.full_like(positions, self.tau_init)
        step = (positions - ctx.layer.decode_start + 1).clamp(min=0)
        return self.tau_init + step * self.tau_delta

    def _perturbation(self, ctx: Context):
        tau = self.temperature(ctx)
        if not self.noise and bool((tau == 1).all()):
            return None  # the attention itself (H2O's score)
        layer = ctx.layer
        padding = 0 if layer.padding is None else layer.padding.view(-1, 1)
        query_tokens = (ctx.query_positions()[None] - padding).int()  # [B or 1, r] index in the row
        key_codes = _mix32(layer.token_index().int() ^ _KEY_SALT)  # [B, Hkv, T]
        hkv, group = key_codes.shape[1], ctx.group_size
        # query heads numbered model-wide (a tensor-parallel rank holds a block of them)
        heads = ctx.shards.local(torch.arange(hkv * group * ctx.shards.count, device=key_codes.device), dim=0)
        head_codes = _mix32(_mix32(_mix32(heads.int()) ^ ctx.layer_idx) ^ (self.seed & 0x7FFFFFFF))
        head_codes = head_codes.view(1, hkv, group, 1)

        def perturb(logits: torch.Tensor, rows: slice, upto: int) -> None:
            if self.noise:
                row_codes = _mix32(head_codes ^ query_tokens[:, rows].reshape(-1, 1, 1, logits.shape[3]))
                u = _uniform(_mix32(row_codes[..., None] ^ key_codes[:, :, None, None, :upto]))
                logits.sub_(u.log_().neg_().log_())  # + Gumbel(0, 1) = -log(-log(u))
            logits.div_(tau[rows].view(1, 1, 1, -1, 1))

        return perturb


# The noise is a hash of (seed, layer, query head, query token, key token), one per logit: a prompt of 4K tokens
# draws 4K x 4K per query head and layer, so it is hashed in int32 (lowbias32, Wellons), not splitmix64 as
# policies/random.py draws one number per token: 3.6x faster here, and 24 bits are plenty for a Gumbel draw.
_KEY_SALT = 0x5BD1E995


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 over int32 (products wrap; shifts made logical by masking)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * -0x7B935975  # 0x846CA68B as int32
    return x ^ ((x >> 16) & 0xFFFF)


def _uniform(x: torch.Tensor) -> torch.Tensor:
    """fp32 in (0, 1) from the low 24 bits of int32 codes (never 0, so the Gumbel transform stays finite)."""
    return (x & 0xFFFFFF).float().mul_(2.0 ** -24).add_(2.0 ** -25)
