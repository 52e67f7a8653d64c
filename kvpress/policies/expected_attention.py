"""ExpectedAttention (NVIDIA kvpress, 2025): keep the keys that future queries are expected to attend to.

The queries seen so far are summarised per (row, query head) by the mean mu and covariance Sigma of their
PRE-RoPE vectors (the first `n_sink` real tokens skipped: their hidden states are outliers). Future queries sit
at the next `n_future_positions` positions; RoPE is linear, so their expected rotation is the average rotation
R_bar over those positions: mu' = R_bar mu, Sigma' = R_bar Sigma R_bar^T. For a Gaussian query, the log of
E[exp(s q.k)] is s mu'.k + s^2 k^T Sigma' k / 2 (s the attention scaling, 1/sqrt(D)); a softmax over the
stored keys after the first `n_sink` real slots (left out of the softmax, as in NVIDIA kvpress) gives the expected
attention per query head, averaged over each GQA group, times ||v|| (+ epsilon). The first n_sink real slots are
always kept.

The query statistics are running sums kept in the cache layer (`observe`: every prompt forward, and every decode
step when decode_budget will score them), so the same score serves prefill, each chunk of a chunked prefill, and
decode steps. Pre-RoPE queries come from the post-RoPE ones by the layer's own rotary embedding (declared need:
rotary), so QK-norm models (Qwen3, Gemma3) need nothing model-specific.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..positions import apply_rotary, rotate_half
from .context import Context
from .protocol import Needs
from .scorer import ScorerPolicy
from .selection import first_slots
from .registry import register
from .params import tokens

_COUNT, _REAL, _SUM, _OUTER = "ea_count", "ea_real_seen", "ea_query_sum", "ea_query_outer"


@register
@dataclass
class ExpectedAttention(ScorerPolicy):
    name = "expected_attention"
    n_future_positions: int = tokens(512)
    n_sink: int = 4
    # False, the best measured: on SmolLM2 (question in the prompt, n = 20 per task) 29.4 / 11.0 / 1.9 at 0.5 / 0.75
    # / 0.9 against 4.2 / 2.5 / 0.0 with the covariance term (docs/results/query_aware_new_smollm2_bf16). NVIDIA
    # kvpress's default is True: use_covariance=True gives its kept sets.
    use_covariance: bool = False
    use_vnorm: bool = True
    epsilon: float = 0.0

    def validate(self) -> None:
        super().validate()
        for field, low in (("n_future_positions", 1), ("n_sink", 0)):
            value = getattr(self, field)
            if value < low:
                raise ValueError(f"expected_attention: {field}={value!r}; allowed values: an int >= {low}")
        if self.epsilon < 0:
            raise ValueError(f"expected_attention: epsilon={self.epsilon!r}; allowed values: a number >= 0")

    def query_rows(self) -> int:
        return 1  # the last row's position (the statistics come from every row, through observe)

    def needs(self) -> Needs:
        return super().needs() | Needs(rotary=True)

    def observe(self, ctx: Context) -> None:
        """Add this forward's real, non-sink pre-RoPE queries to the layer's running statistics. After the prompt
        they are only read again to score generated tokens (decode_budget): without one, decode steps skip this."""
        if ctx.phase != "prefill" and self.decode_budget is None:
            return
        layer, stats = ctx.layer, ctx.layer.policy_stats
        q = ctx.pre_rope_query()  # [B, Hq, r, D] fp32
        batch, hq, rows, dim = q.shape
        real = layer.tail.view_valid(batch, layer.num_kv_heads, q.device)[:, 0, -rows:]  # [B, r] not padding
        before = stats.get(_REAL, torch.zeros(batch, dtype=torch.long, device=q.device))
        rank = before[:, None] + real.long().cumsum(-1) - 1  # rank of each row among the row's real tokens
        use = (real & (rank >= self.n_sink)).float()  # [B, r]
        q = q * use[:, None, :, None]
        stats[_REAL] = before + real.sum(-1)
        stats[_COUNT] = stats.get(_COUNT, 0) + use.sum(-1)
        stats[_SUM] = stats.get(_SUM, 0) + q.sum(2)
        if self.use_covariance:
            stats[_OUTER] = stats.get(_OUTER, 0) + torch.einsum("bhrd,bhre->bhde", q, q)
        layer.mark_changed()  # the statistics now hold these queries: a rollback cannot take them out

    def cut(self, ctx: Context, scores: torch.Tensor) -> None:
        super().cut(ctx, scores)
        # after the prompt's last chunk the statistics are read again only to score generated tokens (decode_budget);
        # without one they would be bytes the cache holds for nothing (and counts: layer.nbytes)
        if self.decode_budget is None and (ctx.prompt_length is None
                                           or ctx.layer.seen - ctx.observers >= ctx.prompt_length):
            for name in (_COUNT, _REAL, _SUM, _OUTER):
                ctx.layer.policy_stats.pop(name, None)

    def score(self, ctx: Context) -> torch.Tensor:
        layer, stats = ctx.layer, ctx.layer.policy_stats
        count = stats[_COUNT].clamp(min=1)[:, None, None]  # [B, 1, 1]
        mean = stats[_SUM] / count  # [B, Hq, D]
        # the average rotation over the next positions, as cos/sin means (RoPE is linear in cos and sin)
        start = ctx.query_rope_positions()[:, -1:] + 1  # [B, 1]
        future = start + torch.arange(self.n_future_positions, device=start.device)
        cos, sin = ctx.rotary.cos_sin(future, mean.new_empty(0))
        cos, sin = cos.float().mean(1, keepdim=True), sin.float().mean(1, keepdim=True)  # [B, 1, rot]
        mean = apply_rotary(mean[:, :, None], cos, sin)[:, :, 0]  # mu' [B, Hq, D]
        keys = ctx.keys.float()  # [B, Hkv, T, D]
        batch, hkv, length, dim = keys.shape
        group = mean.shape[1] // hkv
        mean = mean.view(batch, hkv, group, dim)
        logits = torch.einsum("bhgd,bhtd->bhgt", mean, keys) * ctx.scaling
        if self.use_covariance:
            cov = stats[_OUTER] / count[..., None] - torch.einsum("bhd,bhe->bhde", stats[_SUM] / count,
                                                                  stats[_SUM] / count)
            rotation = _rotation_matrix(cos[:, 0], sin[:, 0], dim)  # [B, D, D]
            cov = rotation[:, None] @ cov @ rotation[:, None].transpose(-1, -2)  # Sigma' [B, Hq, D, D]
            cov = cov.view(batch, hkv, group, dim, dim)
            logits = logits + torch.einsum("bhtd,bhgde,bhte->bhgt", keys, cov, keys) * ctx.scaling ** 2 / 2
        # The softmax runs over the keys after each row's first n_sink real tokens, as NVIDIA kvpress's does: the
        # sinks draw most of the attention, so inside the softmax they would scale every other key's expectation
        # by how much they draw from each query head. They score 0 here and are kept by protected().
        valid = layer.key_valid()
        scored = valid & ~first_slots(layer, torch.full(valid.shape[:2], self.n_sink, device=valid.device))
        probs = logits.masked_fill(~scored[:, :, None], float("-inf")).softmax(-1)
        probs = probs.nan_to_num(0.0).mean(2)  # [B, Hkv, T] (a head holding only sinks has nothing to score)
        if self.use_vnorm:
            probs = (probs + self.epsilon * scored) * ctx.values.float().norm(dim=-1)
        return probs

    def protected(self, ctx: Context, n_keep: torch.Tensor):
        return first_slots(ctx.layer, torch.clamp(n_keep, max=self.n_sink))


def _rotation_matrix(cos: torch.Tensor, sin: torch.Tensor, dim: int) -> torch.Tensor:
    """[B, D, D] matrix of x -> x cos + rotate_half(x) sin on the leading rot dims (cos/sin [B, rot]); identity on
    the rest (partial rotary)."""
    batch, rot = cos.shape
    eye = torch.eye(dim, device=cos.device)
    half = torch.zeros(dim, dim, device=cos.device)
    half[:rot, :rot] = rotate_half(torch.eye(rot, device=cos.device)).T  # rotate_half(x) = half @ x
    scale_cos = torch.ones(batch, dim, device=cos.device)
    scale_cos[:, :rot] = cos
    scale_sin = torch.zeros(batch, dim, device=cos.device)
    scale_sin[:, :rot] = sin
    return scale_cos[:, :, None] * eye + scale_sin[:, :, None] * half
