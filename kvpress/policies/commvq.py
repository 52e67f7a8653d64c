"""CommVQ (Li et al., ICML 2025, arXiv 2506.18879; commvq/compress_evaluation.py, training/quantize_key_cache.py):
keys and values as additive vector-quantization codes, 12 bits per stage per group of up to 64 RoPE pairs.

Each slot's key is coded before RoPE (un-rotated at the position the model rotated it at), divided by its norm, and
approximated by `stages` codewords per group chosen greedily, each a sum t_a + i t_b from one table of 64 complex
entries per pair (formats/commvq.py). The codewords commute with RoPE, so the decoded key is rotated exactly as the
model rotated the original. Values are coded the same way, without RoPE. With SmolLM2's heads (64 channels, one
group) 9 stages and an fp16 norm are 124 bits per vector: 12.1% of a 16-bit cache's bytes, 6.1% of a 32-bit one.
`kvpress calibrate` fits the codebooks to about 2 bits per number: 9 stages for 64-channel heads (SmolLM2), 20 for
128-channel groups (the paper: 21 for Llama's). `key_stages` / `value_stages` default to the best read measured: 1.5
bits of codes per number (8 stages of a 64-channel group, 16 of a 128-channel one), with a 16-token window
(`residual_length`) and 16-token blocks (`block_size`): on SmolLM2 it keeps 85% of the full cache's score at 11.4% of
its bytes, where every stage with 128-token windows and blocks kept 75% at 16.6% (docs/results/commvq). The newest
`residual_length` tokens stay in full precision; older ones are coded `block_size` at a time.

The tables come from the model's calibration file (`kvpress calibrate --model M --codebooks-only`, shipped for
SmolLM2; kvpress/codebooks.py fits them). Composes after an eviction policy ("kvzap+commvq").

Differences from the paper and its code, named:
- Calibration only: the key tables are fitted by hard-assignment EM (the paper anneals soft assignments); the values
  use the same commutative tables, fitted the same way, where the paper trains an encoder and decoder end to end.
- One norm per KV head, not one per token over all heads, so that a head's slots can be evicted on their own.
- Groups of 64 pairs at most (128 channels, the paper's); a 64-channel head is one group of 32 pairs.
- A read decodes each key in registers (C kernel, kernels/vq_read.py) and sums the attention weights per codebook
  row for the values, so no copy of the cache is written; the paper's Triton kernel instead folds RoPE into
  per-codeword products (for Llama-3.1-8B at 1 bit only). The bytes held are the codes, norms and positions.
- The RoPE position of a slot is its position minus its row's left padding, as transformers' generate numbers them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..cache.rollback import appends_before_flush
from ..cache.vq import RopeTable, VQBook, encode_commvq
from ..formats.calibration import Calibration
from ..heads import HeadShards
from .context import Context
from .protocol import ModelInfo
from .registry import register
from .roles import Codec


CODE_BITS = 12  # a codeword: two 6-bit table indices
READ_BITS = 1.5  # the default read: bits of codes per number (the best measured, module docstring)


@register
@dataclass
class CommVQ(Codec):
    """Additive vector-quantization storage whose key codebooks commute with RoPE (module docstring)."""

    name = "commvq"
    key_stages: int | None = None  # None: READ_BITS of codes per number, at most the calibration's stages
    value_stages: int | None = None
    residual_length: int = 16
    block_size: int = 16
    calibration: str | None = None
    books: dict = field(default=None, repr=False, compare=False)  # layer index -> VQBook (for_model)
    # (layer index, KV heads held here) -> the VQBook of this process's block of heads (tensor parallelism)
    local_books: dict = field(default_factory=dict, repr=False, compare=False)

    def validate(self) -> None:
        for name, low in (("key_stages", 1), ("value_stages", 1), ("block_size", 1), ("residual_length", 0)):
            if getattr(self, name) is not None and getattr(self, name) < low:
                raise ValueError(f"{self.name}: {name}={getattr(self, name)!r}; allowed values: an int >= {low}")

    def for_model(self, model: ModelInfo) -> "CommVQ":
        calibration = Calibration.for_model(model, self.calibration)
        command = f"kvpress calibrate --model {model.folder or '<the model folder>'} --codebooks-only"
        if calibration.codebooks is None:
            raise ValueError(f"{self.name}: calibration={self.calibration!r} holds no codebooks; allowed values: a "
                             f"calibration file with CommVQ's codebooks (add them with `{command}`)")
        stages = {}
        for kind in ("key", "value"):
            asked, shipped = getattr(self, f"{kind}_stages"), calibration.codebooks[f"{kind}s"].shape[3]
            if asked is not None and asked > shipped:
                raise ValueError(f"{self.name}: {kind}_stages={asked} but the calibration's codebooks have {shipped}; "
                                 f"allowed values: 1 to {shipped} (or more with `{command} --codebook-stages N`)")
            pairs = calibration.codebooks[f"{kind}s"].shape[4]  # RoPE pairs per group: 2 * pairs channels
            stages[kind] = min(shipped, max(1, round(READ_BITS * 2 * pairs / CODE_BITS))) if asked is None else asked
        ropes = {}  # one RoPE table per distinct rotary, shared by the layers that run it
        books = {}
        for i, layer in enumerate(calibration.layers):
            rotary = model.rotary(layer)
            rope = ropes.setdefault((id(rotary.embedding), rotary.layer_type), RopeTable(rotary))
            books[layer] = VQBook(calibration.codebooks["keys"][i][:, :, :stages["key"]].contiguous(),
                                  calibration.codebooks["values"][i][:, :, :stages["value"]].contiguous(), rope)
        return dataclasses.replace(self, key_stages=stages["key"], value_stages=stages["value"], books=books)

    @property
    def capture_refusal(self) -> str | None:
        return "reads RoPE tables sized by the tokens the layer has seen, a count that changes at every step"

    def appends_before_change(self, layer) -> int:
        return appends_before_flush(layer, self.residual_length, self.block_size)

    def store(self, layer, layer_idx: int) -> None:
        """Code what the residual window no longer covers, `block_size` slots at a time."""
        book, padding = self._book(layer_idx, layer.num_kv_heads), layer.padding

        def encode(keys, values, valid, positions):
            # (a padding slot, never read, would sit before its row's position 0: it is coded at 0)
            rope = positions if padding is None else (positions - padding.view(-1, 1, 1).to(positions)).clamp(min=0)
            return encode_commvq(keys, values, valid, rope, book)

        layer.flush_low_bit(self.residual_length, self.block_size, encode)

    def _book(self, layer_idx: int, local_heads: int) -> VQBook:
        """The codebooks of the KV heads this process's layer holds (a block of them under tensor parallelism)."""
        book = self.books[layer_idx]
        if local_heads == book.keys.shape[0]:
            return book
        key = (layer_idx, local_heads)
        if key not in self.local_books:
            self.local_books[key] = VQBook(HeadShards.block_of(book.keys, local_heads),
                                           HeadShards.block_of(book.values, local_heads), book.rotary)
        return self.local_books[key]

    def on_prefill(self, ctx: Context) -> None:
        self.store(ctx.layer, ctx.layer_idx)

    def on_decode(self, ctx: Context) -> None:
        self.store(ctx.layer, ctx.layer_idx)

    def on_extend(self, ctx: Context) -> None:
        self.store(ctx.layer, ctx.layer_idx)
