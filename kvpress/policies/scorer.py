"""The scorer scheduler: a ScorerPolicy implements only a pure `score(ctx) -> [B, Hkv, T]` (higher = keep),
optionally `observe` and `protected(ctx, n_keep)`; this shared code turns scores into kept slots under the budget,
at prefill (each layer, each chunk) and while decoding (decode-time eviction, decode_budget, slack).

Prefill in one layer is two steps, both public so that a caller can score once and cut at several budgets:
  prefill_scores(ctx)   fix the layer's budget (start_budget), then score it
  cut(ctx, scores)      keep the best slots under the budget (a chunk: its share, earlier survivors kept), then
                        leave room for `slack`
cut_copy(ctx, scores) cuts a copy of the layer instead, leaving the scored layer as it is (evals/engine.py: one
prefill, one scoring per policy, one cut per ratio).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .budget import AllocatedBudgetPolicy
from .context import Context
from .roles import DecodeEviction
from .selection import chunk_share, evict_to_budget, keep_best, last_slots


@dataclass
class ScorerPolicy(AllocatedBudgetPolicy):
    """Scores every stored slot in each layer; shared code keeps the best `budget` per row and KV head (the options
    budget_allocation, decode_budget and slack: see AllocatedBudgetPolicy)."""

    def score(self, ctx: Context) -> torch.Tensor:
        """[B, Hkv, T] importance of each stored slot (higher = keep). Pure: state is updated by observe()."""
        raise NotImplementedError

    def protected(self, ctx: Context, n_keep: torch.Tensor) -> torch.Tensor | None:
        """[B, Hkv, T] slots kept whatever their score (at most n_keep per row/head)."""
        return None

    # ------------------------------------------------------------------ prefill
    def on_prefill(self, ctx: Context) -> None:
        self.cut(ctx, self.prefill_scores(ctx))

    def prefill_scores(self, ctx: Context) -> torch.Tensor:
        """Fix ctx.layer's budget (start_budget), then score it: the scores on_prefill cuts by (observe has run)."""
        self.start_budget(ctx)
        return self.score(ctx)

    def cut(self, ctx: Context, scores: torch.Tensor) -> None:
        """Keep the best slots of ctx.layer by `scores` under the budget start_budget fixed, as on_prefill does once
        it has scored: in a chunked prefill, this chunk's share of the budget with the slots kept from earlier
        chunks; then room for `slack` more tokens."""
        if ctx.prompt_tokens is None:
            self.compress(ctx, scores)
        else:
            share, earlier = chunk_share(ctx.layer, ctx.prompt_tokens, ctx.prompt_length, ctx.q_len, ctx.observers,
                                         self.kept_window)
            self.compress(ctx, scores, budget=share, keep=earlier)
        self.room_for_slack(ctx.layer)

    def cut_copy(self, ctx: Context, scores: torch.Tensor):
        """A copy of ctx.layer cut at this policy's budget by `scores` (prefill_scores of a policy that differs from
        this one at most in its budget, on the same layer), exactly as on_prefill would cut the layer itself; the
        layer is left as it is. Returns the cut copy (a KVPressLayer)."""
        own = dataclasses.replace(ctx, layer=ctx.layer.fork())
        self.start_budget(own)
        self.cut(own, scores)
        return own.layer

    # ------------------------------------------------------------------ decode
    def on_decode(self, ctx: Context) -> None:
        layer = ctx.layer
        stored = layer.view_width
        if self.decode_budget is not None:
            self.compress_generated(ctx)
        elif isinstance(self, DecodeEviction) and (budget := self.cut_budget(layer)) is not None:
            self.compress(ctx, self.score(ctx), budget=budget)
        if layer.view_width < stored:
            self.room_for_slack(layer)

    def room_for_slack(self, layer) -> None:
        """After a cut, room for exactly the next slack + 1 tokens: they append in place, and the bytes held stay
        at budget + slack + 1 slots (an append's own growth room would be 64 slots or more). A no-op with slack 0,
        which validate() requires of policies that never evict while decoding."""
        if self.slack:
            layer.reserve(self.slack + 1)

    def cut_budget(self, layer) -> torch.Tensor | None:
        """The budget [B] a decode step cuts each row to, or None when no row needs a cut. Slack 0: the row
        budget (compress keeps a row within it as it is). Slack k: the row budget for rows where some head holds
        more than budget + k real tokens, and no cut for the others (each row on its own schedule, as alone)."""
        if self.slack == 0:
            return layer.row_budget
        if layer.view_width <= int(layer.row_budget.min()) + self.slack:
            return None  # no head holds more slots than that, real or not: no per-slot count needed
        held = layer.key_valid().sum(-1).amax(-1)  # [B] the fullest head of each row
        budget = layer.row_budget.to(held)
        over = held > budget + self.slack
        return torch.where(over, budget, held) if bool(over.any()) else None

    def compress(self, ctx: Context, scores: torch.Tensor, budget: torch.Tensor | None = None,
                 keep: torch.Tensor | None = None) -> None:
        """Keep the best `budget` [B] slots per row and KV head (default: the layer's row budget); `keep`
        [B, Hkv, T] marks slots kept before any other (with the policy's own protected slots)."""

        def kept_first(n_keep):
            protected = self.protected(ctx, n_keep)
            return keep if protected is None else protected if keep is None else protected | keep

        layer = ctx.layer
        evict_to_budget(layer, scores, layer.row_budget if budget is None else budget, kept_first,
                        self.budget_allocation, self.head_floor, ctx.shards, ctx.observers)

    def score_from(self, ctx: Context, start: int) -> torch.Tensor:
        """score(ctx) of the view's slots from `start` (a segment boundary) on. A policy whose scores are stored
        per slot reads just those (decode_budget scores only the tail, where generated tokens sit)."""
        return self.score(ctx)[..., start:]

    def compress_generated(self, ctx: Context) -> None:
        """Hold generated tokens (position >= the prompt's end) to decode_budget; prompt slots stay. When they all
        sit in the layer's tail (normally), only the tail is looked at and the one token a step drops is evicted in
        place there: the cost of a step does not grow with the prompt's slots."""
        layer = ctx.layer
        if not (layer.generated_in_tail() and self._compress_generated(ctx, layer.tail_start())):
            self._compress_generated(ctx, 0)

    def _compress_generated(self, ctx: Context, start: int) -> bool:
        """compress_generated over the view's slots from `start` on, which hold every generated token. Returns
        False, changing nothing, when start > 0 and the eviction is not one slot per head in place."""
        layer = ctx.layer
        positions, valid = layer.key_positions(start), layer.key_valid(start)
        generated = valid & (positions >= layer.decode_start)
        n_generated = generated.sum(-1)
        if not bool((n_generated > self.decode_budget + self.slack).any()):
            return True
        budget = torch.minimum(n_generated, torch.full_like(n_generated, self.decode_budget))
        recent = last_slots(layer, budget - budget // 2, among=generated, positions=positions)
        prompt = valid & ~generated
        scores = self.score(ctx) if start == 0 else self.score_from(ctx, start)
        return keep_best(layer, scores, valid, prompt.sum(-1) + budget, prompt | recent, offset=start)
