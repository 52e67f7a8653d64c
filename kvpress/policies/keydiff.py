"""KeyDiff (Park et al. 2025, arXiv 2504.15364): keep the keys least like the others. A key's score is minus its
cosine similarity with the mean of its head's L2-normalised keys (the anchor): tokens whose keys point where
everyone's do carry little that attention can single out. No attention needed, so it scores at prefill, per
chunk of a chunked prefill, and at decode (decode_budget) alike. Padding and filler slots never enter the
anchor."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .context import Context
from .scorer import ScorerPolicy
from .registry import register


@register
@dataclass
class KeyDiff(ScorerPolicy):
    name = "keydiff"

    def query_rows(self) -> int:
        return 0  # keys alone

    def score(self, ctx: Context) -> torch.Tensor:
        keys = ctx.keys.float()
        valid = ctx.layer.key_valid()[..., None]
        unit = F.normalize(keys, dim=-1)
        anchor = (unit * valid).sum(2, keepdim=True) / valid.sum(2, keepdim=True).clamp(min=1)
        return -F.cosine_similarity(keys, anchor, dim=-1)
