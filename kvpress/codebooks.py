"""CommVQ's codebooks (Li et al. 2025, arXiv 2506.18879), fitted once per model and stored in its calibration file
(formats/calibration.py), read by the commvq codec (policies/commvq.py).

For every layer kvpress compresses and every KV head, the pre-RoPE keys and the values of the calibration texts
(calibration.py's local texts) are recorded, divided by their norms, and one set of tables per head, group and stage
is fitted (`fit_tables`): hard-assignment EM, stage after stage. Each residual gets its nearest codeword
(kernels/vq_search.py), then the tables are solved in closed form: with the codes fixed the codewords t_a + i t_b are
linear in the table entries, so each pair's 64 entries solve one 64 x 64 complex least-squares system, shared by every
pair of a group (the codes are). Differences from the official training (`training/quantize_key_cache.py`):
hard assignments (the paper's EM uses soft ones, annealing the temperature from 1e-3 to 1e-5); one norm per head
instead of one per token over all heads (a head's slots can then be evicted alone); and the values use the same
commutative tables as the keys, fitted the same way, where the paper trains a small encoder and decoder end to end
(gradient training through the model, not a job for a CPU calibration).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cache import KVPressCache
from .formats.commvq import ENTRIES, bag_weights, codewords, decode, from_pairs, to_pairs
from .integrations.hf import with_cache
from .integrations.patching import patch_model
from .kernels.vq_search import encode, nearest
from .policies.context import Context
from .policies.protocol import Needs, Policy
from .positions import unrotate
from .progress import tracked

MAX_GROUP_PAIRS = 64  # RoPE pairs per group: 128 channels, the paper's group (a 64-channel head is one group)


BITS = 2.0  # the rate `kvpress calibrate` fits codebooks for by default: bits per number, the head's fp16 norm included


def group_pairs(head_dim: int) -> int:
    """RoPE pairs per codebook group for a head of `head_dim` channels."""
    return min(head_dim // 2, MAX_GROUP_PAIRS)


def default_stages(head_dim: int) -> int:
    """The most 12-bit stages per group that keep a vector at <= BITS bits per number with its fp16 norm: 9 for
    64-channel heads (1.94 bits), 20 for 256-channel ones in 128-channel groups (1.94)."""
    return int((BITS - 16 / head_dim) * 2 * group_pairs(head_dim) // 12)


def _solve_table(residual: torch.Tensor, codes: torch.Tensor, ridge: float) -> torch.Tensor:
    """The table [P, 64] (complex) minimising sum_n |r_n - t_a(n) - i t_b(n)|^2 for fixed codes: normal equations
    G t = h with G = diag(#a + #b) + i (C - C^T), C[e, f] = #{n: a = e, b = f}, h_e = sum_{a=e} r - i sum_{b=e} r."""
    a, b = codes // ENTRIES, codes % ENTRIES
    count = torch.zeros(ENTRIES, ENTRIES, dtype=torch.float64, device=residual.device)
    count.index_put_((a, b), torch.ones_like(a, dtype=torch.float64), accumulate=True)
    gram = torch.diag(count.sum(1) + count.sum(0) + ridge).to(torch.complex128) + 1j * (count - count.T)
    rhs = torch.zeros(ENTRIES, residual.shape[1], dtype=torch.complex128, device=residual.device)
    r = residual.to(torch.complex128)
    rhs.index_add_(0, a, r)
    rhs.index_add_(0, b, -1j * r)
    return torch.linalg.solve(gram, rhs).T.to(residual.dtype)


def fit_tables(x: torch.Tensor, pairs: int, stages: int, iters: int = 8, ridge: float = 1e-3,
               seed: int = 0) -> tuple[torch.Tensor, list]:
    """Tables [G, S, P, 64] (complex64) fitted to vectors x [N, D] (pre-RoPE keys or values of one KV head), and the
    mean squared error of the normalised vectors after each stage (for the calibration's metrics)."""
    gen = torch.Generator().manual_seed(seed)
    norms = x.float().norm(dim=-1, keepdim=True).clamp(min=1e-12)
    residual = to_pairs(x.float() / norms, pairs)  # [N, G, P]
    groups = residual.shape[1]
    tables = torch.zeros(groups, stages, pairs, ENTRIES, dtype=torch.complex64)
    errors = []
    for s in range(stages):
        for g in range(groups):
            r = residual[:, g]
            start = r[torch.randperm(r.shape[0], generator=gen)[:ENTRIES]].T  # entries drawn from the residuals
            table = torch.zeros(pairs, ENTRIES, dtype=r.dtype)
            table[:, :start.shape[1]] = start / 2
            for _ in range(iters):
                table = _solve_table(r, nearest(r, table), ridge)
            tables[g, s] = table
            residual[:, g] = r - codewords(nearest(r, table), table)
        errors.append(float(from_pairs(residual).square().sum(-1).mean()))
    return tables, errors


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


def fit_codebooks(model, texts: list, layers: list, stages: int | None = None, iters: int = 5, seed: int = 0,
                  log=print) -> dict:
    """{"keys", "values"}: tables [L, Hkv, G, S, P, 64] complex64 per layer of `layers` (in order), S = `stages`
    (None: default_stages of the recorded heads), fitted to every token of `texts` (token id lists) but the last
    text's, and "key_errors", "value_errors": [L, Hkv] the mean relative error |x - decoded| / |x| of the last text's
    vectors (held out), with every stage."""
    records: dict = {}
    device = next(model.parameters()).device
    with torch.no_grad(), patch_model(model, _KVRecorder(records=records)):
        for ids in tracked(texts, "codebooks: recording", unit="text"):
            model(**with_cache(model, KVPressCache(model.config), input_ids=torch.tensor([ids], device=device),
                               use_cache=True, logits_to_keep=1))
    out = {"keys": [], "values": [], "key_errors": [], "value_errors": []}
    for layer in tracked(layers, "codebooks: fitting", unit="layer"):
        for kind, at in (("keys", 0), ("values", 1)):
            data = torch.cat([r[at] for r in records[layer][:-1]], 1)  # [Hkv, N, D]
            held_out = records[layer][-1][at]
            pairs, count = group_pairs(data.shape[-1]), default_stages(data.shape[-1]) if stages is None else stages
            tables = torch.stack([fit_tables(data[h], pairs, count, iters, seed=seed)[0] for h in range(len(data))])
            out[kind].append(tables)
            out[kind[:-1] + "_errors"].append(torch.stack([_relative_error(held_out[h], tables[h])
                                                           for h in range(len(data))]))
        log(f"codebooks: layer {layer}: held-out relative error of keys {out['key_errors'][-1].mean():.4f}, of "
            f"values {out['value_errors'][-1].mean():.4f}")
    return {name: torch.stack(parts) for name, parts in out.items()}


def _relative_error(x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Mean |x - decoded| / |x| of vectors x [N, D] coded with `tables`."""
    codes, norms = encode(x, tables)
    decoded = decode(codes, norms, bag_weights(tables))
    return ((decoded - x).norm(dim=-1) / x.norm(dim=-1).clamp(min=1e-12)).mean()
