from dataclasses import dataclass

import torch

from .context import Context
from .protocol import Needs
from .roles import DecodeEviction
from .scorer import ScorerPolicy
from .selection import cache_local_keys, first_slots
from .registry import register


@register
@dataclass
class StreamingLLM(ScorerPolicy, DecodeEviction):
    """StreamingLLM (Xiao et al. 2024): `n_sink` attention sinks (the first real tokens of each row) plus a window
    of the newest tokens, trimmed at prefill and at every decode step. Capacity: n_sink + window (window given),
    or a budget / compression_ratio (window=None), never both.

    cache_local_positions=False keeps original positions (as NVIDIA kvpress does). True re-rotates keys so
    the kept tokens sit at contiguous positions right behind the query, as in the paper: each read rotates
    the stored (original-position) keys once by their offset, so no rounding error accumulates."""

    name = "streaming_llm"
    n_sink: int = 4
    window: int | None = None
    cache_local_positions: bool = False

    def check_budget(self) -> None:
        """The capacity is given once: as n_sink + window, or as a budget / compression_ratio (then the window is
        what the sinks leave). Both at once would leave one of them ignored."""
        if self.window is None:
            super().check_budget()
            if self.budget is not None and self.budget <= self.n_sink:
                raise ValueError(f"streaming_llm: budget={self.budget} is smaller than n_sink + window = "
                                 f"{self.n_sink} + 1; allowed values: budget >= n_sink + window with window >= 1")
            return
        if self.window < 1:
            raise ValueError(f"streaming_llm: window={self.window!r}; allowed values: None or an int >= 1")
        given = "budget" if self.budget is not None else "compression_ratio" if self.compression_ratio is not None \
            else None
        if given is not None:
            relation = "is smaller than" if self.budget is not None and self.budget < self.n_sink + self.window \
                else "also sets the capacity besides"
            raise ValueError(
                f"streaming_llm: {given}={getattr(self, given)!r} {relation} n_sink + window = {self.n_sink} + "
                f"{self.window}: one of them would be ignored; allowed values: window alone (capacity n_sink + "
                f"window), or budget / compression_ratio alone (window=None)")

    def validate(self) -> None:
        if self.n_sink < 0:
            raise ValueError(f"streaming_llm: n_sink={self.n_sink!r}; allowed values: an int >= 0")
        super().validate()

    def row_budget(self, n_real: torch.Tensor) -> torch.Tensor:
        if self.window is not None:
            return torch.full_like(n_real, self.n_sink + self.window)
        return super().row_budget(n_real)

    def query_rows(self) -> int:
        return 0  # positions alone

    @property
    def engine_refusal(self) -> str | None:
        if self.cache_local_positions:  # (attention would read keys re-rotated; the engine reads its pages' own)
            return ("cache_local_positions=True is not served by an engine yet (its attention reads the keys at "
                    "their stored positions); allowed values: cache_local_positions=False")
        return super().engine_refusal

    def score(self, ctx: Context):
        return ctx.layer.key_positions().float()  # newest first, after the protected sinks

    def on_decode(self, ctx: Context) -> None:
        """The window slides by one: when every head holds exactly one token over its budget, the oldest token
        behind the sinks is the one to go, found by one top-k over positions (what the generic scorer path
        decides through scores and protected masks); anything else takes that generic path."""
        layer = ctx.layer
        # with slack the cut is never one token (the generic path decides when and how much)
        if self.decode_budget is None and self.slack == 0 and self.budget_allocation == "uniform" and not layer.is_flat:
            valid = layer.key_valid()
            n_valid = valid.sum(-1)
            budget = layer.row_budget[:, None].to(n_valid)
            if bool(((n_valid - budget == 1) & (budget > self.n_sink)).all()):
                oldest = layer.key_positions().masked_fill(~valid, torch.iinfo(torch.int32).max)
                victims = oldest.topk(self.n_sink + 1, dim=-1, largest=False).indices[..., -1]
                if layer.replace_newest(victims):
                    return
        super().on_decode(ctx)

    def protected(self, ctx: Context, n_keep: torch.Tensor):
        return first_slots(ctx.layer, torch.clamp(n_keep - 1, max=self.n_sink).clamp(min=0))

    def needs(self) -> Needs:
        return super().needs() | Needs(rotary=self.cache_local_positions)

    def for_model(self, model):
        if self.cache_local_positions:  # re-rotation needs standard RoPE frequencies: fail before patching
            for layer_idx in model.layers:
                try:
                    model.rotary(layer_idx).inv_freq()
                except ValueError as e:
                    raise ValueError(f"streaming_llm: cache_local_positions=True: {e}; allowed values for this "
                                     f"model: cache_local_positions=False") from None
        return self

    def check_codec(self, codec) -> None:
        if self.cache_local_positions:
            raise ValueError(
                f"streaming_llm: cache_local_positions=True re-rotates full-precision keys and cannot combine with the "
                f"codec {codec.name!r}; allowed values: cache_local_positions=False")

    @property
    def rewrites_keys(self) -> bool:
        return self.cache_local_positions

    def key_view(self, ctx: Context) -> torch.Tensor:
        if not self.cache_local_positions or not ctx.layer.explicit_positions:
            return ctx.keys
        return cache_local_keys(ctx.layer, ctx.keys, ctx.rotary.inv_freq())
