"""CommVQ's codebooks (Li et al. 2025, arXiv 2506.18879), fitted once per model and stored in its calibration file
(formats/calibration.py), read by the commvq codec (policies/commvq.py).

For every layer kvpress compresses and every KV head, the pre-RoPE keys and the values of the calibration texts
(calibration.py's local texts) are recorded, divided by their norms, and one set of tables per head, group and stage
is fitted by formats/commvq.fit_tables. Differences from the official training (`training/quantize_key_cache.py`):
hard assignments (the paper's EM uses soft ones, annealing the temperature from 1e-3 to 1e-5); one norm per head
instead of one per token over all heads (a head's slots can then be evicted alone); and the values use the same
commutative tables as the keys, fitted the same way, where the paper trains a small encoder and decoder end to end
(gradient training through the model, not a job for a CPU calibration).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cache import KVPressCache
from .formats.commvq import fit_tables
from .integrations.hf import with_cache
from .integrations.patching import patch_model
from .policies.context import Context
from .policies.protocol import Needs, Policy
from .positions import unrotate

MAX_GROUP_PAIRS = 64  # RoPE pairs per group: 128 channels, the paper's group (a 64-channel head is one group)


def group_pairs(head_dim: int) -> int:
    """RoPE pairs per codebook group for a head of `head_dim` channels."""
    return min(head_dim // 2, MAX_GROUP_PAIRS)


@dataclass
class _KVRecorder(Policy):
    """Evicts nothing; records each prompt's pre-RoPE keys and values per (layer, KV head)."""

    name = "none"
    records: dict = field(default=None, repr=False, compare=False)

    def needs(self) -> Needs:
        return Needs(rotary=True)

    def observe(self, ctx: Context) -> None:
        if ctx.phase != "prefill":
            return
        keys = ctx.keys[:, :, -ctx.q_len:]
        cos, sin = ctx.rotary.cos_sin(ctx.query_rope_positions(), keys.new_empty(0, dtype=torch.float32))
        pre_rope = unrotate(keys, cos, sin)[0].cpu()  # [Hkv, T, D]
        values = ctx.values[0, :, -ctx.q_len:].float().cpu()
        self.records.setdefault(ctx.layer_idx, []).append((pre_rope, values))


def fit_codebooks(model, texts: list, layers: list, stages: int, iters: int = 5, rows: int = 12000,
                  seed: int = 0, log=print) -> dict:
    """{"keys", "values"}: tables [L, Hkv, G, S, P, 64] complex64 per layer of `layers` (in order), fitted to at most
    `rows` tokens of `texts` (token id lists) per KV head, and "errors": the normalised mean squared error after the
    last stage, [L, Hkv] per kind."""
    records: dict = {}
    device = next(model.parameters()).device
    with torch.no_grad(), patch_model(model, _KVRecorder(records=records)):
        for ids in texts:
            model(**with_cache(model, KVPressCache(model.config), input_ids=torch.tensor([ids], device=device),
                               use_cache=True, logits_to_keep=1))
    out = {"keys": [], "values": [], "key_errors": [], "value_errors": []}
    for layer in layers:
        for kind, at in (("keys", 0), ("values", 1)):
            data = torch.cat([r[at] for r in records[layer]], 1)  # [Hkv, N, D]
            pairs = group_pairs(data.shape[-1])
            fitted = [fit_tables(data[h, :rows], pairs, stages, iters, seed=seed) for h in range(data.shape[0])]
            out[kind].append(torch.stack([tables for tables, _ in fitted]))
            out[kind[:-1] + "_errors"].append(torch.tensor([errors[-1] for _, errors in fitted]))
        log(f"codebooks: layer {layer}: key error {out['key_errors'][-1].mean():.4f}, value error "
            f"{out['value_errors'][-1].mean():.4f}")
    return {name: torch.stack(parts) for name, parts in out.items()}
