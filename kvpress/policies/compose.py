"""Composition: one eviction policy + at most one storage codec, e.g. "snapkv+kivi" or [SnapKV(...), KIVI(...)]."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Context, Policy


@dataclass
class Composed(Policy):
    """Runs the eviction policy's hooks, then the codec's (evict first, then store what is kept low-bit)."""

    evictor: Policy = None
    codec: Policy = None
    name = "composed"

    def validate(self) -> None:
        self.evictor.validate()
        self.codec.validate()
        if self.evictor.selects:
            raise ValueError(f"{self.evictor.name}: sparse reads over low-bit storage are not supported; "
                             f"allowed: {self.evictor.name} alone, or an eviction policy + {self.codec.name}")
        if getattr(self.evictor, "budget_allocation", "uniform") == "adaptive":
            raise ValueError(
                f"{self.evictor.name}: budget_allocation='adaptive' gives heads different token counts, and the "
                f"codec {self.codec.name!r} needs rectangular heads; allowed values: budget_allocation='uniform' "
                f"or 'pyramid'")
        if getattr(self.evictor, "cache_local_positions", False):
            raise ValueError(
                f"{self.evictor.name}: cache_local_positions=True re-rotates full-precision keys and cannot combine "
                f"with the codec {self.codec.name!r}; allowed values: cache_local_positions=False"
            )

    def check_model(self, head_dim: int) -> None:
        self.evictor.check_model(head_dim)
        self.codec.check_model(head_dim)

    def on_prefill(self, ctx: Context) -> None:
        self.evictor.on_prefill(ctx)
        self.codec.on_prefill(ctx)

    def on_decode(self, ctx: Context) -> None:
        self.evictor.on_decode(ctx)
        self.codec.on_decode(ctx)

    def on_extend(self, ctx: Context) -> None:
        self.evictor.on_extend(ctx)
        self.codec.on_extend(ctx)

    @property
    def rewrites_keys(self) -> bool:
        return self.evictor.rewrites_keys

    def key_view(self, ctx: Context):
        return self.evictor.key_view(ctx)

    def describe(self) -> str:
        return f"{self.evictor.describe()}+{self.codec.describe()}"
