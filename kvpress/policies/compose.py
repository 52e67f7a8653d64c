"""Composition: one eviction policy + at most one storage codec, e.g. "snapkv+kivi" or [SnapKV(...), KIVI(...)]."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .context import Context
from .protocol import ModelPass, Needs, Policy
from .roles import OWN_LAYOUT, Codec, ReadView


@dataclass
class Composed(Policy):
    """Runs the eviction policy's hooks, then the codec's (evict first, then store what is kept low-bit). An
    evictor that decides after the whole prompt (model_pass) hands its layers to the codec only then."""

    evictor: Policy = None
    codec: Codec = None
    name = "composed"

    def validate(self) -> None:
        self.evictor.validate()
        self.codec.validate()
        if isinstance(self.evictor, ReadView):
            raise ValueError(f"{self.evictor.name}: sparse reads over low-bit storage are not supported; "
                             f"allowed: {self.evictor.name} alone, or an eviction policy + {self.codec.name}")
        self.evictor.check_codec(self.codec)

    def needs(self) -> Needs:
        return self.evictor.needs() | self.codec.needs()

    def parts(self) -> list[Policy]:
        return [self.evictor, self.codec]

    @property
    def rewrites_keys(self) -> bool:
        return self.evictor.rewrites_keys

    @property
    def decode_change(self) -> str | None:
        return self.evictor.decode_change or self.codec.decode_change

    @property
    def engine_refusal(self) -> str | None:
        return f"stores {self.codec.name}'s low-bit codes after eviction, {OWN_LAYOUT}"

    @property
    def capture_refusal(self) -> str | None:
        if self.evictor.needs().probabilities and self.evictor.decode_change:
            # over a layer that holds codes the attention pass gives no probabilities: they are recomputed
            return (f"{self.evictor.name} scores by attention probabilities, which over {self.codec.name}'s codes are "
                    f"recomputed with sizes that change")
        return self.evictor.capture_refusal or self.codec.capture_refusal

    @property
    def batches_questions(self) -> bool:
        return self.evictor.batches_questions and self.codec.batches_questions

    @property
    def reads_whole_cache(self) -> bool:
        return self.evictor.reads_whole_cache or self.codec.reads_whole_cache

    def prior_state(self, ctx: Context):
        return self.evictor.prior_state(ctx)

    def appends_before_change(self, layer) -> int | None:
        counts = [n for n in (self.evictor.appends_before_change(layer), self.codec.appends_before_change(layer))
                  if n is not None]
        return min(counts, default=None)

    def for_model(self, model) -> "Composed":
        return dataclasses.replace(self, evictor=self.evictor.for_model(model), codec=self.codec.for_model(model))

    def check_chunking(self, chunk_size: int) -> None:
        self.evictor.check_chunking(chunk_size)
        self.codec.check_chunking(chunk_size)

    def observe(self, ctx: Context) -> None:
        self.evictor.observe(ctx)
        self.codec.observe(ctx)

    def prepare_step(self, layer) -> None:
        self.evictor.prepare_step(layer)
        self.codec.prepare_step(layer)

    def on_prefill(self, ctx: Context) -> None:
        self.evictor.on_prefill(ctx)
        if not self.evictor.needs().model_pass:
            self.codec.on_prefill(ctx)

    def after_prefill(self, run: ModelPass) -> None:
        self.evictor.after_prefill(run)
        if self.evictor.needs().model_pass:
            for layer_idx, layer in run.layers():
                self.codec.store(layer, layer_idx)

    def on_decode(self, ctx: Context) -> None:
        self.evictor.on_decode(ctx)
        self.codec.on_decode(ctx)

    def on_extend(self, ctx: Context) -> None:
        self.evictor.on_extend(ctx)
        self.codec.on_extend(ctx)

    def key_view(self, ctx: Context):
        return self.evictor.key_view(ctx)

    def describe(self) -> str:
        return f"{self.evictor.describe()}+{self.codec.describe()}"
