"""A context every row of a batch shares, stored once: many questions over one compressed document (Hydragen:
Juravsky et al., 2024), or over several documents compressed apart (APE: Yang et al., 2025; kvpress/combined.py).

A layer's `prefix` precedes its own segments. `share(layer)` makes everything a layer holds a `SharedPrefix` (a
one-row KVPressLayer, any storage kind) and starts the layer's own slots empty: from then on the layer's segments are
its rows' own tokens (a question and its answer, each row behind its own left padding), and every view a policy sees
(positions, keys, state, counts) is of those own slots. `batch_repeat_interleave` then repeats the own slots and
per-row counters only; the prefix stays one copy.

A read computes the prefix's attention once for every row's queries, folded into one batch row (one matmul, or one
kernel call, per KV head over the prefix: its slots all precede every query, so only their validity masks them),
then each row's own slots starting from that state: the online-softmax merge is exact. A prefix answers for its own
read (`state`), bytes (`held_tensors`), counts and copy; `ParallelPrefix` is APE's: an instruction and documents at
the same positions, the documents' attention tempered and scaled.

A codec stores the rows' own tokens (their own groups, their own full-precision window); the prefix is never
re-encoded. A step whose policy reads or changes the whole view (an evictor while decoding, a read view, a
speculative draft) first gives each row its own copy of the prefix (`unshare`, copy on write): the layer is then what
it would be had the prefix been repeated, its own tokens after the prefix's tail. `stats()` says which layers did.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..kernels.online_softmax import Queries, State, merge_states
from .payloads import FullPrecision
from .segments import Segment


def share(layer) -> None:
    """Make everything `layer` holds its shared prefix; its own slots start empty (after the prefix's tokens)."""
    if layer.prefix is not None:
        raise ValueError("this layer's context is already shared; allowed: share a layer once")
    if layer.batch_heads[0] != 1:
        raise ValueError(f"a shared context is one row; this layer holds {layer.batch_heads[0]}; allowed: the cache "
                         f"of one context, before its rows are repeated")
    prefix = layer.fork()  # (a copy sharing every tensor; neither side appends in place into the other's buffers)
    start_own(layer, SharedPrefix(prefix))


def start_own(layer, prefix) -> None:
    """`layer` holds `prefix`, then no slot of its own yet (its rows' tokens come after the prefix's)."""
    keys, values = layer.tail_exact.data.keys, layer.tail_exact.data.values
    _, heads, _, dim = keys.shape
    own = Segment(FullPrecision(keys.new_empty(1, heads, 0, dim), values.new_empty(1, heads, 0, values.shape[-1])),
                  torch.zeros(1, heads, 0, dtype=torch.int32, device=keys.device))
    layer.segments, layer.prefix, layer.room = [own], prefix, None
    layer.explicit_positions, layer.sorted, layer.derived = True, True, {}
    layer.rollback_floor = layer.seen  # nothing before the own slots can be rolled back


def fold(queries: Queries) -> tuple[Queries, callable]:
    """Every row's queries [B, Hq, r, D] as one row of B * r queries, and the function that unfolds a state of them
    back to [B, Hkv, g, r]."""
    batch, hq, rows, dim = queries.values.shape
    folded = Queries(queries.values.transpose(0, 1).reshape(1, hq, batch * rows, dim), queries.positions.repeat(batch),
                     queries.scaling, queries.softcap, queries.sliding_window)

    def unfold(state: State) -> State:
        hkv, group = state[0].shape[1:3]
        return tuple(t.reshape(hkv, group, batch, rows, *t.shape[4:]).movedim(2, 0).contiguous() for t in state)

    return folded, unfold


@dataclass(frozen=True)
class SharedPrefix:
    """Hydragen's: one context (a one-row KVPressLayer) every row reads as its own first tokens."""

    layer: object  # the one-row KVPressLayer

    def state(self, queries: Queries, state_of) -> State:
        """The attention state [B, Hkv, g, r] of every row's queries over the prefix, computed as one row of B * r
        queries: `state_of(layer, queries)` is a layer's read (read.attention_state)."""
        folded, unfold = fold(queries)
        return unfold(state_of(self.layer, folded))

    @property
    def width(self) -> int:
        return self.layer.view_width

    @property
    def seen(self) -> int:
        return self.layer.seen

    @property
    def full_tokens(self) -> int:
        """Tokens the prefix would hold uncompressed."""
        return self.layer.seen

    def tokens_per_head(self) -> torch.Tensor:
        return self.layer.tokens_per_head()

    def held_tensors(self) -> list[torch.Tensor]:
        return self.layer.held_tensors()

    def shared_tensors(self) -> list[torch.Tensor]:
        return self.layer.shared_tensors()

    def kv_nbytes(self) -> int:
        return self.layer.kv_nbytes()

    def copied_into(self, layer) -> None:
        """Copy on write: the prefix repeated into every row of `layer`, its own tokens after the prefix's tail, as if
        the prefix had been repeated with the rows. Refused (ValueError) once the rows' own tokens are low-bit codes:
        they cannot follow the prefix's full-precision tail in one layer."""
        prefix, own = self.layer, layer.segments
        if len(own) != 1 or own[0].low_bit or own[0].flat:
            raise ValueError("a shared context whose rows already hold low-bit codes of their own cannot be copied "
                             "into each row (their codes would follow the context's full-precision window); allowed: "
                             "a step that only appends or stores codes over a shared context")
        batch, heads = layer.batch_heads
        repeated = [s.map_rows(lambda t: t.repeat_interleave(batch, dim=0)) for s in prefix.segments]
        # every slot records its position (the rows' own slots after the prefix's do: a later flush joins the two)
        repeated = [s if s.flat or s.positions is not None else
                    dataclasses.replace(s, positions=s.view_positions(offset, batch, heads, layer.device))
                    for s, offset in zip(repeated, prefix.offsets())]
        tail, mine = repeated[-1], own[0]
        if tail.flat:  # (a flat layer's full precision is a run segment: the own tail follows it as the layer's tail)
            layer.segments = [*repeated, mine]
        else:
            layer.segments = [*repeated[:-1], _joined(tail, prefix.tail_start(), mine, layer.device)]
        layer.sorted = layer.sorted and prefix.sorted


@dataclass(frozen=True)
class ParallelPrefix:
    """APE's (kvpress/combined.py): an instruction every document was encoded after, then documents encoded apart at
    the same positions. A query's attention over the documents is one softmax with its logits divided by
    `temperature`, whose total weight against the instruction and the rows' own tokens is
    exp(temperature * logsumexp(logits / temperature)) * `scale` (APE's alignment with sequential encoding); with
    temperature 1 and scale 1 it is plain attention over everything held."""

    instruction: object | None  # a one-row KVPressLayer, or None (no shared prefix)
    documents: tuple  # one-row KVPressLayers
    shared: int  # the instruction's tokens (every document's positions start after them)
    temperature: float = 1.0
    scale: float = 1.0

    @property
    def parts(self) -> list:
        return [p for p in (self.instruction, *self.documents) if p is not None]

    def state(self, queries: Queries, state_of) -> State:
        folded, unfold = fold(queries)
        tempered = dataclasses.replace(folded, scaling=folded.scaling / self.temperature)
        docs = None
        for document in self.documents:
            part = state_of(document, tempered)
            docs = part if docs is None else merge_states(docs, part)
        m, l, acc = docs
        # one normalised value for all the documents, weighted by T * lse(logits / T) + log(S) in the merge
        lse = torch.where(l > 0, m + torch.log(l.clamp(min=1e-30)), torch.full_like(m, float("-inf")))
        adjusted = (torch.where(l > 0, self.temperature * lse + math.log(self.scale), lse), (l > 0).to(l.dtype),
                    torch.where((l > 0)[..., None], acc / l.clamp(min=1e-30)[..., None], acc))
        state = adjusted if self.instruction is None else merge_states(state_of(self.instruction, folded), adjusted)
        return unfold(state)

    @property
    def width(self) -> int:
        return sum(p.view_width for p in self.parts)

    @property
    def seen(self) -> int:  # positions the prefix spans: the questions follow the longest document
        return max(d.seen for d in self.documents)

    @property
    def full_tokens(self) -> int:
        """Tokens the instruction and every document would hold uncompressed (their positions overlap)."""
        return self.shared + sum(d.seen - self.shared for d in self.documents)

    def tokens_per_head(self) -> torch.Tensor:
        return sum(p.tokens_per_head() for p in self.parts)

    def held_tensors(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in p.held_tensors()]

    def shared_tensors(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in p.shared_tensors()]

    def kv_nbytes(self) -> int:
        return sum(p.kv_nbytes() for p in self.parts)

    def copied_into(self, layer) -> None:
        raise ValueError("documents combined by APE (kvpress.combine) cannot be copied into each row: their tempered "
                         "attention is a read of its own; allowed: policies whose decode steps only append or store "
                         "codes (e.g. kvzap, snapkv, kivi)")


def unshare(layer) -> None:
    """Each row its own copy of the layer's prefix (copy on write); the layer then holds no prefix."""
    layer.prefix.copied_into(layer)
    layer.prefix, layer.derived = None, {}
    layer.copied_on_write = True


def _joined(tail: Segment, offset: int, own: Segment, device) -> Segment:
    """The prefix's (repeated) full-precision tail with the rows' own slots after it, as one rectangle."""
    batch, heads = own.data.batch_heads
    names = sorted(set(tail.state) | set(own.state))
    tail, own = tail.with_states(names), own.with_states(names)
    valid = None if tail.valid is None and own.valid is None else torch.cat(
        [tail.view_valid(batch, heads, device), own.view_valid(batch, heads, device)], -1)
    return Segment(tail.data.cat(FullPrecision(own.data.keys, own.data.values)),
                   torch.cat([tail.view_positions(offset, batch, heads, device), own.positions], -1), valid,
                   {n: torch.cat([tail.state[n], own.state[n]], -1) for n in names})
