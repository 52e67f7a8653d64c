"""Roles: what a policy is, declared as a type, so that every reader (composition, registry, the attention
integration, speculative decoding, evals, serving) asks one question the same way: isinstance(part, Role).

  Codec           stores what the cache keeps as low-bit codes (KIVI, GEAR); evicts nothing. Composes after one
                  eviction policy (compose.py), which calls `store(layer)` once the evictor has decided.
  ReadView        picks the slots each decode step reads (`select(ctx)`); evicts nothing (Quest, Retrieval, TopK,
                  SinkWindow). Used alone, or as the draft view of self-speculative decoding.
  DecodeEviction  may evict while decoding: on_decode compacts the layer (H2O, TOVA, StreamingLLM, DuoAttention).
  StorageTier     moves the prompt into a storage of its own at its end, read by that storage's own reader
                  (ShadowKV's low-rank keys and file-tier values, SubGen's weighted samples); composes with nothing.
  Summarizer      folds the tokens it evicts into a state every read starts from (`prior_state`: LESS's low-rank
                  sums of evicted keys and values); an engine that only frees pages cannot add that state.
  Merger          replaces old slots by fewer synthetic ones that no token had (FreqKV's frequency-domain merge):
                  what it keeps is not a subset of the tokens, so an engine that frees evicted tokens' pages cannot
                  run it, and no codec can hold slots it rewrites again.
  key rewriting   `Policy.rewrites_keys` / `Policy.key_view`: attention reads rewritten keys. A property, not a
                  type: it depends on a hyper-parameter (StreamingLLM's cache_local_positions).
A composition (compose.Composed) has no role of its own: ask its parts (Policy.parts()). Every role that changes
what a decode step does says so in `decode_change`, which rollbacks (speculation) read; each says why a serving
engine cannot run it in `engine_refusal` (integrations/prompts.py reads it), and a ReadView drafts for
self-speculation as itself (`draft_view`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .context import Context
from .protocol import Policy


# why an engine that frees whole pages cannot hold what a codec or a storage tier stores (engine_refusal)
OWN_LAYOUT = "which only kvpress's own cache layout holds, not the engine's pages; allowed: an eviction policy alone"


@dataclass
class Codec(Policy):
    """A storage codec: keeps every token, and moves old ones into low-bit codes."""

    @property
    def reads_whole_cache(self) -> bool:
        return False  # it stores the newest tokens as codes: over a shared context, the rows' own

    @property
    def upper_bits_draftable(self) -> bool:
        """Whether a draft may read the upper half of this codec's codes as a coarser code (QuantSpec, the "quant4"
        draft: 8-bit KIVI codes read as 4-bit ones)."""
        return False

    def store(self, layer, layer_idx: int) -> None:
        """Move what the codec's full-precision window no longer covers in `layer` (the model's attention layer
        `layer_idx`) into low-bit codes (what a composition calls on the layers its evictor has cut)."""
        raise NotImplementedError

    @property
    def decode_change(self) -> str:
        return "moves old tokens into low-bit codes while decoding"

    @property
    def engine_refusal(self) -> str | None:
        return f"stores low-bit codes, {OWN_LAYOUT}"



@dataclass
class ReadView(Policy):
    """A read policy: nothing is evicted; at each decode step attention reads the slots select(ctx) picks."""

    captures: ClassVar[bool] = False  # select runs in a captured decode step (fixed shapes; state from prepare_step)

    def select(self, ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices [B, Hkv, K], valid [B, Hkv, K]): the slots this step reads (ragged counts padded with invalid
        entries); always including the slots of the current query tokens."""
        raise NotImplementedError

    @property
    def decode_change(self) -> str:
        return "reads a selection of the cache at every decode step"

    @property
    def batches_questions(self) -> bool:
        return False  # its pages, chunks or windows count a row's slots, which a question's padding would shift

    @property
    def engine_refusal(self) -> str | None:
        return ("is a read policy (it evicts nothing, it picks what each decode step reads); allowed: an eviction "
                "policy")

    @classmethod
    def draft_view(cls) -> type | None:
        return cls

    @property
    def capture_refusal(self) -> str | None:
        if not self.captures:
            return f"{self.decode_change}, with sizes a captured step cannot keep"
        return super().capture_refusal


@dataclass
class DecodeEviction(Policy):
    """An eviction policy that also evicts while decoding (on_decode compacts the layer)."""

    @property
    def decode_change(self) -> str | None:
        return "evicts tokens while decoding"

    @property
    def capture_refusal(self) -> str | None:
        # a cut every slack + 1 steps runs on the host after a step and leaves the room's shapes; one per step cannot
        if getattr(self, "slack", 0) < 1:
            return f"{self.decode_change}, at every step (slack=0)"
        return super().capture_refusal


@dataclass
class StorageTier(Policy):
    """Stores each layer's prompt in a payload kind of its own (cache/shadow.py, cache/sketch.py), read by that kind's
    reader."""

    @property
    def decode_change(self) -> str:
        return "reads its stored prompt through a reader of its own at every decode step"

    @property
    def engine_refusal(self) -> str | None:
        return f"is a storage tier, {OWN_LAYOUT}"

    @property
    def capture_refusal(self) -> str | None:
        return self.decode_change


@dataclass
class Merger(Policy):
    """Merges old slots into fewer synthetic ones (FreqKV), in place of evicting some of them."""

    @property
    def decode_change(self) -> str:
        return "merges old tokens into fewer synthetic ones when the cache fills while decoding"

    @property
    def engine_refusal(self) -> str | None:
        return ("merges tokens into synthetic ones; an engine keeps a subset of the prompt's own tokens in its "
                "pages; allowed: an eviction policy")

    @property
    def capture_refusal(self) -> str | None:
        return self.decode_change


@dataclass
class Summarizer(Policy):
    """Evicts, and keeps a summary of what it evicted that every later read adds (Policy.prior_state)."""

    @property
    def capture_refusal(self) -> str | None:
        return "adds its summary of evicted tokens to every read, which runs segment by segment with changing sizes"

    @property
    def engine_refusal(self) -> str | None:
        return ("adds a summary of its evicted tokens to every read, which an engine's attention does not; allowed: "
                "an eviction policy")
