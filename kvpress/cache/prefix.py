"""A context every row of a batch shares, stored once (Hydragen: Juravsky et al., 2024): many questions over one
compressed document.

`share(layer)` freezes what a layer holds as its `prefix` (itself a KVPressLayer of one row, any storage kind) and
starts the layer's own slots empty: from then on the layer's segments are its rows' own tokens (a question and its
answer, each row behind its own left padding), and every view a policy sees (positions, keys, state, counts) is of
those own slots. `batch_repeat_interleave` then repeats the own slots and per-row counters only; the prefix stays one
copy.

A read computes the prefix's attention once for every row's queries, folded into one batch row (one matmul, or one
kernel call, per KV head over the prefix: its slots all precede every query, so no causal mask), then each row's own
slots starting from that state: the online-softmax merge is exact (`prefix_state`). A codec stores the rows' own
tokens (their own groups, their own full-precision window); the prefix is never re-encoded.

A step whose policy reads or changes the whole view (an evictor while decoding, a read view, a speculative draft)
first gives each row its own copy of the prefix (`unshare`, copy on write): the layer is then what it would be had the
prefix been repeated, its own tokens after the prefix's tail. `stats()` says which layers did.
"""

from __future__ import annotations

import dataclasses

import torch

from ..kernels.online_softmax import Queries, State
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
    keys, values = layer.tail_exact.data.keys, layer.tail_exact.data.values
    _, heads, _, dim = keys.shape
    own = Segment(FullPrecision(keys.new_empty(1, heads, 0, dim), values.new_empty(1, heads, 0, values.shape[-1])),
                  torch.zeros(1, heads, 0, dtype=torch.int32, device=keys.device))
    layer.segments, layer.prefix = [own], prefix
    layer.explicit_positions, layer.sorted, layer.derived = True, True, {}
    layer.rollback_floor = layer.seen  # nothing before the own slots can be rolled back


def prefix_state(prefix, queries: Queries, state_of) -> State:
    """The attention state [B, Hkv, g, r] of every row's queries over the one-row `prefix` (a KVPressLayer),
    computed as one row of B * r queries: `state_of(layer, queries)` is the layer's read (read.attention_state)."""
    batch, hq, rows, dim = queries.values.shape
    folded = Queries(queries.values.transpose(0, 1).reshape(1, hq, batch * rows, dim), queries.positions.repeat(batch),
                     queries.scaling, queries.softcap, queries.sliding_window)
    m, l, acc = state_of(prefix, folded)  # [1, Hkv, g, B * r(, D)]
    _, hkv, group = m.shape[:3]

    def unfolded(t):
        return t.reshape(hkv, group, batch, rows, *t.shape[4:]).movedim(2, 0).contiguous()

    return unfolded(m), unfolded(l), unfolded(acc)


def unshare(layer) -> None:
    """Copy on write: the prefix repeated into every row, the rows' own tokens after its tail, as if the prefix had
    been repeated with the rows. Refused (ValueError) once the rows' own tokens are low-bit codes: they cannot follow
    the prefix's full-precision tail in one layer."""
    prefix, own = layer.prefix, layer.segments
    if len(own) != 1 or own[0].low_bit or own[0].flat:
        raise ValueError("a shared context whose rows already hold low-bit codes of their own cannot be copied into "
                         "each row (their codes would follow the context's full-precision window); allowed: a step "
                         "that only appends or stores codes over a shared context, or ask without sharing it")
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
