"""The policy protocol: what a policy declares (Needs, roles), what it sees (Context, ModelInfo, ModelPass), and its
hooks (Policy).

A policy is a dataclass of hyper-parameters (checked as params.py says) with hooks (no-ops by default), called by
the one attention integration in this order for every attention layer and forward:
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
union of their parts' needs. What a policy IS (a storage codec, a read view, an evictor while decoding, a key
rewriter) is declared once, in roles.py. Policies hold no per-call state: whatever must persist lives in the cache
layer (per-slot state, per-layer statistics, `row_budget`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar

import torch

from ..cache import KVPressCache
from ..heads import SINGLE, HeadShards
from ..positions import Rotary
from .context import Context
from .params import HyperParameters


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
    cache: KVPressCache
    input_ids: torch.Tensor | None  # [B, n] this forward's tokens (None when the model was fed embeddings)
    attention_mask: torch.Tensor | None  # [B, seen] 2-D padding mask of everything seen so far (None: no padding)
    next_positions: torch.Tensor  # [B] the RoPE position the next token of each row gets
    # While a chunked prefill runs: real tokens of the whole prompt per row [B] and its padded length
    prompt_tokens: torch.Tensor | None
    prompt_length: int | None
    # probe(input_ids, attention_mask, position_ids, on_layer, view=None) -> logits: a forward of extra tokens over
    # the cache that calls on_layer(ctx) in every kvpress layer after attention and leaves the cache exactly as it
    # was; its attention reads what `view` (a ReadView) selects, else every slot. Returns the next-token logits
    # [B, vocab] after its last token (None when the patched model is a bare decoder, which has no LM head)
    probe: Callable
    shards: HeadShards = SINGLE  # the block of KV heads this process's layers hold (all_heads)
    # the next-token logits [B, vocab] after this forward's last token (None: the forward computed none)
    logits: torch.Tensor | None = None
    # results a policy may share between passes over the same prompt (evals: configs that differ only in budget)
    memo: dict = dataclasses.field(default_factory=dict)

    def layers(self) -> list:
        """(layer_idx, KVPressLayer) of every layer kvpress compresses."""
        return self.cache.kvpress_layers()


@dataclass
class Policy(HyperParameters):
    """Base policy: keeps everything. Subclasses add hyper-parameters and hooks; roles.py the roles."""

    name: ClassVar[str] = "none"
    needs_budget: ClassVar[bool] = False
    read_precision: ClassVar[int | None] = None  # a view that reads low-bit codes with fewer bits (quant4 draft)
    # observe runs inside a captured decode step (cache/room.py): in place, with no Python count that changes per step
    observe_captures: ClassVar[bool] = True

    def needs(self) -> Needs:
        """What this policy needs from the forward (see Needs)."""
        return Needs()

    @property
    def rewrites_keys(self) -> bool:
        """Whether key_view returns other keys than the stored ones (attention then reads those): a role that
        depends on a hyper-parameter (StreamingLLM's cache_local_positions), so a property, not a type (roles.py)."""
        return False

    def key_view(self, ctx: Context) -> torch.Tensor:
        """The keys attention reads when rewrites_keys (otherwise never called)."""
        return ctx.keys

    def prior_state(self, ctx: Context):
        """A function (Queries) -> online-softmax State that every read of ctx's layer starts from besides its stored
        slots: the policy's summary of tokens it no longer stores (LESS's low-rank state); None: the slots alone."""
        return None

    def query_rows(self) -> int | None:
        """How many of a prompt's last query rows on_prefill reads (0: none, None: all of them). A serving engine
        that sees a long prompt in chunks keeps just these rows until the prompt's last chunk (observe sees
        every chunk's rows as they pass)."""
        return None

    @property
    def decode_change(self) -> str | None:
        """What a decode step does to the cache besides appending its token, in words (None: nothing). Rolling
        decode steps back (speculation, transformers' assisted decoding) is exact over plain appends only. Each
        role that changes decode steps says how (roles.py)."""
        return None

    @property
    def capture_refusal(self) -> str | None:
        """Why a decode step of this policy cannot run captured (fixed shapes, cache/room.py), in words; None when it
        can: its step only appends, or what changes the layer runs on the host after the step. Each role that
        changes decode steps (roles.py) says whether it can."""
        return None if self.observe_captures else "observes each step with shapes that change"

    @property
    def engine_refusal(self) -> str | None:
        """Why a serving engine that frees whole pages after the prompt cannot run this policy, in words ending with
        what is allowed; None when it can: the policy decides from one prompt's tensors, layer by layer, at the
        prompt's end (integrations/prompts.py). Each role and budget option says why not (roles.py, budget.py)."""
        if self.needs().model_pass:
            return ("decides over every layer at once after the prompt (a model-level pass); allowed: a policy that "
                    "decides layer by layer")
        if self.query_rows() is None:
            return ("does not declare which query rows it scores with (Policy.query_rows), so a prompt seen in "
                    "chunks cannot be scored as one; allowed: a policy that declares them")
        return None

    def paged_decode_cuts(self, prompt_length: int, page_size: int) -> tuple[int, int]:
        """How a paged engine evicts while this policy decodes a prompt of `prompt_length` tokens: (tokens per KV
        head each decode-time cut evicts, a multiple of `page_size`; tokens each KV head holds right after a cut).
        The cut comes when a head would hold `cut` more than that. (0, 0): the engine keeps every generated token.
        ValueError when the policy asks for decode-time eviction that frees no whole page. Budget policies answer
        from their budget, `slack` and `decode_budget` (budget.py)."""
        return 0, 0

    @property
    def observes_decode(self) -> bool:
        """Whether `observe` keeps something from decode steps (accumulated attention, predicted scores, query
        statistics) that a later decode-time cut reads. An engine that cuts from its pages every few steps does not
        run the steps between cuts through the policy. Any policy with an `observe` of its own is taken to (a
        policy whose observe acts at prefill only may say False)."""
        return type(self).observe is not Policy.observe

    # settings a serving engine runs this policy with unless given (kvzap: a layer-by-layer budget)
    served_defaults: ClassVar[dict] = {}

    @classmethod
    def draft_view(cls) -> type | None:
        """The read view that drafts for self-speculation under this policy's name (speculative_generate(draft=
        name)): a ReadView drafts as itself; None: the policy does not draft."""
        return None

    @property
    def batches_questions(self) -> bool:
        """Whether several questions over one context can run as one batch, each left-padded after the context
        (kvpress.ask), and each row still read as its question alone: the padding then sits inside a row's slots.
        A read view that counts pages by slot says False (its pages would shift); ask runs it one question at a time."""
        return True

    @property
    def reads_whole_cache(self) -> bool:
        """Whether a decode (or extend) step of this policy reads or changes the whole view of a layer, beyond
        appending its tokens: over a context the rows share (cache/prefix.py) each row then gets its own copy first.
        A codec, which stores only the rows' own tokens, says False."""
        return self.decode_change is not None or self.rewrites_keys

    def appends_before_change(self, layer) -> int | None:
        """Tokens `layer` can still append before a decode step of this policy changes it (None: never)."""
        return None

    def parts(self) -> list["Policy"]:
        """The policies this one is made of (a composition's evictor and codec), or itself."""
        return [self]

    def check_chunking(self, chunk_size: int) -> None:
        """Raise ValueError if prefill chunks of `chunk_size` tokens cannot serve this policy."""

    def check_codec(self, codec: "Policy") -> None:
        """Raise ValueError if this eviction policy cannot hand what it keeps to `codec` (low-bit storage)."""

    def for_model(self, model: ModelInfo) -> "Policy":
        """This policy checked against, and configured for, the model about to be patched: raise ValueError if it
        cannot serve it, resolve model-specific resources. Called before the model is touched. Default: itself."""
        return self

    def observe(self, ctx: Context) -> None:
        pass

    def prepare_step(self, layer) -> None:
        """Before a captured decode step (on the host; cache/room.py): build the read-side state the step updates in
        place, in layer.room.derived (a read view's page statistics). Default: none."""

    def on_prefill(self, ctx: Context) -> None:
        pass

    def on_decode(self, ctx: Context) -> None:
        pass

    def on_extend(self, ctx: Context) -> None:
        pass

    def after_prefill(self, run: ModelPass) -> None:
        pass

    def describe(self) -> str:
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if f.repr)
        return f"{self.name}({fields})"
