"""Double Sparsity's label channels (Yang et al. 2024, arXiv 2408.07092): which channels of a query head's q . k
carry most of it, calibrated once per model and stored in its calibration file (formats/calibration.py).

'qk' mode of the official offline calibration: per layer and query head, the mean over calibration tokens of
|q_c k_c| with q and k post-RoPE (the query's own position against its own key, the key of the head's GQA group), so
the ranking sees channels as attention reads them (the 'q' mode measures pre-RoPE queries but ranks post-RoPE
channels: RoPE mixes channel i with i + D/2). The texts are calibration.py's local texts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cache import KVPressCache
from .integrations.hf import with_cache
from .integrations.patching import patch_model
from .policies.context import Context
from .policies.protocol import Policy
from .progress import tracked


@dataclass
class _ChannelRecorder(Policy):
    """Evicts nothing; adds each prompt's sum over tokens of |q_c k_c| per (layer, query head, channel) to `sums`."""

    name = "none"
    sums: dict = field(default=None, repr=False, compare=False)

    def observe(self, ctx: Context) -> None:
        if ctx.phase != "prefill":
            return
        query = ctx.query.float()  # [B, Hq, T, D], post-RoPE
        keys = ctx.keys.float()[:, :, -ctx.q_len:].repeat_interleave(ctx.group_size, 1)  # each query head's keys
        total = (query * keys).abs().sum((0, 2)).cpu()  # [Hq, D]
        self.sums[ctx.layer_idx] = self.sums.get(ctx.layer_idx, 0) + total


def label_channels(model, texts: list, layers: list) -> torch.Tensor:
    """[L, Hq, D] each query head's channels by calibrated |q_c k_c|, most important first (ties: the lower channel),
    over `texts` (token id lists), for `layers` (the layers kvpress compresses, in order)."""
    sums: dict = {}
    device = next(model.parameters()).device
    with torch.no_grad(), patch_model(model, _ChannelRecorder(sums=sums)):
        for ids in tracked(texts, "channels", unit="text"):
            model(**with_cache(model, KVPressCache(model.config), input_ids=torch.tensor([ids], device=device),
                               use_cache=True, logits_to_keep=1))
    return torch.stack([sums[layer].argsort(dim=-1, descending=True, stable=True) for layer in layers])
