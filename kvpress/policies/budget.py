"""Budgets: how many tokens a policy keeps (BudgetPolicy), and how that budget is spread over layers and heads and
held while decoding (AllocatedBudgetPolicy: the options every scorer shares).

A budget is given as `compression_ratio` (fraction of the prompt removed, in [0, 1)) or as an absolute token
`budget` per layer, per KV head; each row's count comes from its own real prompt tokens (row_budget). It is fixed in
each layer at prefill (start_budget: `layer.row_budget`, and `layer.decode_start` where generated tokens begin).
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass
from typing import ClassVar

import torch

from .allocation import pyramid_budgets, validate_allocation, whole_pages
from .context import Context
from .protocol import Needs, Policy
from .roles import DecodeEviction
from .params import tokens


@dataclass
class BudgetPolicy(Policy):
    """A policy that evicts down to a budget, given as `compression_ratio` (fraction of the prompt removed,
    in [0, 1)) or as an absolute token `budget` per layer, per KV head."""

    compression_ratio: float | None = None
    budget: int | None = None
    needs_budget: ClassVar[bool] = True

    def validate(self) -> None:
        self.check_budget()

    def check_budget(self) -> None:
        """Exactly one of compression_ratio and budget, each in its range."""
        if (self.compression_ratio is None) == (self.budget is None):
            raise ValueError(
                f"{self.name}: give exactly one of compression_ratio (a float in [0, 1)) or budget (an int >= 1); "
                f"got compression_ratio={self.compression_ratio!r}, budget={self.budget!r}; allowed values: "
                f"compression_ratio alone, or budget alone"
            )
        if self.compression_ratio is not None and not (0.0 <= float(self.compression_ratio) < 1.0):
            raise ValueError(
                f"{self.name}: compression_ratio={self.compression_ratio!r} is outside the allowed range [0, 1)"
            )
        if self.budget is not None and self.budget < 1:  # its kind (an int) is checked from the annotation
            raise ValueError(f"{self.name}: budget={self.budget!r}; allowed values: an int >= 1")

    def row_budget(self, n_real: torch.Tensor) -> torch.Tensor:
        """Tokens each row may keep, from its count of real prompt tokens [B]: with a ratio r, N - ceil(N r), never
        a token over the declared ratio (NVIDIA kvpress keeps int(N (1 - r)), the same count), but at least one.
        (The 1e-9 keeps a product that is whole up to rounding, 100 x 0.07, from removing one token more.)"""
        if self.budget is not None:
            return torch.full_like(n_real, self.budget)
        removed = torch.ceil(n_real.double() * self.compression_ratio - 1e-9).long()
        return (n_real - removed).clamp(min=1)

    def paged_budget(self, prompt_length: int, page_size: int) -> int:
        """Tokens per KV head a paged engine keeps of a `prompt_length`-token prompt, and holds while decoding: the
        budget raised to whole evicted pages (allocation.whole_pages)."""
        n = torch.tensor([prompt_length])
        return int(whole_pages(self.row_budget(n), n, page_size))


@dataclass
class AllocatedBudgetPolicy(BudgetPolicy):
    """A budget fixed in each layer at prefill, spread over layers and heads, and held while decoding. Whether the
    policy then scores in each layer (ScorerPolicy) or once after the whole prompt (KVzip), these options mean the
    same:
      budget_allocation  'uniform' (same budget everywhere), 'pyramid' (PyramidKV: per layer, `pyramid_beta`),
                         'adaptive' (AdaKV: per head, one top-k over the layer, each head's floor `head_floor`
                         x the mean per-head budget); see allocation.py. Policies that score after the whole
                         prompt (model_pass) may also offer 'global': one top-k over every layer and head.
      decode_budget      tokens generated after the prompt that may stay (SCOPE-style): the prompt keeps its
                         prefill budget, generated tokens are cut to this budget at every decode step (the newest
                         half always stays, the rest by the policy's score at that step); None: no cap (or,
                         for policies that evict while decoding, one budget for prompt and output together)
      slack              tokens a layer may hold over its budget while decoding before it evicts: it then cuts
                         back to the budget in one step, by the scores of that step. 0 (the definition): one
                         eviction per generated token. k > 0: one per k + 1 tokens, at most budget + k tokens
                         held (bytes bounded), the eviction's fixed cost amortised over k + 1 steps
    """

    budget_allocation: str = "uniform"
    head_floor: float = 0.2
    pyramid_beta: float = 20.0
    decode_budget: int | None = None
    slack: int = tokens(0)
    allocations: ClassVar[tuple] = ("uniform", "pyramid", "adaptive")

    def validate(self) -> None:
        super().validate()
        validate_allocation(self.name, self.budget_allocation, self.head_floor, self.pyramid_beta, self.allocations)
        if self.decode_budget is not None and self.decode_budget < 1:  # kinds come from the annotations
            raise ValueError(f"{self.name}: decode_budget={self.decode_budget!r}; allowed values: None or an int >= 1")
        if self.slack < 0:
            raise ValueError(f"{self.name}: slack={self.slack!r}; allowed values: an int >= 0")
        if self.slack and not isinstance(self, DecodeEviction) and self.decode_budget is None:
            raise ValueError(f"{self.name}: slack={self.slack!r} has nothing to act on: {self.name} evicts only at "
                             f"prefill; allowed values: slack=0, or slack with decode_budget")

    @property
    def decode_change(self) -> str | None:
        if self.decode_budget is not None:
            return f"evicts generated tokens beyond decode_budget={self.decode_budget} while decoding"
        return super().decode_change

    @property
    def engine_refusal(self) -> str | None:
        if (refusal := super().engine_refusal) is not None:  # (the roles' and the protocol's first)
            if self.budget_allocation != "uniform" and "uniform" in self.allocations and \
                    not dataclasses.replace(self, budget_allocation="uniform").needs().model_pass:
                refusal += " (this policy decides layer by layer with budget_allocation='uniform')"
            return refusal
        if self.budget_allocation != "uniform":
            return (f"budget_allocation={self.budget_allocation!r} is not served by an engine yet (it keeps one "
                    f"page-aligned budget per request for every layer and head); allowed values: "
                    f"budget_allocation='uniform'")
        return None

    def _cuts_while_decoding(self) -> bool:
        return self.decode_budget is not None or (isinstance(self, DecodeEviction) and self.slack > 0)

    def paged_decode_cuts(self, prompt_length: int, page_size: int) -> tuple[int, int]:
        # slack=0 without decode_budget: a decode-time evictor's one token per step frees no page; the engine cuts
        # the prompt only and says so in its log (integrations/vllm configure)
        if not self._cuts_while_decoding():
            return 0, 0
        cut = self.slack + 1
        if cut % page_size:
            raise ValueError(f"{self.name}: slack={self.slack!r} evicts {cut} tokens per decode-time cut, which an "
                             f"engine of {page_size}-token pages cannot free as whole pages; allowed values: slack = "
                             f"k * {page_size} - 1 (e.g. {page_size - 1})")
        budget = self.paged_budget(prompt_length, page_size)  # the layer's row budget (layer_budget)
        if self.decode_budget is not None:  # the prompt keeps what its cut kept; generated tokens are held apart
            return cut, min(budget, prompt_length) + self.decode_budget
        return cut, budget

    @property
    def capture_refusal(self) -> str | None:
        if self.budget_allocation in ("adaptive", "global"):
            return (f"keeps different numbers of tokens per KV head (budget_allocation={self.budget_allocation!r}: "
                    f"flat runs), whose reads take their sizes from the data")
        if self.decode_budget is not None and self.slack < 1:
            return f"{self.decode_change}, at every step (slack=0)"
        return super().capture_refusal  # (the roles': an evictor while decoding says whether it cuts with slack)

    @property
    def kept_window(self) -> int:
        """Newest slots the policy always keeps (SnapKV's observation window): pyramid budgets ramp the rest."""
        return 0

    def layer_budget(self, ctx: Context) -> torch.Tensor:
        """[B] tokens per KV head this layer may keep, from the prompt's real token count."""
        n_real = ctx.prompt_tokens if ctx.prompt_tokens is not None else ctx.layer.key_valid()[:, 0].sum(-1)
        budget = self.row_budget(n_real.to(ctx.query.device))
        if self.budget_allocation == "pyramid" and ctx.budget_layer is not None:
            rank, n_layers = ctx.budget_layer
            budget = pyramid_budgets(budget, n_real, n_layers, self.kept_window, self.pyramid_beta)[rank]
        return whole_pages(budget, n_real, ctx.page_size)

    def start_budget(self, ctx: Context) -> None:
        """Fix this layer's budget at prefill and mark where generated tokens will begin."""
        ctx.layer.row_budget = self.layer_budget(ctx)
        ctx.layer.decode_start = ctx.layer.seen

    def needs(self) -> Needs:
        return Needs(all_heads=self.budget_allocation in ("adaptive", "global"))
