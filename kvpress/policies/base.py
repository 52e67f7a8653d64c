"""Policy base classes, what a policy sees, and the one place where scores become kept slots.

A policy is a dataclass of hyper-parameters with hooks (no-ops by default), called by the one attention
integration in this order for every attention layer and forward:
  observe(ctx)        after attention, in every phase: accumulate per-slot or per-layer statistics (H2O's
                      attention sums, ExpectedAttention's query statistics); the only hook that updates state
                      without evicting, so scoring twice never counts twice
  on_prefill(ctx)     after the prompt (or one chunk of it): may compact the layer
  on_decode(ctx)      after a one-token forward: may compact the layer
  on_extend(ctx)      after a multi-token forward on a non-empty layer (a later turn, a verification): never
                      evicts (design invariant 4)
and once per forward of the whole model:
  after_prefill(run)  after the prompt (and after each chunk of a chunked prefill) went through every layer:
                      may run extra forwards over the cache (`run.probe`) and evict in every layer at once
A policy declares what it needs from the forward (`needs()`: the rotary embedding, the attention input's hidden
states, the model-level hook); the integration provides exactly that, and compositions and wrappers forward the
union of their parts' needs. Other declarations: `is_codec`, `selects`, `evicts_during_decode`,
`rewrites_keys`, `read_precision`. Policies hold no per-call state: whatever must persist lives in the cache
layer (per-slot state, per-layer statistics, `row_budget`).

`ScorerPolicy` subclasses implement only a pure `score(ctx) -> [B, Hkv, T]` (higher = keep), optionally
`observe` and `protected(ctx, n_keep)`; the shared code turns scores into kept slots under the budget.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar

import torch

from ..heads import SINGLE, HeadShards
from ..positions import Rotary, unrotate
from ..kernels import attention_probs, attention_column_sums
from .allocation import (adaptive_head_budgets, comparable, global_budgets, pyramid_budgets, validate_allocation,
                         whole_pages)


# ---------------------------------------------------------------------------- declarations
@dataclass(frozen=True)
class Needs:
    """What a policy needs from the forward besides the post-RoPE query and its cache layer."""

    rotary: bool = False  # the layer's RoPE at any position (Context.rotary): pre-RoPE queries, re-rotation
    hidden_states: bool = False  # the attention module's input hidden states (Context.hidden_states)
    model_pass: bool = False  # after_prefill(run), once the prompt (or a chunk of it) went through every layer
    # attention probabilities of a decode step's query over every stored slot, from the attention pass itself
    # (Context.attention_probs / attention_column_sums then cost nothing; other phases recompute them)
    probabilities: bool = False
    # the evidence of every head of the model, when this process holds only some (tensor parallelism): a
    # decision over several heads at once (TOVA's mean, AdaKV's per-layer and KVzip's global top-k); see heads.py
    all_heads: bool = False
    # the prompt's token ids, after the prompt (ModelPass.input_ids): a forward given inputs_embeds is refused
    prompt_ids: bool = False

    def __or__(self, other: "Needs") -> "Needs":
        return Needs(*(a or b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


# ---------------------------------------------------------------------------- context
@dataclass
class Context:
    """What a policy hook sees for one attention layer in one forward."""

    layer: "KVPressLayer"  # noqa: F821
    phase: str  # "prefill" | "decode" | "extend"
    query: torch.Tensor  # [B, Hq, q_len, D], post-RoPE
    scaling: float
    layer_idx: int  # the model's index of this attention layer
    # the transformers attention module (None where a serving engine calls the policy with plain tensors)
    module: torch.nn.Module | None = None
    softcap: float | None = None
    sliding_window: int | None = None
    # (rank of this layer, number of layers) among the layers kvpress compresses, for layer-wise budgets
    budget_layer: tuple[int, int] | None = None
    # While a chunked prefill runs: real tokens of the whole prompt per row [B], and its padded length (budgets
    # follow the prompt, not the chunk); None otherwise
    prompt_tokens: torch.Tensor | None = None
    prompt_length: int | None = None
    observers: int = 0  # this forward's last tokens are observation queries (a known question), dropped after it
    rope_positions: torch.Tensor | None = None  # [B, q_len] RoPE positions of the query rows (None: seen-based)
    # Provided only to policies that declare the need (Needs):
    rotary: Rotary | None = None  # of this layer
    hidden_states: torch.Tensor | None = None  # [B, q_len, hidden] the attention module's input
    probs: torch.Tensor | None = None  # [B, Hq, q_len, T] fp32, when the attention pass computed them
    shards: HeadShards = SINGLE  # the block of heads this process holds (all_heads; otherwise all of them)
    # A paged engine frees whole pages of this many tokens: budgets are raised until the evicted count is a multiple
    # of it (allocation.whole_pages); 1 everywhere else
    page_size: int = 1

    @property
    def keys(self) -> torch.Tensor:
        """Full-precision keys [B, Hkv, T, D] over the layer's padded view (see KVPressLayer.keys_view)."""
        return self.layer.keys_view()

    @property
    def values(self) -> torch.Tensor:
        return self.layer.values_view()

    @property
    def q_len(self) -> int:
        return self.query.shape[2]

    @property
    def group_size(self) -> int:
        return self.query.shape[1] // self.layer.num_kv_heads

    def query_rope_positions(self) -> torch.Tensor:
        """[B, q_len] RoPE positions of this forward's query rows."""
        if self.rope_positions is not None:
            return self.rope_positions.expand(self.query.shape[0], -1)
        return self.query_positions()[None].expand(self.query.shape[0], -1)

    def pre_rope_query(self) -> torch.Tensor:
        """fp32 [B, Hq, q_len, D]: this forward's queries before RoPE (needs rotary)."""
        positions = self.query_rope_positions()
        cos, sin = self.rotary.cos_sin(positions, self.query.new_empty(0, dtype=torch.float32))
        return unrotate(self.query, cos, sin)

    def query_positions(self, last: int | None = None) -> torch.Tensor:
        """Raw positions of the (last `last`) query rows of this forward."""
        last = self.q_len if last is None else last
        return torch.arange(self.layer.seen - last, self.layer.seen, device=self.query.device)

    def key_logits(self, query: torch.Tensor, upto: int | None = None) -> torch.Tensor:
        """fp32 logits [B, Hkv, g, r, upto] of query rows against the stored slots (dense or quantized)."""
        return self.layer.key_logits(query, self.scaling, self.softcap, upto)

    def attention_probs(self, last: int | None = None) -> torch.Tensor:
        """Softmax attention [B, Hq, r, T] (fp32) of the last `last` query rows over the stored slots, with the
        same causal / padding / sliding-window masking the model's attention used."""
        last = self.q_len if last is None else last
        if self.probs is not None:
            return self.probs[:, :, -last:]
        return attention_probs(self.key_logits, self.query[:, :, -last:], self.query_positions(last),
                               self.layer.key_positions(), self.layer.key_valid_or_none(), self.sliding_window)

    def attention_column_sums(self) -> torch.Tensor:
        """Attention received by each slot, summed over all query rows of this forward: [B, Hq, T] (fp32).
        Computed in query chunks, so a long prompt never materialises its full attention matrix."""
        if self.probs is not None:  # a decode step: its one (real) query row's probabilities
            return self.probs.sum(2)
        layer = self.layer
        fp32_keys = {}  # bf16/fp16 keys go to fp32 once here, not once per query block (a prompt has hundreds)

        def key_logits(query, upto):
            return layer.key_logits(query, self.scaling, self.softcap, upto, fp32_keys=fp32_keys)

        return attention_column_sums(key_logits, self.query, self.query_positions(),
                                     layer.key_positions(), layer.key_valid_or_none(), self.sliding_window)

    def to_kv_heads(self, per_query_head: torch.Tensor, reduce: str = "mean") -> torch.Tensor:
        """[B, Hq, ...] -> [B, Hkv, ...] by reducing each GQA group (design invariant 6)."""
        batch, hq = per_query_head.shape[:2]
        grouped = per_query_head.reshape(batch, hq // self.group_size, self.group_size, *per_query_head.shape[2:])
        if reduce == "mean":
            return grouped.mean(2)
        if reduce == "sum":
            return grouped.sum(2)
        if reduce == "max":
            return grouped.amax(2)
        raise ValueError(f"reduce={reduce!r}; allowed values: 'mean', 'sum', 'max'")


@dataclass
class ModelInfo:
    """The model a policy will serve, as policies see it before it runs (Policy.for_model): a transformers model that
    patch_model wraps, or a model a serving engine runs (its config and weights, no transformers modules)."""

    config: object  # the decoder's transformers config
    layers: list  # indices of the attention layers kvpress compresses, in order
    head_dim: int
    identity: Callable[[], dict]  # () -> the weights' identity (formats/calibration.identity_of), when asked
    folder: Path | None  # the folder of the weights (calibration files sit beside them); None when not local
    rotary: Callable[[int], Rotary]  # layer index -> its RoPE (ValueError when the model has none kvpress can use)
    model: torch.nn.Module | None = None  # the transformers model (None in a serving engine)
    modules: list | None = None  # its attention modules, in layer order (None in a serving engine)


@dataclass
class ModelPass:
    """What the model-level hook (Policy.after_prefill) sees, once the prompt, or one chunk of a chunked prefill,
    has gone through every layer."""

    model: torch.nn.Module
    cache: "KVPressCache"  # noqa: F821
    input_ids: torch.Tensor | None  # [B, n] this forward's tokens (None when the model was fed embeddings)
    attention_mask: torch.Tensor | None  # [B, seen] 2-D padding mask of everything seen so far (None: no padding)
    next_positions: torch.Tensor  # [B] the RoPE position the next token of each row gets
    # While a chunked prefill runs: real tokens of the whole prompt per row [B] and its padded length
    prompt_tokens: torch.Tensor | None
    prompt_length: int | None
    # probe(input_ids, attention_mask, position_ids, on_layer): a forward of extra tokens over the cache that
    # calls on_layer(ctx) in every kvpress layer after attention and leaves the cache exactly as it was
    probe: Callable
    shards: HeadShards = SINGLE  # the block of KV heads this process's layers hold (all_heads)
    # results a policy may share between passes over the same prompt (evals: configs that differ only in budget)
    memo: dict = dataclasses.field(default_factory=dict)

    def layers(self) -> list:
        """(layer_idx, KVPressLayer) of every layer kvpress compresses."""
        return self.cache.kvpress_layers()


# ---------------------------------------------------------------------------- selection helpers
def first_slots(layer, n: torch.Tensor, among: torch.Tensor | None = None) -> torch.Tensor:
    """Mask [B, Hkv, T] of the `n` [B, Hkv] earliest (by original position) slots of each row/head among
    `among` (default: the real slots)."""
    return _by_position(layer, n, among, newest=False)


def last_slots(layer, n: torch.Tensor, among: torch.Tensor | None = None,
               positions: torch.Tensor | None = None) -> torch.Tensor:
    """Mask [B, Hkv, T] of the `n` [B, Hkv] newest slots of each row/head among `among` (default: real slots).
    `positions`: of the slots `among` covers when that is not the whole view (a part from a segment boundary)."""
    return _by_position(layer, n, among, newest=True, positions=positions)


def position_rank(layer, among: torch.Tensor | None = None, newest_first: bool = False,
                  positions: torch.Tensor | None = None) -> torch.Tensor:
    """[B, Hkv, T] rank of each slot among its row/head's `among` slots (default: the real ones) by original
    position, 0 = the oldest (the newest with newest_first); slots outside `among` rank after all of them."""
    among = layer.key_valid() if among is None else among
    if layer.sorted:  # slot order is position order: a running count says it
        counts = among.flip(-1).cumsum(-1).flip(-1) if newest_first else among.cumsum(-1)
        return torch.where(among, counts - 1, among.shape[-1])
    # slots evicted in place no longer follow position order: rank them by position
    positions = (layer.key_positions() if positions is None else positions).long()
    far = torch.iinfo(torch.long).min if newest_first else torch.iinfo(torch.long).max
    order = positions.masked_fill(~among, far).argsort(dim=-1, descending=newest_first, stable=True)
    return order.argsort(-1)


def _by_position(layer, n, among, newest, positions=None):
    among = layer.key_valid() if among is None else among
    if not layer.sorted and n.numel() and bool((n == n.flatten()[0]).all()):
        k = min(int(n.flatten()[0]), among.shape[-1])  # the same count everywhere: one top-k by position
        positions = layer.key_positions() if positions is None else positions
        if newest:
            # A recent window (H2O) is never evicted, so its k positions are normally all still there: the slots
            # within k of each head's newest position are then exactly the k newest (k distinct positions in a
            # range of k). Checked by counting; otherwise the top-k below decides.
            top = positions.masked_fill(~among, -1).amax(-1, keepdim=True)
            window = among & (positions > top - k)
            if bool((window.sum(-1) == among.sum(-1).clamp(max=k)).all()):
                return window
        far = torch.iinfo(torch.long).min if newest else torch.iinfo(torch.long).max
        key = positions.long().masked_fill(~among, far)
        chosen = torch.zeros_like(among).scatter_(-1, key.topk(k, dim=-1, largest=newest).indices, True)
        return among & chosen
    return among & (position_rank(layer, among, newest_first=newest, positions=positions) < n[..., None])


def select_kept(
    scores: torch.Tensor, valid: torch.Tensor, n_keep: torch.Tensor, protected: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`n_keep` [B, Hkv] real slots per row/head by score, protected slots first.

    Returns (indices [B, Hkv, T'], keep_valid [B, Hkv, T']) with T' = max n_keep: storage stays
    rectangular, and rows/heads that keep fewer tokens mark the extra slots invalid (never attended)."""
    s = comparable(scores)
    if protected is not None:
        s = s.masked_fill(protected & valid, math.inf)
    s = s.masked_fill(~valid, -math.inf)
    width = int(n_keep.max())
    # A stable sort, not topk: ties (max-pooling makes plateaus) then always go to the earlier slot, so a
    # left-padded row picks exactly what the same prompt picks alone.
    indices = s.sort(dim=-1, descending=True, stable=True).indices[..., :width]
    keep_valid = torch.arange(width, device=s.device) < n_keep[..., None]
    return indices, keep_valid


def evict_to_budget(layer, scores: torch.Tensor, budget: torch.Tensor, kept_first=None,
                    allocation: str = "uniform", head_floor: float = 0.0, shards: HeadShards = SINGLE,
                    observers: int = 0) -> None:
    """Keep the best `budget` [B] slots per row and KV head of `layer` by `scores` [B, Hkv, T]: real slots only,
    `kept_first(n_keep)` ([B, Hkv, T] or None) before any other; 'adaptive' allocation spreads each row's total
    over its heads (allocation.py); the newest `observers` tokens (observation queries) are never kept. The one
    place where scores become a keep()."""
    valid = layer.key_valid()
    if observers:
        valid = valid & (layer.key_positions() < layer.seen - observers)
    n_valid = valid.sum(-1)  # [B, Hkv]
    n_keep = torch.minimum(budget[:, None].to(n_valid), n_valid)
    if bool((n_keep == n_valid).all()) and layer.stored == int(n_keep.max()):
        return  # within budget and already rectangular: nothing to free
    protected = None if kept_first is None else kept_first(n_keep)
    if allocation == "adaptive":  # one top-k over the layer's heads: every rank's (tensor parallelism)
        n_keep, scores = adaptive_head_budgets(shards.gather(scores), shards.gather(valid), shards.gather(n_keep),
                                               shards.gather(protected), head_floor)
        n_keep, scores = shards.local(n_keep), shards.local(scores)
        protected = None  # folded into the priorities
    keep_best(layer, scores, valid, n_keep, protected, n_valid)


def keep_best(layer, scores: torch.Tensor, valid: torch.Tensor, n_keep: torch.Tensor,
              protected: torch.Tensor | None = None, n_valid: torch.Tensor | None = None, offset: int = 0) -> bool:
    """Keep the best `n_keep` [B, Hkv] real slots of each row/head, protected ones first (select_kept). When every
    head has exactly one slot too many (a decode step of a policy that holds its budget), the one it drops is
    evicted in place (layer.replace_newest: the new token takes its slot), not by copying the layer.
    With `offset` > 0 the tensors cover the view's slots from `offset` on (the others stay) and only the in-place
    eviction is tried: returns whether it was done (always True for offset 0)."""
    n_valid = valid.sum(-1) if n_valid is None else n_valid
    if bool(((n_valid - n_keep) == 1).all()):
        s = comparable(scores).masked_fill(~valid, math.inf)
        if protected is not None:
            s = s.masked_fill(protected & valid, math.inf)
        # the lowest score; among ties the latest slot, the one select_kept's stable sort would drop
        victims = s.shape[-1] - 1 - s.flip(-1).argmin(-1)
        if layer.replace_newest(victims + offset):
            return True
    if offset:
        return False
    layer.keep(*select_kept(scores, valid, n_keep, protected))
    return True


def evict_after_prompt(run: ModelPass, scores: dict, allocation: str, head_floor: float = 0.0) -> None:
    """The model-level counterpart of evict_to_budget, for policies that score once the whole prompt went through
    every layer (KVzip, KVzap): keep the best slots of every layer by `scores` {layer_idx: [B, Hkv, T]} under each
    layer's row budget. 'global' runs one top-k over every (layer, KV head, slot) of a row, so layers and heads
    keep different counts (stored flat); the other allocations cut each layer alone. In a chunked prefill, slots
    kept from earlier chunks stay and this chunk adds its share."""
    layers = run.layers()
    budgets, earlier = {}, {}
    for i, layer in layers:
        if run.prompt_tokens is None:
            budgets[i], earlier[i] = layer.row_budget, None
        else:
            budgets[i], earlier[i] = chunk_share(layer, run.prompt_tokens, run.prompt_length, layer.last_q_len)
    if allocation != "global":
        for i, layer in layers:
            evict_to_budget(layer, scores[i], budgets[i], lambda n, e=earlier[i]: e, allocation, head_floor,
                            run.shards)
        return
    valid = {i: layer.key_valid() for i, layer in layers}
    # one top-k over every layer and head of the model: under tensor parallelism, every rank's heads (one
    # all-gather per layer), each rank then keeps its own block
    shards = run.shards
    heads = {i: valid[i].shape[1] * shards.count for i, _ in layers}
    total = sum(budgets[i] * heads[i] for i, _ in layers)  # [B] tokens a row keeps over all layers and heads
    counts, priorities = global_budgets([shards.gather(scores[i]) for i, _ in layers],
                                        [shards.gather(valid[i]) for i, _ in layers],
                                        [shards.gather(earlier[i]) for i, _ in layers], total)
    counts, priorities = [shards.local(c) for c in counts], [shards.local(p) for p in priorities]
    for (i, layer), n_keep, priority in zip(layers, counts, priorities):
        if bool((n_keep == valid[i].sum(-1)).all()) and layer.stored == int(n_keep.max()):
            continue
        layer.keep(*select_kept(priority, valid[i], n_keep))


# ---------------------------------------------------------------------------- policies
_KINDS = {  # annotation -> accepts
    "int": lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
}
_KIND_WORDS = {"int": "an int", "float": "a number", "str": "a string", "bool": "True or False", "None": "None"}


@dataclass
class Policy:
    """Base policy: keeps everything. Subclasses add hyper-parameters and hooks."""

    name: ClassVar[str] = "none"
    needs_budget: ClassVar[bool] = False
    is_codec: ClassVar[bool] = False  # a storage codec (KIVI, GEAR) rather than an eviction policy
    selects: ClassVar[bool] = False  # a read policy: select(ctx) picks the slots decode steps read
    evicts_during_decode: ClassVar[bool] = False  # on_decode may compact the layer
    read_precision: ClassVar[int | None] = None  # a view that reads low-bit codes with fewer bits (quant4 draft)

    def needs(self) -> Needs:
        """What this policy needs from the forward (see Needs)."""
        return Needs()

    @property
    def rewrites_keys(self) -> bool:
        """Whether key_view returns other keys than the stored ones (attention then reads those)."""
        return False

    def query_rows(self) -> int | None:
        """How many of a prompt's last query rows on_prefill reads (0: none, None: all of them). A serving engine
        that sees a long prompt in chunks keeps just these rows until the prompt's last chunk (observe sees
        every chunk's rows as they pass)."""
        return None

    @property
    def decode_change(self) -> str | None:
        """What a decode step does to the cache besides appending its token, in words (None: nothing). Rolling
        decode steps back (speculation, transformers' assisted decoding) is exact over plain appends only."""
        if self.evicts_during_decode:
            return "evicts tokens while decoding"
        if self.selects:
            return "reads a selection of the cache at every decode step"
        return None

    def appends_before_change(self, layer) -> int | None:
        """Tokens `layer` can still append before a decode step of this policy changes it (None: never)."""
        return None

    def parts(self) -> list["Policy"]:
        """The policies this one is made of (a composition's evictor and codec), or itself."""
        return [self]

    def validate(self) -> None:
        """Raise ValueError naming the parameter and its allowed values; called before any patching."""

    def check_chunking(self, chunk_size: int) -> None:
        """Raise ValueError if prefill chunks of `chunk_size` tokens cannot serve this policy."""

    def check_codec(self, codec: "Policy") -> None:
        """Raise ValueError if this eviction policy cannot hand what it keeps to `codec` (low-bit storage)."""

    def for_model(self, model: "ModelInfo") -> "Policy":
        """This policy checked against, and configured for, the model about to be patched: raise ValueError if it
        cannot serve it, resolve model-specific resources. Called before the model is touched. Default: itself."""
        return self

    def __post_init__(self):
        self._check_types()
        self.validate()
        object.__setattr__(self, "_checked", True)

    def claim(self, delta: int) -> None:
        """Count a patch that starts (+1) or stops (-1) using this policy and its parts. While one does, their
        hyper-parameters cannot change: the patch checked them against its model (for_model) and set up what they
        need (rotary embeddings, hooks for hidden states), which a change would silently bypass."""
        for part in {id(p): p for p in (self, *self.parts())}.values():
            object.__setattr__(part, "_patches", part.__dict__.get("_patches", 0) + delta)

    def __getstate__(self):  # a copy (copy, deepcopy, pickle) is used by no patch
        return {k: v for k, v in self.__dict__.items() if k != "_patches"}

    def __setattr__(self, name, value):
        """A hyper-parameter changed after construction is checked like one given to the constructor; a bad value
        is refused and the old one stays. One a patch uses cannot change (see claim)."""
        if name in self.__dataclass_fields__ and self.__dict__.get("_patches"):
            raise ValueError(
                f"{self.name}: {name}={value!r} while a patch uses this policy ({self.describe()}): the patch checked "
                f"its parameters against the model and set up what they need; allowed: patch.unpatch(), then "
                f"kvpress.patch_model(model, policy, {name}=...) (or a copy: dataclasses.replace(policy, {name}=...))")
        if name not in self.__dataclass_fields__ or not self.__dict__.get("_checked"):
            object.__setattr__(self, name, value)
            return
        previous = getattr(self, name)
        object.__setattr__(self, name, value)
        try:
            self._check_types()
            self.validate()
        except ValueError:
            object.__setattr__(self, name, previous)
            raise

    def _check_types(self) -> None:
        """Hyper-parameters annotated int / float / str / bool (or `X | None`) must be of that kind: numpy and
        other Integral/Real numbers are converted, bools are not numbers here, strings are not numbers."""
        for f in dataclasses.fields(self):
            text = f.type.__name__ if isinstance(f.type, type) else str(f.type)  # a type, or "int | None"
            kinds = [k.strip() for k in text.split("|")]
            if not all(k in _KINDS or k == "None" for k in kinds):
                continue  # not a plain hyper-parameter (tensors, tokenizers, nested policies)
            value = getattr(self, f.name)
            if value is None and "None" in kinds:
                continue
            if kinds != ["str"] and isinstance(value, numbers.Real) and not math.isfinite(value):
                # nan compares False with every bound, so range checks alone would let it through
                raise ValueError(f"{self.name}: {f.name}={value!r}; allowed values: a finite number")
            for kind in kinds:
                if kind != "None" and _KINDS[kind](value):
                    converted = int(value) if kind == "int" else float(value) if kind == "float" else value
                    object.__setattr__(self, f.name, converted)
                    break
            else:
                raise ValueError(f"{self.name}: {f.name}={value!r}; allowed values: {' or '.join(_KIND_WORDS[k] for k in kinds)}")

    def observe(self, ctx: Context) -> None:
        pass

    def on_prefill(self, ctx: Context) -> None:
        pass

    def on_decode(self, ctx: Context) -> None:
        pass

    def on_extend(self, ctx: Context) -> None:
        pass

    def after_prefill(self, run: ModelPass) -> None:
        pass

    def key_view(self, ctx: Context) -> torch.Tensor:
        return ctx.keys

    def describe(self) -> str:
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if f.repr)
        return f"{self.name}({fields})"


@dataclass
class BudgetPolicy(Policy):
    """A policy that evicts down to a budget, given as `compression_ratio` (fraction of the prompt removed,
    in [0, 1)) or as an absolute token `budget` per layer, per KV head."""

    compression_ratio: float | None = None
    budget: int | None = None
    needs_budget: ClassVar[bool] = True

    def validate(self) -> None:
        self.check_budget()

    def check_budget(self) -> None:
        """Exactly one of compression_ratio and budget, each in its range."""
        if (self.compression_ratio is None) == (self.budget is None):
            raise ValueError(
                f"{self.name}: give exactly one of compression_ratio (a float in [0, 1)) or budget (an int >= 1); "
                f"got compression_ratio={self.compression_ratio!r}, budget={self.budget!r}; allowed values: "
                f"compression_ratio alone, or budget alone"
            )
        if self.compression_ratio is not None and not (0.0 <= float(self.compression_ratio) < 1.0):
            raise ValueError(
                f"{self.name}: compression_ratio={self.compression_ratio!r} is outside the allowed range [0, 1)"
            )
        if self.budget is not None and (not isinstance(self.budget, int) or self.budget < 1):
            raise ValueError(f"{self.name}: budget={self.budget!r}; allowed values: an int >= 1")

    def row_budget(self, n_real: torch.Tensor) -> torch.Tensor:
        """Tokens each row may keep, from its count of real prompt tokens [B]: with a ratio r, N - ceil(N r), never
        a token over the declared ratio (NVIDIA kvpress keeps int(N (1 - r)), the same count), but at least one.
        (The 1e-9 keeps a product that is whole up to rounding, 100 x 0.07, from removing one token more.)"""
        if self.budget is not None:
            return torch.full_like(n_real, self.budget)
        removed = torch.ceil(n_real.double() * self.compression_ratio - 1e-9).long()
        return (n_real - removed).clamp(min=1)


@dataclass
class ScorerPolicy(BudgetPolicy):
    """Scores every stored slot; shared code keeps the best `budget` per row and KV head.

    Generic options, for every scorer:
      budget_allocation  'uniform' (same budget everywhere), 'pyramid' (PyramidKV: per layer, `pyramid_beta`),
                         'adaptive' (AdaKV: per head, one top-k over the layer, each head's floor `head_floor`
                         x the mean per-head budget); see allocation.py. Policies that score after the whole
                         prompt (model_pass) may also offer 'global': one top-k over every layer and head.
      decode_budget      tokens generated after the prompt that may stay (SCOPE-style): the prompt keeps its
                         prefill budget, generated tokens are cut to this budget at every decode step (the newest
                         half always stays, the rest by the policy's score at that step); None: no cap (or,
                         for policies that evict while decoding, one budget for prompt and output together)
      slack              tokens a layer may hold over its budget while decoding before it evicts: it then cuts
                         back to the budget in one step, by the scores of that step. 0 (the definition): one
                         eviction per generated token. k > 0: one per k + 1 tokens, at most budget + k tokens
                         held (bytes bounded), the eviction's fixed cost amortised over k + 1 steps
    """

    budget_allocation: str = "uniform"
    head_floor: float = 0.2
    pyramid_beta: float = 20.0
    decode_budget: int | None = None
    slack: int = 0
    allocations: ClassVar[tuple] = ("uniform", "pyramid", "adaptive")

    def validate(self) -> None:
        super().validate()
        validate_allocation(self.name, self.budget_allocation, self.head_floor, self.pyramid_beta, self.allocations)
        if self.decode_budget is not None and (not isinstance(self.decode_budget, int) or self.decode_budget < 1):
            raise ValueError(f"{self.name}: decode_budget={self.decode_budget!r}; allowed values: None or an int >= 1")
        if self.slack < 0:
            raise ValueError(f"{self.name}: slack={self.slack!r}; allowed values: an int >= 0")
        if self.slack and not self.evicts_during_decode and self.decode_budget is None:
            raise ValueError(f"{self.name}: slack={self.slack!r} has nothing to act on: {self.name} evicts only at "
                             f"prefill; allowed values: slack=0, or slack with decode_budget")

    @property
    def decode_change(self) -> str | None:
        if self.decode_budget is not None:
            return f"evicts generated tokens beyond decode_budget={self.decode_budget} while decoding"
        return super().decode_change

    def score(self, ctx: Context) -> torch.Tensor:
        """[B, Hkv, T] importance of each stored slot (higher = keep). Pure: state is updated by observe()."""
        raise NotImplementedError

    def protected(self, ctx: Context, n_keep: torch.Tensor) -> torch.Tensor | None:
        """[B, Hkv, T] slots kept whatever their score (at most n_keep per row/head)."""
        return None

    @property
    def kept_window(self) -> int:
        """Newest slots the policy always keeps (SnapKV's observation window): pyramid budgets ramp the rest."""
        return 0

    def layer_budget(self, ctx: Context) -> torch.Tensor:
        """[B] tokens per KV head this layer may keep, from the prompt's real token count."""
        n_real = ctx.prompt_tokens if ctx.prompt_tokens is not None else ctx.layer.key_valid()[:, 0].sum(-1)
        budget = self.row_budget(n_real.to(ctx.query.device))
        if self.budget_allocation == "pyramid" and ctx.budget_layer is not None:
            rank, n_layers = ctx.budget_layer
            budget = pyramid_budgets(budget, n_real, n_layers, self.kept_window, self.pyramid_beta)[rank]
        return whole_pages(budget, n_real, ctx.page_size)

    def start_budget(self, ctx: Context) -> None:
        """Fix this layer's budget at prefill and mark where generated tokens will begin."""
        ctx.layer.row_budget = self.layer_budget(ctx)
        ctx.layer.decode_start = ctx.layer.seen

    def needs(self) -> Needs:
        return Needs(all_heads=self.budget_allocation in ("adaptive", "global"))

    def on_prefill(self, ctx: Context) -> None:
        self.start_budget(ctx)
        if ctx.prompt_tokens is None:
            self.compress(ctx, self.score(ctx))
        else:
            share, earlier = chunk_share(ctx.layer, ctx.prompt_tokens, ctx.prompt_length, ctx.q_len, ctx.observers,
                                         self.kept_window)
            self.compress(ctx, self.score(ctx), budget=share, keep=earlier)
        self.room_for_slack(ctx.layer)

    def on_decode(self, ctx: Context) -> None:
        layer = ctx.layer
        stored = layer.stored
        if self.decode_budget is not None:
            self.compress_generated(ctx)
        elif self.evicts_during_decode and (budget := self.cut_budget(layer)) is not None:
            self.compress(ctx, self.score(ctx), budget=budget)
        if layer.stored < stored:
            self.room_for_slack(layer)

    def room_for_slack(self, layer) -> None:
        """After a cut, room for exactly the next slack + 1 tokens: they append in place, and the bytes held stay
        at budget + slack + 1 slots (an append's own growth room would be 64 slots or more). A no-op with slack 0,
        which validate() requires of policies that never evict while decoding."""
        if self.slack:
            layer.reserve(self.slack + 1)

    def cut_budget(self, layer) -> torch.Tensor | None:
        """The budget [B] a decode step cuts each row to, or None when no row needs a cut. Slack 0: the row
        budget (compress keeps a row within it as it is). Slack k: the row budget for rows where some head holds
        more than budget + k real tokens, and no cut for the others (each row on its own schedule, as alone)."""
        if self.slack == 0:
            return layer.row_budget
        if layer.stored <= int(layer.row_budget.min()) + self.slack:
            return None  # no head holds more slots than that, real or not: no per-slot count needed
        held = layer.key_valid().sum(-1).amax(-1)  # [B] the fullest head of each row
        budget = layer.row_budget.to(held)
        over = held > budget + self.slack
        return torch.where(over, budget, held) if bool(over.any()) else None

    def compress(self, ctx: Context, scores: torch.Tensor, budget: torch.Tensor | None = None,
                 keep: torch.Tensor | None = None) -> None:
        """Keep the best `budget` [B] slots per row and KV head (default: the layer's row budget); `keep`
        [B, Hkv, T] marks slots kept before any other (with the policy's own protected slots)."""

        def kept_first(n_keep):
            protected = self.protected(ctx, n_keep)
            return keep if protected is None else protected if keep is None else protected | keep

        layer = ctx.layer
        evict_to_budget(layer, scores, layer.row_budget if budget is None else budget, kept_first,
                        self.budget_allocation, self.head_floor, ctx.shards, ctx.observers)

    def score_from(self, ctx: Context, start: int) -> torch.Tensor:
        """score(ctx) of the view's slots from `start` (a segment boundary) on. A policy whose scores are stored
        per slot reads just those (decode_budget scores only the tail, where generated tokens sit)."""
        return self.score(ctx)[..., start:]

    def compress_generated(self, ctx: Context) -> None:
        """Hold generated tokens (position >= the prompt's end) to decode_budget; prompt slots stay. When they all
        sit in the layer's tail (normally), only the tail is looked at and the one token a step drops is evicted in
        place there: the cost of a step does not grow with the prompt's slots."""
        layer = ctx.layer
        if not (layer.generated_in_tail() and self._compress_generated(ctx, layer.tail_start())):
            self._compress_generated(ctx, 0)

    def _compress_generated(self, ctx: Context, start: int) -> bool:
        """compress_generated over the view's slots from `start` on, which hold every generated token. Returns
        False, changing nothing, when start > 0 and the eviction is not one slot per head in place."""
        layer = ctx.layer
        positions, valid = layer.key_positions(start), layer.key_valid(start)
        generated = valid & (positions >= layer.decode_start)
        n_generated = generated.sum(-1)
        if not bool((n_generated > self.decode_budget + self.slack).any()):
            return True
        budget = torch.minimum(n_generated, torch.full_like(n_generated, self.decode_budget))
        recent = last_slots(layer, budget - budget // 2, among=generated, positions=positions)
        prompt = valid & ~generated
        scores = self.score(ctx) if start == 0 else self.score_from(ctx, start)
        return keep_best(layer, scores, valid, prompt.sum(-1) + budget, prompt | recent, offset=start)


def chunk_share(layer, prompt_tokens: torch.Tensor, prompt_length: int, q_len: int, observers: int = 0,
                window: int = 0):
    """Chunked prefill: (budget [B] a row may hold after this chunk, [B, Hkv, T] slots kept from earlier chunks).

    Tokens kept from earlier chunks stay, and this chunk adds its share of the budget, so after a chunk a row holds
    budget x (its real tokens seen / its prompt's real tokens). Re-judging earlier survivors by each later chunk's
    queries would favour recent tokens chunk after chunk (an early needle at 8K is lost that way at 75% on
    SmolLM2, but kept this way). The forward's last `observers` tokens (a known question appended to the chunk)
    are not prompt tokens: they vote, and are never kept. A chunk holding fewer of a row's tokens than the policy's
    always-kept `window` (the first chunk takes the remainder of the prompt, which can be a few tokens) is kept
    whole, unless the row's prompt ends there: its share would be all window, and the window its newest tokens, so
    the chunk would lose its first ones, the attention sink among them (SnapKV 0.3 on SmolLM2, a 15-token first
    chunk: position 0 gone in every head, the answer broken)."""
    real_seen = (prompt_tokens - (prompt_length - (layer.seen - observers))).clamp(min=0)
    share = torch.ceil(layer.row_budget * real_seen / prompt_tokens.clamp(min=1)).long()
    if window:
        real_before = (prompt_tokens - (prompt_length - (layer.seen - q_len))).clamp(min=0)
        short = (real_seen - real_before < window) & (real_seen < prompt_tokens)
        share = torch.where(short, torch.iinfo(torch.long).max, share)  # evict_to_budget keeps every real token
    earlier = layer.key_valid() & (layer.key_positions() < layer.seen - q_len)
    return share, earlier
