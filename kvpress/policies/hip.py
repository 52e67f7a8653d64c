from dataclasses import dataclass

import torch

from ..formats.slots import take_slots
from .context import Context
from .sparse import ReadPolicy, slots_of
from .registry import register


@register
@dataclass
class HiP(ReadPolicy):
    """HiP attention (Lee et al., ICLR 2025; v1.1 of the official code): each decode step reads a row's first `n_sink`
    and last `window` tokens, and k = budget - n_sink - window tokens in between found by a hierarchical search
    instead of scoring every key. The range, in blocks of `block_size` tokens, is cut into k / block_size equal
    nodes; then, until every node is one block, each node is halved, each half is scored by the block at its centre
    (max of q . k over its keys and over the KV head's query heads and rows), and the best k / block_size halves
    stay: about log2(range / k) rounds that each read 2k keys. Per KV head; a row whose range holds at most k tokens reads all.

    Differences from the official code (DeepAuto-AI/hip-attention, v1.1), each named: decode and verification steps
    only (the prefill stays dense, where HiP also prunes query blocks); every query row of a step is one block;
    n_sink and window default to the ICLR version's proportions of the budget (sink 16, mask_k 512, sliding_window
    256: budget 784), block_size to its block_size_k 2."""

    name = "hip"
    budget: int = 784
    n_sink: int | None = None
    window: int | None = None
    block_size: int = 2

    def validate(self) -> None:
        super().validate()
        for name in ("n_sink", "window"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"hip: {name}={value!r}; allowed values: None or an int >= 0")
        if self.block_size < 1:
            raise ValueError(f"hip: block_size={self.block_size!r}; allowed values: an int >= 1")
        if self.budget - self.sinks - self.recent < self.block_size:
            raise ValueError(f"hip: budget={self.budget} leaves fewer than block_size={self.block_size} searched "
                             f"tokens after n_sink={self.sinks} and window={self.recent}; allowed values: budget >= "
                             f"n_sink + window + block_size")

    @property
    def sinks(self) -> int:  # default: the ICLR version's proportion, 16 of 784
        return self.budget * 16 // 784 if self.n_sink is None else self.n_sink

    @property
    def recent(self) -> int:  # default: 256 of 784
        return self.budget * 256 // 784 if self.window is None else self.window

    def select(self, ctx: Context):
        layer = ctx.layer
        real = layer.key_valid()  # [B, Hkv, T]; fillers lead
        lead = (~real).sum(-1)
        n_real = real.sum(-1)
        # the searched range [first, last) of each (row, head); a row shorter than its sinks is read whole
        first = (lead + self.sinks).clamp(max=lead + n_real)
        last = (lead + n_real - max(self.recent, ctx.q_len)).clamp(min=first)
        k = self.budget - self.sinks - self.recent
        nodes = k // self.block_size
        start, end, _ = hierarchical_search(ctx.query, layer.keys_view(), first, last, nodes, self.block_size)
        slots = torch.arange(real.shape[-1], device=real.device)
        # the nodes' slots: +1 where a node starts, -1 where it ends, a running sum (nodes never overlap)
        edges = torch.zeros(*real.shape[:2], real.shape[-1] + 1, device=real.device)
        edges.scatter_add_(-1, start, torch.ones_like(start, dtype=edges.dtype))
        edges.scatter_add_(-1, end, -torch.ones_like(end, dtype=edges.dtype))
        inside = edges.cumsum(-1)[..., :-1] > 0  # [B, Hkv, T]
        short = (last - first <= k)[..., None]  # the whole range fits: read it
        chosen = real & (inside | short | (slots < first[..., None]) | (slots >= last[..., None]))
        return slots_of(chosen)


def hierarchical_search(query: torch.Tensor, keys: torch.Tensor, first: torch.Tensor, last: torch.Tensor,
                        nodes: int, block: int):
    """HiP's top-k search over the slots [first, last) [B, Hkv] of keys [B, Hkv, T, D] for query rows [B, Hq, r, D],
    in blocks of `block` slots counted from `first` (the last one may be short): (start, end) [B, Hkv, nodes] of the
    slots of the blocks found (empty ones have start = end) and the number of rounds. Each round halves every node
    (a run of blocks) and keeps the best `nodes` halves by the keys of their centre block, until nodes are single
    blocks. A range of at most `nodes` blocks comes back as it was cut (the caller reads it whole)."""
    batch, hkv, width, dim = keys.shape
    q = query.reshape(batch, hkv, -1, dim).float()  # each KV head's query heads and rows
    n_blocks = ((last - first + block - 1) // block)[..., None]
    cut = torch.arange(nodes + 1, device=keys.device)
    bounds = n_blocks * cut // nodes  # nodes equal runs of blocks
    start, end = bounds[..., :-1], bounds[..., 1:]
    rounds, offsets = 0, torch.arange(block, device=keys.device)
    while bool(((end - start) > 1).any()):
        middle = (start + end) // 2
        half_start, half_end = torch.cat([start, middle], -1), torch.cat([middle, end], -1)  # [B, Hkv, 2n] blocks
        at = first[..., None, None] + ((half_start + half_end) // 2)[..., None] * block + offsets  # centre blocks
        real = (at < last[..., None, None]) & (half_end > half_start)[..., None]  # an empty half reads nothing
        picked = take_slots(keys, at.clamp(max=width - 1).flatten(2)).float()
        logits = torch.einsum("bhrd,bhsd->bhrs", q, picked).amax(2).view(*at.shape)
        score = logits.masked_fill(~real, float("-inf")).amax(-1)
        best = score.argsort(dim=-1, descending=True, stable=True)[..., :nodes]  # ties: left halves, older first
        start, end = half_start.gather(-1, best), half_end.gather(-1, best)
        rounds += 1
    slot = lambda b: torch.minimum(first[..., None] + b * block, last[..., None])  # noqa: E731
    return slot(start), slot(end), rounds
