"""Lookahead Q-Cache (Wang et al., EMNLP 2025, arXiv 2505.20334; policies.md 12.9): SnapKV judged by the queries
of the tokens the model is about to generate, not only by the prompt's last ones.

  stage 1   each layer's prompt is cut by SnapKV (its last `draft_window` queries vote, `kernel_size` pooling, the
            layer's budget): a cheap draft of the compressed cache
  lookahead the model greedily generates `lookahead` pseudo tokens over that draft: the first from the prompt's
            own next-token logits, each next one from a forward of those so far (`ModelPass.probe` reading the
            draft through a ReadView, so nothing is copied and nothing stays); a row stops at an end-of-sequence
            token, which is never fed
  stage 2   in every layer the observation rows are the prompt's last `window_size` queries plus the pseudo
            tokens' queries (from the draft-compressed model, as in the reference). Each row's attention over the
            whole prompt (the full cache: softmax over the prompt's slots only, each row seeing the keys its own
            position allows) is summed, pooled as SnapKV does, and the budget keeps the best slots plus the last
            `window_size` prompt slots. The pseudo tokens and the draft are then dropped: decoding starts from the
            prompt's own logits with the stage-2 cache.

Differences from the reference (KVCache-Factory's LAQ port, `select_KV_lookahead_stage` /
`select_KV_decoding_stage`):
  - the pseudo queries are those of the `lookahead` tokens fed (t1 .. tn); the port feeds t1 .. t(n-1) and keeps a
    rolling window of the last 16 queries (prompt and pseudo together); policies.md counts w2 + n_la rows, as here;
  - each observation row sees the prompt keys its true position allows (pitfall (a)): the port's triangular mask
    over the last 16 keys hides prompt keys from the real rows;
  - the stage-1 budget is each layer's own budget (pyramid / adaptive allocations: the layer's, split evenly over
    its heads); the reference uses one `lookahead_max_capacity`.
Cost: `lookahead` probe forwards of 1 .. n tokens over the prompt's cache (n(n+1)/2 token rows, 36 at n = 8), each
reading only the draft's slots, plus SnapKV's scoring twice. The prompt must come as token ids to a model with a
language-model head (the first pseudo token is the prompt's next token); a chunked prefill is refused (the
lookahead needs the whole prompt's cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .budget import AllocatedBudgetPolicy
from .context import Context
from .protocol import ModelPass, Needs
from .registry import register
from .roles import ReadView
from .selection import evict_to_budget, select_kept
from .snapkv import check_window_and_pooling, pooled_votes, window_slots
from .sparse import slots_of
from .params import tokens

_DRAFT = "laq draft"  # layer.policy_stats: [B, Hkv, T] the stage-1 kept slots, until after_prefill
_VOTES = "laq votes"  # layer.policy_stats: [B, Hq, T] the last window_size prompt rows' attention, summed


@register
@dataclass
class LookaheadQCache(AllocatedBudgetPolicy):
    name = "laq"
    lookahead: int = tokens(8)
    window_size: int = 8
    draft_window: int = 32
    kernel_size: int = 7
    pooling: str = "max"

    def validate(self) -> None:
        super().validate()
        check_window_and_pooling(self.name, self.window_size, self.kernel_size, self.pooling, self.budget)
        for param, low in (("lookahead", 0), ("draft_window", 1)):
            value = getattr(self, param)
            if value < low:
                raise ValueError(f"laq: {param}={value!r}; allowed values: an int >= {low}")
        if self.decode_budget is not None:
            raise ValueError(f"laq: decode_budget={self.decode_budget!r}: laq evicts once, after the prompt; "
                             f"allowed values: None")

    def for_model(self, model) -> "LookaheadQCache":
        # (a serving engine passes no transformers model: it refuses model-level passes itself, prompts.py)
        if self.lookahead and model.model is not None and model.model.get_output_embeddings() is None:
            raise ValueError(f"laq: lookahead={self.lookahead} generates pseudo tokens from the model's next-token "
                             f"logits, and {type(model.model).__name__} has no LM head; allowed values for this "
                             f"model: lookahead=0 (SnapKV), or patch the causal LM")
        return self

    def needs(self) -> Needs:
        return super().needs() | Needs(model_pass=True)

    @property
    def kept_window(self) -> int:
        return self.window_size

    def check_chunking(self, chunk_size: int) -> None:
        raise ValueError(f"prefill_chunk_size={chunk_size}: laq looks ahead from the whole prompt's cache, which a "
                         f"chunked prefill compresses before the prompt ends; allowed values: None")

    # -- per layer, after the prompt: the budget, the stage-1 draft and the prompt rows' votes (nothing evicted)
    def on_prefill(self, ctx: Context) -> None:
        self.start_budget(ctx)
        layer = ctx.layer
        valid = layer.key_valid()
        n_keep = torch.minimum(layer.row_budget[:, None].to(valid.device), valid.sum(-1))
        probs = ctx.attention_probs(last=min(max(self.draft_window, self.window_size), ctx.q_len))
        window = window_slots(layer, min(self.draft_window, ctx.q_len), n_keep)
        scores = pooled_votes(layer, probs[:, :, -self.draft_window:].sum(2), window, self.kernel_size, self.pooling)
        indices, ok = select_kept(scores, valid, n_keep, protected=window)
        layer.policy_stats[_DRAFT] = torch.zeros_like(valid).scatter_(-1, indices, ok)
        layer.policy_stats[_VOTES] = probs[:, :, -self.window_size:].sum(2)

    # -- the model-level hook
    def after_prefill(self, run: ModelPass) -> None:
        layers = run.layers()
        draft = DraftRead({i: layer.policy_stats.pop(_DRAFT) for i, layer in layers})
        votes = {i: layer.policy_stats.pop(_VOTES) for i, layer in layers}
        if self.lookahead:
            tokens, fed = self.pseudo_tokens(run, draft)
            self.add_pseudo_votes(run, draft, tokens, fed, votes)
        for i, layer in layers:
            window = min(self.window_size, layer.last_q_len)  # as SnapKV: the prompt forward's newest rows
            scores = pooled_votes(layer, votes[i], window_slots(layer, window), self.kernel_size, self.pooling)
            evict_to_budget(layer, scores, layer.row_budget, lambda n, l=layer, w=window: window_slots(l, w, n),
                            self.budget_allocation, self.head_floor, run.shards)

    def pseudo_tokens(self, run: ModelPass, draft: "DraftRead") -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [B, n], fed [B, n] bool): the greedy continuation over the stage-1 draft, and which of them are
        fed (a row's tokens before its first end-of-sequence token)."""
        if run.logits is None:
            raise ValueError(f"laq: lookahead={self.lookahead} generates from the prompt's next-token logits, which "
                             f"this forward did not return; allowed values: lookahead=0, or a forward that returns "
                             f"logits (return_dict=True)")
        tokens = run.logits.argmax(-1, keepdim=True)
        stop = _end_tokens(run.model)
        fed = ~torch.isin(tokens, stop)
        while tokens.shape[1] < self.lookahead and bool(fed[:, -1].any()):
            logits = run.probe(tokens, *self._probe_inputs(run, tokens.shape[1]), lambda ctx: None, view=draft)
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], 1)
            fed = torch.cat([fed, fed[:, -1:] & ~torch.isin(tokens[:, -1:], stop)], 1)
        return tokens, fed

    def add_pseudo_votes(self, run: ModelPass, draft: "DraftRead", tokens: torch.Tensor, fed: torch.Tensor,
                         votes: dict) -> None:
        """Add to each layer's `votes` [B, Hq, T] the attention of the fed pseudo tokens' queries (the model reading
        the draft) over the prompt's slots: softmax over those slots alone."""
        def on_layer(ctx: Context) -> None:
            prompt = votes[ctx.layer_idx].shape[-1]
            probs = ctx.attention_probs()[..., :prompt]  # [B, Hq, n, T]: the pseudo rows read each other too
            probs = probs / probs.sum(-1, keepdim=True).clamp(min=torch.finfo(probs.dtype).tiny)
            votes[ctx.layer_idx] += (probs * fed[:, None, :, None]).sum(2)

        run.probe(tokens, *self._probe_inputs(run, tokens.shape[1]), on_layer, view=draft)

    @staticmethod
    def _probe_inputs(run: ModelPass, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention_mask, position_ids) of `n` tokens fed right after the prompt."""
        batch, device = run.next_positions.shape[0], run.next_positions.device
        seen = run.cache.get_seq_length()
        before = torch.ones(batch, seen, dtype=torch.long, device=device) if run.attention_mask is None \
            else run.attention_mask.long()
        mask = torch.cat([before, torch.ones(batch, n, dtype=torch.long, device=device)], 1)
        return mask, run.next_positions[:, None] + torch.arange(n, device=device)


@dataclass
class DraftRead(ReadView):
    """LAQ's stage-1 cache as a read: each layer's SnapKV-kept prompt slots plus the probe's own tokens. Not
    registered: it lives for one after_prefill."""

    name = "laq draft"
    kept: dict = field(default_factory=dict, repr=False)  # layer_idx -> [B, Hkv, T] bool over the prompt's slots

    def select(self, ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
        kept = self.kept[ctx.layer_idx]
        prompt = kept.shape[-1]
        return slots_of(torch.cat([kept, ctx.layer.key_valid()[..., prompt:]], -1))


def _end_tokens(model) -> torch.Tensor:
    """The model's end-of-sequence token ids (its generation config's), as a tensor (empty: none)."""
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return torch.tensor(ids, dtype=torch.long, device=model.device)
