"""The names policies are built from, in one import (kvpress.policies.base keeps the path docs, tests and older code
use). Each lives in the module of its concept:
  protocol.py   Needs, ModelInfo, ModelPass, Policy (the hooks and declarations)
  context.py    Context (what a hook sees; Context.from_tensors builds one from plain tensors)
  roles.py      Codec, ReadView, DecodeEviction, StorageTier, Merger, Summarizer (what a policy is)
  params.py     HyperParameters, check_params (the one validation system of hyper-parameters)
  budget.py     BudgetPolicy, AllocatedBudgetPolicy (budgets, their allocation and decode-time options)
  scorer.py     ScorerPolicy (the scorer scheduler: scores -> kept slots at prefill and while decoding)
  selection.py  first_slots, last_slots, position_rank, select_kept, evict_to_budget, keep_best,
                evict_after_prompt, chunk_share (the selection helpers)
"""

from .budget import AllocatedBudgetPolicy, BudgetPolicy
from .context import Context
from .params import HyperParameters, check_params
from .protocol import ModelInfo, ModelPass, Needs, Policy
from .roles import Codec, DecodeEviction, Merger, ReadView, StorageTier, Summarizer
from .scorer import ScorerPolicy
from .selection import (chunk_share, evict_after_prompt, evict_to_budget, first_slots, keep_best, last_slots,
                        position_rank, select_kept)

__all__ = [
    "Needs", "ModelInfo", "ModelPass", "Policy", "Context", "Codec", "ReadView", "DecodeEviction",
    "StorageTier", "Merger", "Summarizer", "HyperParameters", "check_params", "BudgetPolicy", "AllocatedBudgetPolicy", "ScorerPolicy",
    "first_slots", "last_slots", "position_rank", "select_kept", "evict_to_budget", "keep_best",
    "evict_after_prompt", "chunk_share",
]
