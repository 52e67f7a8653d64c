"""The read path of a KVPressLayer (layer.py): attention over its segments, and the key logits policies score.

Each storage kind has one entry in READERS: the kernel its slots are read with (all fold into one online softmax),
whether a rectangular full-precision tail behind it is read in the same kernel call, and how key_logits reads its
keys. A layer that is one full-precision rectangle is read by the model's own attention instead (`attend`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..kernels.online_softmax import Queries, dense_attention_state, empty_state, finish, merge_states
from ..kernels.quant_attention import flat_lowbit_attention_state, lowbit_attention_state
from ..kernels.sparse_attention import GATHER_SLOTS, flat_attention_state, run_grid, sparse_attention
from ..kernels.vq_read import vq_attention_state
from .segments import CODES, DENSE, FLAT, FLAT_CODES
from .shadow import SHADOW
from .sketch import SKETCH
from .vq import VQ
from .view import view_part

MASK_ROWS = 256  # query rows per block when dense attention needs a mask built from stored positions
# base(...)'s mask when every query may read every stored slot: the model's attention runs with no mask at all
# (on CPU, sdpa over 2K slots with a boolean mask costs about 1.7x the same call without one)
UNMASKED = "unmasked"


@dataclass(frozen=True)
class Read:
    """What one attention call reads from a layer, besides its storage."""

    queries: Queries
    keys: torch.Tensor | None = None  # keys a policy rewrote over the padded view (cache-local positions)
    select: Callable | None = None  # () -> Selection of view slots to read (a read view); asked once the layer
    #                                 is rectangular
    precision: int | None = None  # bits to read low-bit codes with (None: all of them)
    probabilities: bool = False  # also return the attention probabilities [B, Hq, q, T] (a rectangular layer)
    # (Queries) -> online-softmax State every read starts from besides the stored slots: a policy's summary of tokens
    # it no longer stores (LESS's low-rank state of evicted tokens); None: the stored slots alone
    prior: Callable | None = None


# ---------------------------------------------------------------------------- one reader per storage kind
# attention state: (layer, segment, offset in the view, queries, state, precision, use_triton, tail) -> State, where
# tail is (keys, values, positions, valid) of a rectangular full-precision tail read in the same call, or None
def _dense_state(layer, segment, offset, queries, state, precision, use_triton, tail):
    batch, heads = layer.batch_heads
    return dense_attention_state(queries, segment.data.keys, segment.data.values,
                                 segment.view_positions(offset, batch, heads, layer.device), segment.valid, state)


def _flat_state(layer, segment, offset, queries, state, precision, use_triton, tail):
    return flat_attention_state(queries, segment.data.keys[0, 0], segment.data.values[0, 0], segment.positions[0, 0],
                                segment.starts(), segment.lengths, state, use_triton, tail)


def _codes_state(layer, segment, offset, queries, state, precision, use_triton, tail):
    batch, heads = layer.batch_heads
    return lowbit_attention_state(queries, segment.data, segment.view_positions(offset, batch, heads, layer.device),
                                  segment.valid, state, precision, use_triton, tail)


def _flat_codes_state(layer, segment, offset, queries, state, precision, use_triton, tail):
    return flat_lowbit_attention_state(queries, segment.data, segment.positions, segment.lengths, state, precision)


def _own_state(layer, segment, offset, queries, state, precision, use_triton, tail):
    """A payload that reads itself (ShadowKV's tiers, SubGen's sketch), given its slots' positions and validity."""
    batch, heads = layer.batch_heads
    if state is None:
        state = empty_state(queries.grouped(heads))
    return segment.data.attention_state(queries, segment.view_positions(offset, batch, heads, layer.device),
                                        segment.valid, state)


def _vq_state(layer, segment, offset, queries, state, precision, use_triton, tail):
    """CommVQ codes, read without decoding a copy of them (kernels/vq_read.py); a flat store's runs are gathered
    into their padded grid first."""
    codes = segment.data
    if segment.flat:
        indices, ok = run_grid(segment.starts(), segment.lengths, int(segment.lengths.max()), codes.num_slots)
        slots, positions, valid = codes.slots(indices), segment.positions[0, 0][indices], ok
    else:
        batch, heads = layer.batch_heads
        positions = segment.view_positions(offset, batch, heads, layer.device)
        slots, valid = codes.slots(), segment.valid
    # every stored key was rotated at a position the layer has seen (vq_read bounds-checks them against the table)
    tables = codes.book.tables(max(layer.seen, 1), layer.device)
    return vq_attention_state(queries, slots, tables, positions, valid, state)


# key logits: (layer, index of the segment, segment, scaled queries [B, Hkv, g, r, D], slots n, block, fp32_keys)
# -> logits parts [B, Hkv, g, r, n'] in slot order
def _logits_of_view(layer, i, segment, q, n, block, fp32_keys):
    keys = None if fp32_keys is None else fp32_keys.get(i)
    if keys is None:
        keys = view_part(layer, segment, values=False, dtype=torch.float32).float()
        if fp32_keys is not None and segment.data.key_dtype != torch.float32:
            fp32_keys[i] = keys
    return [torch.einsum("bhgrd,bhtd->bhgrt", q, keys[:, :, :n])]


def _logits_in_blocks(layer, i, segment, q, n, block, fp32_keys):
    """Rectangular codes, dequantized block by block: never a full-precision copy of the whole segment."""
    parts = []
    for start in range(0, n, block):
        keys = segment.data.dequantize_keys(start, min(start + block, n))
        parts.append(torch.einsum("bhgrd,bhtd->bhgrt", q, keys))
    return parts


@dataclass(frozen=True)
class SegmentReader:
    attention_state: Callable
    reads_tail: bool  # a rectangular full-precision tail right behind it is read in the same kernel call
    key_logits: Callable


READERS = {
    DENSE: SegmentReader(_dense_state, reads_tail=False, key_logits=_logits_of_view),
    FLAT: SegmentReader(_flat_state, reads_tail=True, key_logits=_logits_of_view),
    CODES: SegmentReader(_codes_state, reads_tail=True, key_logits=_logits_in_blocks),  # KIVI's layout
    FLAT_CODES: SegmentReader(_flat_codes_state, reads_tail=False, key_logits=_logits_of_view),
    SHADOW: SegmentReader(_own_state, reads_tail=False, key_logits=_logits_of_view),  # ShadowKV's two tiers
    SKETCH: SegmentReader(_own_state, reads_tail=False, key_logits=_logits_of_view),  # SubGen's weighted samples
    VQ: SegmentReader(_vq_state, reads_tail=False, key_logits=_logits_of_view),  # CommVQ's codes
}


# ---------------------------------------------------------------------------- the layer's read path
def attention(layer, queries: Queries, precision: int | None = None, use_triton: bool | None = None,
              state=None) -> torch.Tensor:
    """Attention of `queries` over every stored slot, [B, Hq, r, D]: a shared prefix once for every row
    (prefix.py), then each segment through the kernel for its kind, all folded into one online softmax."""
    if layer.prefix is not None:
        shared = layer.prefix.state(queries, lambda part, q: attention_state(part, q, precision, use_triton))
        state = shared if state is None else merge_states(state, shared)
    return finish(attention_state(layer, queries, precision, use_triton, state), queries)


def attention_state(layer, queries: Queries, precision: int | None = None, use_triton: bool | None = None,
                    state=None):
    """The online-softmax state of `queries` over the layer's own segments (from `state`, if given)."""
    batch, heads = layer.batch_heads
    tail = layer.tail
    first, after = layer.segments[0], list(zip(layer.segments, layer.offsets()))[1:]
    if (first.kind == FLAT_CODES and after and not any(s.low_bit for s, _ in after)
            and (not any(s.flat for s, _ in after) or batch * heads * sum(s.width for s, _ in after)
                 <= GATHER_SLOTS)):
        # flat codes (a padded batch under KIVI / GEAR) and the full-precision window behind them (a flush
        # leaves it one rectangle, read in place; flat runs left by an eviction are gathered into one small
        # rectangle with it): one kernel call
        return flat_lowbit_attention_state(queries, first.data, first.positions, first.lengths, state,
                                           precision, tail=_rectangle(layer, after))
    # a rectangular full-precision tail (the newest tokens) is read in the same call as the segment before it
    # when that kind's reader takes one (flat full-precision runs, rectangular codes)
    before = layer.segments[-2] if len(layer.segments) > 1 else None
    # (an empty segment, as a mixed-width codec's unused width, is skipped below: it cannot carry the tail)
    joins_tail = before is not None and before.width > 0 and READERS[before.kind].reads_tail
    with_tail = joins_tail and tail.kind == DENSE and tail.width > 0
    rect = (tail.data.keys, tail.data.values, tail.view_positions(layer.tail_start(), batch, heads, layer.device),
            tail.valid) if with_tail else None
    for segment, offset in zip(layer.segments, layer.offsets()):
        if segment.width == 0 or (with_tail and segment is tail):
            continue
        state = READERS[segment.kind].attention_state(layer, segment, offset, queries, state, precision, use_triton,
                                                      rect if segment is before else None)
    return empty_state(queries.grouped(layer.num_kv_heads)) if state is None else state


def _rectangle(layer, segments) -> tuple | None:
    """(keys, values, positions, valid) [B, Hkv, n(, D)] of full-precision (segment, offset)s side by side in
    their padded views (a flat segment's is a transient copy; one rectangular segment's are its own tensors);
    None when they hold no slot."""
    batch, heads = layer.batch_heads
    parts = [s.padded(offset, batch, heads, layer.device) for s, offset in segments if s.width]
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat(tensors, 2) for tensors in zip(*parts)) if parts else None


def attend(layer, read: Read, base) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The read path of one attention call: (output [B, q_len, Hq, D] in transformers' layout, the attention
    probabilities [B, Hq, q_len, T] fp32 when read.probabilities and the layer is one rectangle, else None).
    `base(query, keys, values, mask)` runs the model's own attention implementation; mask None means
    transformers' mask (valid only while slot j holds position j), UNMASKED none at all, else a boolean
    [B, Hq, q, T] mask."""
    queries = read.queries
    if (read.probabilities and read.select is None and read.prior is None and len(layer.segments) == 1
            and not layer.tail.flat and layer.prefix is None):
        return _attend_with_probs(layer, queries, layer.tail.data.keys if read.keys is None else read.keys)
    return _attend(layer, read, base), None


def _attend_with_probs(layer, queries: Queries, keys: torch.Tensor):
    """Attention written out (logits, softmax, weighted values) so its probabilities come with it: what a policy
    that scores by them (H2O, TOVA) reads, without a second pass over the keys."""
    tail = layer.tail
    q = queries.grouped(layer.num_kv_heads)
    batch, heads, group, rows, dim = q.shape
    # each KV head's GQA group of query rows as one matrix (einsum computes the same, with more overhead)
    logits = (q.reshape(batch, heads, group * rows, dim) * queries.scaling) @ keys.float().transpose(-1, -2)
    logits = logits.view(batch, heads, group, rows, -1)
    if queries.softcap is not None:
        logits = torch.tanh(logits / queries.softcap) * queries.softcap
    if not queries.reads_every_slot(tail.valid):
        allowed = queries.allowed(layer.key_positions(), tail.valid)
        logits = logits.masked_fill_(~allowed[:, :, None], float("-inf"))
    probs = logits.softmax(-1)
    out = probs.view(batch, heads, group * rows, -1) @ tail.data.values.float()
    hq = heads * group
    out = out.view(batch, hq, rows, dim).to(queries.values.dtype).transpose(1, 2).contiguous()
    return out, probs.reshape(batch, hq, rows, -1)


def _attend(layer, read: Read, base) -> torch.Tensor:
    queries = read.queries
    if read.select is not None and not layer.codes:
        layer.to_rectangular()  # read views pick slots of a rectangle
        keys = layer.keys_view() if read.keys is None else read.keys
        out = sparse_attention(queries, keys, layer.values_view(), layer.key_positions(), read.select())
        return out.transpose(1, 2).contiguous()
    if len(layer.segments) > 1 or layer.tail.flat or read.prior is not None or layer.prefix is not None:
        # low-bit codes, flat runs or a policy's summary state: each segment through its own kernel, one softmax.
        # Long queries (a chunk of a chunked prefill, a model-level probe's replay) run in row blocks: the kernels
        # write out rows x slots logits, which for 2K rows over 4K slots would be hundreds of MB.
        blocks = [queries.rows(start, start + MASK_ROWS) for start in range(0, queries.values.shape[2], MASK_ROWS)]
        outs = [layer.attention(rows, read.precision, state=None if read.prior is None else read.prior(rows))
                for rows in blocks]
        return (outs[0] if len(outs) == 1 else torch.cat(outs, 2)).transpose(1, 2).contiguous()
    keys = layer.tail.data.keys if read.keys is None else read.keys
    if not layer.explicit_positions:
        return base(queries.values, keys, layer.tail.data.values, None)
    if queries.reads_every_slot(layer.tail.valid):
        return base(queries.values, keys, layer.tail.data.values, UNMASKED)
    # Slot j no longer sits at position j: transformers' mask does not describe this layer; build ours. Long
    # queries (a chunked prefill's next chunk, a long extension) run in row blocks so the mask stays small.
    positions, valid = layer.key_positions(), layer.tail.valid
    outs = []
    for start in range(0, queries.values.shape[2], MASK_ROWS):
        rows = queries.rows(start, start + MASK_ROWS)
        allowed = rows.allowed(positions, valid).repeat_interleave(rows.values.shape[1] // layer.num_kv_heads, 1)
        outs.append(base(rows.values, keys, layer.tail.data.values, allowed))
    return outs[0] if len(outs) == 1 else torch.cat(outs, 1)


def key_logits(layer, query: torch.Tensor, scaling: float, softcap: float | None = None, upto: int | None = None,
               block: int = 4096, fp32_keys: dict | None = None) -> torch.Tensor:
    """fp32 logits [B, Hkv, g, r, T'] of query rows [B, Hq, r, D] against the first `upto` slots of the padded
    view (all by default), grouping query heads under their KV head; low-bit codes are read block by block.
    `fp32_keys`: a dict a caller that asks for many query blocks passes again each time, so full-precision
    keys of a low-precision model are converted once."""
    batch, hq, rows, dim = query.shape
    hkv = layer.num_kv_heads
    upto = layer.view_width if upto is None else upto
    # scaled on the query side: r x D multiplies instead of r x T (these logits are a policy's largest work)
    q = query.reshape(batch, hkv, hq // hkv, rows, dim).float() * scaling
    parts, offset = [], 0
    for i, segment in enumerate(layer.segments):
        if offset >= upto:
            break
        n = min(segment.width, upto - offset)
        if n:  # (a mixed-width codec's unused width is an empty segment, with segments after it)
            parts += READERS[segment.kind].key_logits(layer, i, segment, q, n, block, fp32_keys)
        offset += segment.width
    logits = parts[0] if len(parts) == 1 else torch.cat(parts, -1)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits
