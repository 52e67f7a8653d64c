"""KVzap (NVIDIA, arXiv 2601.07891): KVzip's selection without its replay. A per-layer predictor, fitted once per
model by `kvpress calibrate` (kvpress/calibration.py), maps each token's attention input hidden state to its
predicted log KVzip score per KV head. The prediction is made when the token enters the cache (prompt, chunk or
decode step) and kept as per-slot state, so prefill, chunked prefill and decode_budget all score with it at the
cost of one small matmul per layer. Sinks (the first `n_sink` tokens) are always kept, and so are the newest
`window` tokens of the prompt (default 128, as NVIDIA runs KVzap under DMSPress). Without the window a question at
the end of the prompt is not protected: on the RULER-style suite with the question in the prompt (120 samples),
kvzap at 0.9 scores 26.2 without it and 51.9 with it (kvzip 49.0); with the question asked after compression the
window costs nothing (docs/results/kvzap_window). window=0 leaves the calibrated scores alone in charge.

Budgets as KVzip: 'global' (default) runs one top-k over every (layer, KV head, slot) after the prompt, so layers
and heads keep different counts (the predicted scores estimate KVzip's, which are comparable across layers);
'uniform', 'pyramid' and 'adaptive' cut each layer at prefill.

`calibration`: a file path, or None for the file beside the model's weights (`kvpress calibrate --model PATH`
writes it there); a missing file, or one made for another model, is refused at patch time with the command to
run.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..formats.calibration import Calibration
from ..heads import HeadShards
from .context import Context
from .protocol import ModelInfo, ModelPass, Needs
from .scorer import ScorerPolicy
from .selection import evict_after_prompt, first_slots, last_slots
from .registry import register

_STATE = "kvzap_predicted"
_WINDOW_LIFT = 1e6  # above any spread of predicted log-scores (they are log attention probabilities)


@register
@dataclass
class KVzap(ScorerPolicy):
    name = "kvzap"
    budget_allocation: str = "global"
    served_defaults: ClassVar[dict] = {"budget_allocation": "uniform"}  # an engine decides layer by layer
    n_sink: int = 4
    window: int = 128
    calibration: str | None = None
    predictor: object = field(default=None, repr=False, compare=False)  # the loaded Calibration (for_model)
    allocations: ClassVar[tuple] = ("global", "uniform", "pyramid", "adaptive")

    def validate(self) -> None:
        super().validate()
        for name in ("n_sink", "window"):
            if getattr(self, name) < 0:
                raise ValueError(f"kvzap: {name}={getattr(self, name)!r}; allowed values: an int >= 0")

    def query_rows(self) -> int:
        return 0  # predicted from hidden states, through observe

    def needs(self) -> Needs:
        return super().needs() | Needs(hidden_states=True, model_pass=self.budget_allocation == "global")

    def for_model(self, model: ModelInfo) -> "KVzap":
        if self.predictor is not None:
            return self
        return dataclasses.replace(self, predictor=Calibration.for_model(model, self.calibration))

    def observe(self, ctx: Context) -> None:
        # predict the new tokens' scores once, when they enter the cache (they sit at the end of the view); after
        # the prompt only decode_budget scores again
        if ctx.phase != "prefill" and self.decode_budget is None:
            return
        predicted = self.predictor.predict(ctx.layer_idx, ctx.hidden_states)  # [B, Hkv, q_len]
        # under tensor parallelism the hidden states are whole and the layer holds a block of the KV heads
        ctx.layer.set_newest_state(_STATE, HeadShards.of(ctx.layer.num_kv_heads, predicted.shape[1]).local(predicted))

    def score(self, ctx: Context) -> torch.Tensor:
        return self._protect(ctx.layer, ctx.layer.get_state(_STATE))

    def score_from(self, ctx: Context, start: int) -> torch.Tensor:
        return ctx.layer.get_state(_STATE, start)  # past the prompt's slots, so past its sinks

    def on_prefill(self, ctx: Context) -> None:
        if self.budget_allocation == "global":
            self.start_budget(ctx)  # the cut comes after every layer has seen the prompt (after_prefill)
            return
        super().on_prefill(ctx)

    def cut(self, ctx: Context, scores: torch.Tensor) -> None:
        super().cut(ctx, scores)
        self._release(ctx.layer)

    def after_prefill(self, run: ModelPass) -> None:
        scores = {i: self._protect(layer, layer.get_state(_STATE)) for i, layer in run.layers()}
        evict_after_prompt(run, scores, self.budget_allocation, self.head_floor)
        for _, layer in run.layers():
            self._release(layer)

    def _release(self, layer) -> None:
        # Slots kept from the prompt (or from earlier chunks) are never scored again, so without decode_budget the
        # predictions are dropped: they would cost 4 bytes per slot and head for nothing.
        if self.decode_budget is None:
            layer.drop_state(_STATE)

    def _protect(self, layer, scores: torch.Tensor) -> torch.Tensor:
        """The predicted scores with each head's sinks raised above all others, then its newest `window` prompt
        slots above every unprotected one. The window is lifted by a constant, not set to inf, so its slots keep
        their predicted order among themselves: a window wider than a short prompt's budget is cut by the
        predictor, and a global budget still compares windows of different layers. In float64, where the lift
        leaves the predicted order intact. Generated tokens (decode_budget) are never in the window."""
        counts = torch.ones(scores.shape[:2], dtype=torch.long, device=scores.device)
        scores = scores.double().masked_fill(first_slots(layer, counts * self.n_sink), math.inf)
        if self.window:
            prompt = layer.key_valid() & (layer.key_positions() < layer.decode_start)
            scores = torch.where(last_slots(layer, counts * self.window, among=prompt), scores + _WINDOW_LIFT, scores)
        return scores
