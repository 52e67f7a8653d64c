"""One layer of a KVPressCache: the tokens a layer really keeps, where each came from, and how many it has seen."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
from transformers.cache_utils import CacheLayerMixin

from ..kernels.online_softmax import Queries, dense_attention_state, empty_state, finish
from ..kernels.quant_attention import flat_lowbit_attention_state, lowbit_attention_state
from ..kernels.sparse_attention import GATHER_SLOTS, flat_attention_state, sparse_attention
from . import rollback
from ..formats.slots import take_slots
from .payloads import FullPrecision
from .segments import Segment, dense

_MASK_ROWS = 256  # query rows per block when dense attention needs a mask built from stored positions
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


class KVPressLayer(CacheLayerMixin):
    """Keys/values of one attention layer, stored per KV head (never repeated for GQA), as an ordered list of
    storage segments (segments.py), oldest slots first, every head's slots sorted by original position (except
    after `replace_newest`, a decode-time eviction in place: then `sorted` is False until a keep() sorts again;
    what depends on order (crop, low-bit flushes) sorts first, and policies rank slots by position):

      [low-bit codes]?  [flat full precision]?  tail
    tail      rectangular full precision [B, Hkv, T, D]: where new tokens are appended (in place, with spare room,
              for one-token appends), and the only part `crop` rolls back; behind flat codes, the window a flat
              flush left, its heads' tokens ending together behind leading invalid fillers
    flat      the kept tokens of a layer whose heads keep different numbers of tokens: no padding, so freed bytes
              equal removed tokens
    low-bit   KIVI/GEAR codes of the oldest slots: rectangular, or flat (per-head runs) in a flat layer
    The layout rule lives here, in one place: a keep() that leaves the heads of a row with different counts
    makes the layer flat unless it holds rectangular low-bit codes (then heads get invalid filler slots); a flat
    layer stays flat and flushes to flat low-bit codes; rows that differ only from each other (left padding,
    eval configs stacked as rows) stay rectangular with fillers, like the padding of the prompt itself.

    Policies see one padded view over all segments (key_positions, key_valid, get_state, keys_view), the flat
    part padded to its longest head with invalid slots; slot j of that view is what keep() takes.
      row_budget     [B] tokens each row may keep (per KV head, on average), fixed by the policy at prefill
      decode_start   tokens seen when the prompt ended (generated tokens have positions >= it)
      seen           tokens seen so far (positions of new tokens derive from it, never from the slot count)
      appended       tokens ever appended (never steps back; bounds how far any head's count can have grown)
      last_q_len     tokens appended by the latest update (tells prefill / decode / extend apart)
      stats          per-layer policy statistics, batch-first (e.g. ExpectedAttention's query moments)
      aux            derived read-side state (e.g. per-page key statistics); dropped on compaction
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, **kwargs):
        # (CacheLayerMixin.__init__ would set keys/values attributes; this layer's storage is its segments)
        self.is_initialized = False
        self.segments: list[Segment] = []
        self.compacted = False  # a token was evicted: every segment holds explicit positions
        self.sorted = True  # every head's slots follow original position order (false after in-place eviction)
        self.row_budget: torch.Tensor | None = None
        self.decode_start = 0
        self.aux: dict = {}
        self.stats: dict[str, torch.Tensor] = {}  # per-layer policy statistics, batch-first [B, ...]
        self.seen = 0
        self.appended = 0  # tokens ever appended (never steps back, unlike seen): bounds how much a head grew
        # tokens seen when the layer last changed other than by appending (an eviction, a low-bit flush, policy
        # state of earlier slots): a rollback (crop) cannot go back before it (rollback.py)
        self.rollback_floor = 0
        self.last_q_len = 0
        # [B] padding tokens each row has seen (None: none). Padding only ever comes before a row's first token
        # (left padding), so a slot's position minus it is the token's index in its own row (token_index).
        self.padding: torch.Tensor | None = None

    def reserve(self, n: int) -> None:
        """Spare room for n more tokens in the tail, so appending them writes in place (a probe's tokens)."""
        if self.is_initialized:
            tail = self.tail
            self.segments[-1] = dataclasses.replace(tail, data=tail.data.reserve(n))

    def checkpoint(self) -> dict:
        """This layer's state, to put back with restore(). Shares every tensor and keeps the tail's right to append
        in place: what is appended after the checkpoint is written past the slots the checkpoint covers."""
        return {**self.__dict__, "segments": list(self.segments), "stats": dict(self.stats), "aux": {}}

    def restore(self, state: dict) -> None:
        self.__dict__.clear()
        self.__dict__.update(state)

    def fork(self) -> "KVPressLayer":
        """A copy that shares every tensor (no copy of the storage): segments are values, and neither copy appends
        into the tail's buffer in place any more, so the other never sees a write."""
        out = object.__new__(type(self))
        out.__dict__.update(self.__dict__)
        self.segments = [s.detach() for s in self.segments]
        out.segments = list(self.segments)
        out.stats = dict(self.stats)
        out.aux = {}
        return out

    __copy__ = fork

    # ------------------------------------------------------------------ transformers layer API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads, _, dim = key_states.shape
        self.segments = [dense(key_states.new_empty(batch, heads, 0, dim),
                               value_states.new_empty(batch, heads, 0, value_states.shape[-1]))]
        self.is_initialized = True

    def update(self, key_states, value_states, *args, new_valid: torch.Tensor | None = None, **kwargs):
        """Append `q_len` new tokens to the tail. `new_valid` [B, q_len] marks which are real (not padding).
        Returns the tail's keys/values: kvpress attention reads the layer itself, never these. What is stored
        carries no autograd history (a cache must not keep a forward's graph alive)."""
        key_states, value_states = key_states.detach(), value_states.detach()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch, heads, q_len, _ = key_states.shape
        tail = self.tail
        positions = tail.positions
        if self.compacted:
            new_pos = torch.arange(self.seen, self.seen + q_len, device=self.device, dtype=torch.int32)
            positions = torch.cat([positions, new_pos.expand(batch, heads, q_len)], -1)
        valid = tail.valid
        has_padding = new_valid is not None and not bool(new_valid.all())
        if has_padding:
            missing = (~new_valid.to(dtype=torch.bool)).sum(-1).to(self.device)
            self.padding = missing if self.padding is None else self.padding + missing
        if new_valid is not None and (valid is not None or has_padding):
            if valid is None:
                valid = torch.ones(batch, heads, tail.num_slots, dtype=torch.bool, device=self.device)
            new_valid = new_valid.to(device=self.device, dtype=torch.bool)[:, None, :].expand(batch, heads, q_len)
            valid = torch.cat([valid, new_valid], -1)
        elif valid is not None:
            valid = torch.cat([valid, valid.new_ones(batch, heads, q_len)], -1)
        state = {name: torch.cat([s, s.new_zeros(batch, heads, q_len)], -1) for name, s in tail.state.items()}
        self.segments[-1] = Segment(tail.data.append(key_states, value_states), positions, valid, state)
        self.seen += q_len
        self.appended += q_len
        self.last_q_len = q_len
        return self.tail.data.keys, self.tail.data.values

    def get_seq_length(self) -> int:
        # Tokens SEEN, not stored: generate derives new positions from it, and eviction must not shift them.
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Same contract as transformers' sliding-window layer: stored slots + new tokens, offset by the gap.
        return self.stored + query_length, self.seen - self.stored

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__()

    def crop(self, tokens_to_remove: int) -> None:
        """Roll back the most recent tokens: `crop(-n)` forgets the last n seen, `crop(n)` (n > 0) keeps the
        first n seen (transformers' legacy meaning); refused (ValueError, nothing changed) where that would not
        give back the layer as it was (rollback.py)."""
        rollback.crop(self, tokens_to_remove)

    def mark_changed(self) -> None:
        """The layer just changed in a way a rollback cannot undo (evicted, re-encoded, rescored earlier slots)."""
        self.rollback_floor = self.seen

    def token_index(self) -> torch.Tensor:
        """[B, Hkv, T] each slot's index among its row's own tokens (its position minus the row's padding): what
        the slot's position would be if the row ran alone."""
        positions = self.key_positions()
        return positions if self.padding is None else positions - self.padding.view(-1, 1, 1).to(positions.dtype)

    def forget_newest(self, n: int) -> None:
        """Forget the `n` newest tokens seen (observation tokens: a policy's eviction already dropped them, a policy
        that evicted nothing did not), wherever their slots are; seen steps back."""
        if n == 0 or not self.is_initialized:
            return
        new_seen = self.seen - n
        valid = self.key_valid()
        kept = valid & (self.key_positions() < new_seen)
        if bool((kept != valid).any()):
            width = int(kept.sum(-1).max())
            order = (~kept).long().argsort(dim=-1, stable=True)[..., :width]  # the other slots, in slot order
            self.compact(order, kept.gather(-1, order))
        self.seen = new_seen
        self.decode_start = min(self.decode_start, new_seen)
        self.rollback_floor = min(self.rollback_floor, new_seen)  # observers' evictions count as the chunk's

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._map_rows(lambda t: t.index_select(0, indices.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def offload(self) -> None:
        if self.is_initialized:
            self.segments = [s.to("cpu") for s in self.segments]

    def prefetch(self) -> None:
        if self.is_initialized:
            self.segments = [s.to(self.device) for s in self.segments]

    def _map_rows(self, fn) -> None:
        self.segments = [s.map_rows(fn) for s in self.segments]
        if self.row_budget is not None:
            self.row_budget = fn(self.row_budget)
        if self.padding is not None:
            self.padding = fn(self.padding)
        self.stats = {name: fn(t) for name, t in self.stats.items()}
        self.aux = {}

    # ------------------------------------------------------------------ storage shape
    @property
    def tail(self) -> Segment:
        return self.segments[-1]

    @property
    def low_bit(self) -> Segment | None:
        """The segment of low-bit codes, if any (always the first)."""
        return self.segments[0] if self.segments and self.segments[0].low_bit else None

    @property
    def is_flat(self) -> bool:
        """Heads hold different numbers of tokens: the kept tokens live in flat per-head runs."""
        return any(s.flat for s in self.segments)

    @property
    def stored(self) -> int:
        """Width of the padded view: the longest flat run + every rectangular slot."""
        return sum(s.width for s in self.segments)

    @property
    def quantized_len(self) -> int:
        return 0 if self.low_bit is None else self.low_bit.width

    @property
    def num_kv_heads(self) -> int:
        return self.tail.data.keys.shape[1]

    @property
    def stock_readable(self) -> bool:
        """A model's own attention can read this layer: one full-precision rectangle whose slot j holds position j
        (nothing evicted, nothing low-bit, no flat runs)."""
        return not self.compacted and len(self.segments) <= 1 and not (self.segments and self.tail.flat)

    @property
    def is_compacted(self) -> bool:
        """True once any token was evicted: slot j no longer sits at position j."""
        return self.compacted

    def _offsets(self) -> list[int]:
        out, offset = [], 0
        for s in self.segments:
            out.append(offset)
            offset += s.width
        return out

    def _shape(self) -> tuple[int, int]:
        return self.tail.data.keys.shape[:2]

    # ------------------------------------------------------------------ the padded view
    def _from(self, start: int) -> list[tuple[Segment, int]]:
        """(segment, offset) of the segments from view slot `start` on (a segment boundary: 0, or tail_start())."""
        parts = [(s, o) for s, o in zip(self.segments, self._offsets()) if o >= start]
        if not parts or parts[0][1] != start:
            raise ValueError(f"start={start}: not a segment boundary of this layer's view; allowed values: 0, "
                             f"tail_start()")
        return parts

    def key_positions(self, start: int = 0) -> torch.Tensor:
        """int32 [B, Hkv, T]: original position of every slot of the padded view (fillers sit at 0); from slot
        `start` (a segment boundary) on."""
        batch, heads = self._shape()
        return _joined([s.view_positions(o, batch, heads, self.device) for s, o in self._from(start)])

    def key_valid(self, start: int = 0) -> torch.Tensor:
        """[B, Hkv, T] which slots of the padded view (from slot `start` on) hold real tokens."""
        batch, heads = self._shape()
        return _joined([s.view_valid(batch, heads, self.device) for s, _ in self._from(start)])

    def tail_start(self) -> int:
        """The padded view's first slot of the tail (where appended tokens go)."""
        return self.stored - self.tail.width

    def generated_in_tail(self) -> bool:
        """Every slot before the full-precision tail is a prompt token, so the generated tokens (positions >=
        decode_start) all sit in the tail, where a decode step can evict one in place."""
        if self.tail.flat or len(self.segments) == 1:
            return False
        for segment, offset in zip(self.segments[:-1], self._offsets()):
            if segment.num_slots == 0:
                continue
            newest = offset + segment.num_slots - 1 if segment.positions is None else int(segment.positions.max())
            if newest >= self.decode_start:
                return False
        return True

    def leading_fillers(self) -> torch.Tensor | None:
        """[B, Hkv] slots of the view before each row/head's first real slot (a row's left padding, or the fillers
        of a row that kept fewer tokens than another); None when every slot is real."""
        valid = self.key_valid_or_none()
        return None if valid is None else (~valid).int().cumprod(-1).sum(-1)

    def key_valid_or_none(self) -> torch.Tensor | None:
        """key_valid(), or None when every slot of the view is a real token (masks can skip the check)."""
        if all(not s.flat and s.valid is None for s in self.segments):
            return None
        return self.key_valid()

    def _view_part(self, segment: Segment, values: bool, dtype=None) -> torch.Tensor:
        if segment.low_bit:  # a transient dequantized copy, for policies that score keys (never for attention)
            keys, vals = segment.data.dequantize(0, segment.num_slots)
            return segment.view((vals if values else keys).to(dtype or self.dtype))
        return segment.view(segment.data.values if values else segment.data.keys)

    def keys_view(self) -> torch.Tensor:
        """[B, Hkv, T, D] keys of the padded view (a transient copy unless the layer is one rectangle)."""
        if len(self.segments) == 1:
            return self._view_part(self.tail, values=False)
        return torch.cat([self._view_part(s, values=False) for s in self.segments], 2)

    def values_view(self) -> torch.Tensor:
        if len(self.segments) == 1:
            return self._view_part(self.tail, values=True)
        return torch.cat([self._view_part(s, values=True) for s in self.segments], 2)

    def get_state(self, name: str, start: int = 0) -> torch.Tensor | None:
        """Per-slot policy state [B, Hkv, T] over the padded view (from slot `start`, a segment boundary, on), or
        None if the policy never set it."""
        if not any(name in s.state for s in self.segments):
            return None
        batch, heads = self._shape()
        return _joined([s.view_state(name, batch, heads, self.device) for s, _ in self._from(start)])

    def set_state(self, name: str, state: torch.Tensor) -> None:
        """Store per-slot policy state given over the padded view [B, Hkv, T]."""
        self._write_state(name, state)
        self.mark_changed()

    def _write_state(self, name: str, state: torch.Tensor) -> None:
        out = []
        for segment, offset in zip(self.segments, self._offsets()):
            out.append(segment.with_view_state(name, state[..., offset:offset + segment.width]))
        self.segments = out

    def add_state(self, name: str, values: torch.Tensor) -> None:
        """Per-slot state `name` += values [B, Hkv, T] over the padded view (never set: zeros). A layer that is one
        rectangle (every decode-time evictor's, between cuts) adds in one op, without joining and re-slicing."""
        tail = self.tail
        if len(self.segments) == 1 and not tail.flat:
            old = tail.state.get(name)
            summed = values if old is None else old + values
            self.segments[0] = dataclasses.replace(tail, state={**tail.state, name: summed})
            self.mark_changed()
            return
        state = self.get_state(name)
        self.set_state(name, values if state is None else state + values)

    def set_newest_state(self, name: str, values: torch.Tensor) -> None:
        """Per-slot state `name` of the newest r slots, values [B, Hkv, r] (the tokens just appended: the last r
        slots of a rectangular tail); other slots keep theirs (zeros where never set). Touches the tail only."""
        tail, rows = self.tail, values.shape[-1]
        if tail.flat or tail.num_slots < rows:  # the newest slots are not the tail's last: through the whole view
            state = self.get_state(name)
            state = values.new_zeros(self.key_valid().shape) if state is None else state.clone()
            state[..., -rows:] = values
            self._write_state(name, state)
            return
        batch, heads = self._shape()
        state = tail.view_state(name, batch, heads, self.device).to(values.dtype).clone()
        state[..., -rows:] = values
        self.segments[-1] = dataclasses.replace(tail, state={**tail.state, name: state})

    def drop_state(self, name: str) -> None:
        """Forget per-slot state `name` (a policy that no longer needs it: its bytes are freed)."""
        self.segments = [dataclasses.replace(s, state={k: v for k, v in s.state.items() if k != name})
                         if name in s.state else s for s in self.segments]

    def tokens_per_head(self) -> torch.Tensor:
        """[B, Hkv] real tokens kept in each head."""
        return sum(s.counts() for s in self.segments)

    # ------------------------------------------------------------------ eviction
    def keep(self, indices: torch.Tensor, keep_valid: torch.Tensor | None = None) -> None:
        """Evict: compact storage to `indices` [B, Hkv, T'] (slots of the padded view to keep, per row and KV head).
        `keep_valid` [B, Hkv, T'] flags slots kept only to make rows rectangular; they become invalid. Frees the
        rest. A rollback cannot go back before it."""
        self.compact(indices, keep_valid)
        self.mark_changed()

    def compact(self, indices: torch.Tensor, keep_valid: torch.Tensor | None = None) -> None:
        """keep() without marking a change: for what keeps the same tokens (sorting) or rolls back (crop)."""
        batch, heads = self._shape()
        if indices.dim() != 3 or indices.shape[:2] != (batch, heads):
            raise ValueError(f"keep: indices must be [B={batch}, Hkv={heads}, T'], got {tuple(indices.shape)}")
        if self.sorted:
            indices, order = indices.sort(dim=-1)  # slot order is position order
        else:  # a tail whose slots were replaced in place: put them back in position order
            order = self._position_order().gather(-1, indices).argsort(dim=-1, stable=True)
            indices = indices.gather(-1, order)
        if keep_valid is not None:
            keep_valid = keep_valid.gather(-1, order)
        parts = self._split(indices, keep_valid)
        offsets = self._offsets()
        low_bit = self.low_bit
        kept = []
        if low_bit is not None:
            idx, ok = parts[0]
            kept.append(low_bit.keep(idx, ok, 0))
        full = [(s, parts[i], offsets[i]) for i, s in enumerate(self.segments) if not s.low_bit]
        real = self.key_valid().gather(-1, indices)
        if keep_valid is not None:
            real = real & keep_valid
        counts = real.sum(-1)
        goes_flat = (low_bit is None or low_bit.flat) and (
            self.is_flat or bool((counts != counts[:, :1]).any()))
        if goes_flat:
            flat = None
            for segment, (idx, ok), offset in full:
                part = segment.keep(idx, ok, offset).to_flat(offset)
                flat = part if flat is None else flat.cat_runs(part)
            kept += [flat, self._empty_tail(flat)]
        else:
            (segment, (idx, ok), offset), = full  # rectangular: the tail is the only full-precision segment
            kept.append(segment.keep(idx, ok, offset))
        self.segments = kept
        self.compacted = True
        self.sorted = True
        self.aux = {}

    def _split(self, indices: torch.Tensor, keep_valid: torch.Tensor | None):
        """Per segment: (slot indices relative to the segment [B, Hkv, K_s], ok [B, Hkv, K_s]); each head's kept
        slots of a segment are a contiguous range of the sorted index list, padded with filler entries."""
        out, offset = [], 0
        width = indices.shape[-1]
        valid = torch.ones_like(indices, dtype=torch.bool) if keep_valid is None else keep_valid
        for segment in self.segments:
            inside = (indices >= offset) & (indices < offset + segment.width)
            first = (indices < offset).sum(-1)
            count = inside.sum(-1)
            rank = torch.arange(int(count.max()) if count.numel() else 0, device=indices.device)
            at = (first[..., None] + rank).clamp(max=max(width - 1, 0))
            ok = rank < count[..., None]
            idx = torch.where(ok, indices.gather(-1, at) - offset, 0) if width else at
            out.append((idx, (ok & valid.gather(-1, at)) if width else ok))
            offset += segment.width
        return out

    def _empty_tail(self, like: Segment) -> Segment:
        """An empty rectangular tail for a layer whose tokens now live in the flat segment `like`."""
        batch, heads = like.lengths.shape
        keys, values = like.data.keys, like.data.values
        return Segment(FullPrecision(keys.new_empty(batch, heads, 0, keys.shape[-1]),
                                     values.new_empty(batch, heads, 0, values.shape[-1])),
                       torch.zeros(batch, heads, 0, dtype=torch.int32, device=self.device), None,
                       {n: torch.zeros(batch, heads, 0, device=self.device) for n in like.state})

    def sort(self) -> None:
        """Put every head's slots back in position order (one copy), if an in-place eviction mixed them."""
        if not self.sorted:
            valid = self.key_valid()
            order = self._position_order().argsort(dim=-1, stable=True)
            self.compact(order, valid.gather(-1, order))

    def _position_order(self) -> torch.Tensor:
        """[B, Hkv, T] keys whose order is position order: in-place eviction mixes only the tail, so every slot
        before it keeps its place, and the tail's slots rank by position, its fillers first (where a flush's
        window and left padding hold them)."""
        start = self.tail_start()
        tail = self.key_positions(start).long().masked_fill(~self.key_valid(start), -1)
        before = torch.arange(start, device=tail.device) - start - 1  # below every tail key, in slot order
        return torch.cat([before.expand(*tail.shape[:2], start), tail], -1)

    def replace_newest(self, victims: torch.Tensor) -> bool:
        """Evict one slot per (row, KV head) without copying the layer: the newest slot (the tail's last, just
        appended) is written into `victims` [B, Hkv] (a victim that is the newest slot itself is simply dropped),
        and the tail shrinks by one. Slots then no longer follow position order. Returns False, changing nothing,
        when the storage cannot do it in place (a victim outside the full-precision tail, a flat tail, or a buffer
        this layer does not own). Earlier segments (flat runs, low-bit codes) may precede the tail: decode_budget
        evicts generated tokens, which all sit in the tail."""
        if self.tail.flat or self.tail.data.room is None or self.tail.num_slots < 2:
            return False
        offset = self.tail_start()
        if bool((victims < offset).any()):
            return False
        victims = victims - offset
        tail = self.tail
        batch, heads = self._shape()
        last = tail.num_slots - 1
        # (row, head) pairs flattened: the newest slot is written onto the victim's, a no-op where they coincide
        flat = torch.arange(batch * heads, device=victims.device)
        target = victims.reshape(-1)

        def moved(tensor: torch.Tensor) -> torch.Tensor:
            """A per-slot tensor [B, H, T(, ...)] with its newest slot moved to the victims and cut off."""
            out = tensor.clone()
            rows = out.view(batch * heads, tensor.shape[2], *tensor.shape[3:])
            rows[flat, target] = rows[:, last].clone()
            return out[:, :, :last].clone()

        for buffer in tail.data.room:  # keys, values: in place, in the layer's own buffer
            rows = buffer.view(batch * heads, buffer.shape[2], buffer.shape[3])
            rows[flat, target] = rows[:, last].clone()
        positions = tail.view_positions(0, batch, heads, self.device)
        # a layer that evicts in place needs one spare slot for the next token: the growth room of appends goes
        # (one copy, the first time), so the bytes held stay at budget + 1 slot
        self.segments[-1] = Segment(tail.data.truncate(last).trim(1), moved(positions),
                                    None if tail.valid is None else moved(tail.valid),
                                    {name: moved(s) for name, s in tail.state.items()})
        self.compacted, self.sorted = True, False
        self.aux = {}
        self.mark_changed()
        return True

    def to_rectangular(self) -> None:
        """Pad a flat layer back into one rectangle (invalid filler slots), for readers that index a rectangle
        (read views). Costs the widest head's memory in every head."""
        if not self.is_flat:
            return
        if self.low_bit is not None:
            raise RuntimeError("to_rectangular: a flat layer with low-bit codes cannot be padded back")
        names = {n for s in self.segments for n in s.state}
        views = (self.keys_view(), self.values_view(), self.key_positions(), self.key_valid(),
                 {n: self.get_state(n) for n in names})
        self.segments = [Segment(FullPrecision(views[0], views[1]), views[2], views[3], views[4])]
        self.aux = {}

    def flush_low_bit(self, residual: int, group: int, encode) -> None:
        """Move the oldest full-precision slots into low-bit codes via `encode(keys, values, valid)` (rectangular
        [B, Hkv, n, D], n a multiple of `group`), keeping at least `residual` newest slots in full precision
        (per head in a flat layer). Returns nothing; the low-bit segment grows."""
        self.sort()  # "oldest" is by position
        if not self.is_flat:
            # rectangular: the same number of slots in every head (fillers count as slots). Nothing to move here
            # means nothing for a flat flush either (a row's real tokens are at most its slots), so the alignment
            # check below runs once per group of new tokens, not at every decode step.
            n = ((self.stored - self.quantized_len - residual) // group) * group
            if n <= 0:
                return
        if self.is_flat or (self.low_bit is None and not self._rows_align_to(group)):
            # Flat runs group each row from its own first token and flush its own count, so a row behind padding
            # (or behind the fillers of a row that kept fewer tokens) is quantized as it is alone.
            self._flush_flat(residual, group, encode)
            return
        tail = self.tail
        # (slices are cloned: a view would keep the tail's whole tensor alive, and nbytes() would under-report it)
        moved = Segment(encode(tail.data.keys[:, :, :n], tail.data.values[:, :, :n],
                               tail.view_valid(*self._shape(), self.device)[..., :n]),
                        None if tail.positions is None else tail.positions[..., :n].clone(),
                        None if tail.valid is None else tail.valid[..., :n].clone(),
                        {name: s[..., :n].clone() for name, s in tail.state.items()})
        rest = Segment(FullPrecision(tail.data.keys[:, :, n:].clone(), tail.data.values[:, :, n:].clone()),
                       None if tail.positions is None else tail.positions[..., n:].clone(),
                       None if tail.valid is None else tail.valid[..., n:].clone(),
                       {name: s[..., n:].clone() for name, s in tail.state.items()})
        low_bit = self.low_bit
        if low_bit is not None:
            moved = Segment(low_bit.data.cat(moved.data), _cat(low_bit.positions, moved.positions),
                            _cat_valid(low_bit, moved), {name: torch.cat([low_bit.state[name], s], -1)
                                                          for name, s in moved.state.items()})
        self.segments = [moved, rest]
        self.aux = {}
        self.mark_changed()

    def _rows_align_to(self, group: int) -> bool:
        """Rectangular groups of `group` slots start at every row's first real token: each row's fillers all lead
        and come in whole groups (no padding at all, or padding that is a multiple of the group)."""
        lead = self.leading_fillers()
        if lead is None:
            return True
        return bool(((~self.key_valid()).sum(-1) == lead).all()) and bool((lead % group == 0).all())

    def _flush_flat(self, residual: int, group: int, encode) -> None:
        """Flat layer: each head moves its oldest whole groups, keeping >= residual full-precision tokens."""
        # Most decode steps move nothing (a head flushes once per `group` tokens): after a count that finds nothing
        # to move, nothing is counted again until enough tokens have arrived for the fullest head to fill a group.
        key = ("no flat flush before", residual, group)
        if key in self.aux and self.appended < self.aux[key].appended:
            return
        full_precision = sum(s.counts() for s in self.segments if not s.low_bit)
        n_move = ((full_precision - residual).clamp(min=0) // group) * group  # [B, Hkv]
        if not bool((n_move > 0).any()):
            self.aux[key] = _NoFlushBefore(self.appended + int((residual + group - full_precision).min()))
            return
        if self._flush_right_aligned_tail(full_precision, n_move, encode):
            return
        fp = self._flat_full_precision()
        grid, ok = fp.grid()
        rank = torch.arange(grid.shape[-1], device=grid.device)
        move = ok & (rank < n_move[..., None])
        width = int(n_move.max())
        # Encode the moved tokens per head (groups never span two heads): as a rectangle padded with invalid
        # fillers, which never stretch a group's range, then flattened without them.
        real = move[..., :width]
        codes = encode(fp.view(fp.data.keys)[:, :, :width], fp.view(fp.data.values)[:, :, :width], real)
        moved = Segment(codes, fp.view(fp.positions)[..., :width], real,
                        {n: fp.view(s)[..., :width] for n, s in fp.state.items()}).to_flat(0)
        low_bit = self.low_bit
        codes = moved if low_bit is None else low_bit.cat_runs(moved)
        keep = ok & ~move
        if _rows_differ_only(keep.sum(-1)):
            # the heads of each row keep the same count (a padded batch: rows differ only by their phase in the
            # group): the window as one rectangle with fillers, like left padding, read in place at every step
            self.segments = [codes, _right_aligned(fp, keep)]
        else:  # heads of a row keep different counts (a ragged eviction): flat runs, no fillers
            kept = fp.keep(*_rank_select(keep), 0)
            self.segments = [codes, kept, self._empty_tail(kept)]
        self.compacted = True  # flat runs hold explicit positions, so the tail records its own from now on
        self.aux = {}
        self.mark_changed()

    def _flush_right_aligned_tail(self, counts: torch.Tensor, n_move: torch.Tensor, encode) -> bool:
        """_flush_flat's steady state, [flat codes, a tail whose real slots end every head (leading fillers)], as
        a previous flush left it: each head's oldest tokens are the tail's first real slots, so the moved tokens
        are gathered straight from the tail, and what stays is the tail's last slots (a copy, no gather). The same
        codes and the same tokens kept as the general path. False, changing nothing, for any other layout."""
        if len(self.segments) != 2 or not self.segments[0].low_bit or not self.segments[0].flat or self.tail.flat:
            return False
        tail = self.tail
        total = tail.num_slots
        slots = torch.arange(total, device=counts.device)
        lead = total - counts
        leading_fillers_only = (not bool((lead != 0).any())) if tail.valid is None else torch.equal(
            tail.valid, slots >= lead[..., None])
        if not leading_fillers_only:
            return False
        kept = counts - n_move
        if not _rows_differ_only(kept):
            return False
        keep_width = int(kept.max())
        width = int(n_move.max())
        rank = slots[:width]
        at = (lead[..., None] + rank).clamp(max=max(total - 1, 0))  # [B, H, width]: the oldest real slots
        real = rank < n_move[..., None]
        positions = tail.view_positions(0, *self._shape(), self.device)
        codes = encode(take_slots(tail.data.keys, at), take_slots(tail.data.values, at), real)
        moved = Segment(codes, positions.gather(-1, at), real,
                        {n: s.gather(-1, at) for n, s in tail.state.items()}).to_flat(0)
        stay = slice(total - keep_width, total)
        valid = slots[stay] >= (lead + n_move)[..., None]
        self.segments = [self.segments[0].cat_runs(moved), Segment(
            FullPrecision(tail.data.keys[:, :, stay].clone(), tail.data.values[:, :, stay].clone()),
            torch.where(valid, positions[..., stay], 0),
            None if bool(valid.all()) else valid, {n: s[..., stay].clone() for n, s in tail.state.items()})]
        self.aux = {}
        self.mark_changed()
        return True

    def _flat_full_precision(self, names=()) -> Segment:
        """Every full-precision token of this layer as one flat segment (with per-slot state `names` at least)."""
        flat = None
        for segment, offset in zip(self.segments, self._offsets()):
            if not segment.low_bit:
                part = segment.to_flat(offset).with_states(names)
                flat = part if flat is None else flat.cat_runs(part)
        return flat

    # ------------------------------------------------------------------ reading
    def attention(self, queries: Queries, precision: int | None = None, use_triton: bool | None = None,
                  state=None) -> torch.Tensor:
        """Attention of `queries` over every stored slot, [B, Hq, r, D]: each segment through the kernel for its
        kind, folded into one online softmax."""
        batch, heads = self._shape()
        tail = self.tail
        first, after = self.segments[0], list(zip(self.segments, self._offsets()))[1:]
        if (first.low_bit and first.flat and after and not any(s.low_bit for s, _ in after)
                and (not any(s.flat for s, _ in after) or batch * heads * sum(s.width for s, _ in after)
                     <= GATHER_SLOTS)):
            # flat codes (a padded batch under KIVI / GEAR) and the full-precision window behind them (a flush
            # leaves it one rectangle, read in place; flat runs left by an eviction are gathered into one small
            # rectangle with it): one kernel call
            state = flat_lowbit_attention_state(queries, first.data, first.positions, first.lengths, state,
                                                precision, tail=self._rectangle(after))
            return finish(state, queries)
        # a rectangular full-precision tail (the newest tokens) is read in the same call as the segment before it
        # when that is flat full-precision runs or rectangular codes (KIVI's layout)
        before = self.segments[-2] if len(self.segments) > 1 else None
        joins_tail = before is not None and ((before.flat and not before.low_bit)
                                             or (before.low_bit and not before.flat))
        with_tail = joins_tail and not tail.low_bit and not tail.flat and tail.width > 0
        rect = (tail.data.keys, tail.data.values, tail.view_positions(self.tail_start(), batch, heads, self.device),
                tail.valid) if with_tail else None
        for segment, offset in zip(self.segments, self._offsets()):
            if segment.width == 0 or (with_tail and segment is tail):
                continue
            joined = rect if segment is before else None
            if segment.low_bit and segment.flat:
                state = flat_lowbit_attention_state(queries, segment.data, segment.positions, segment.lengths, state,
                                                    precision)
            elif segment.low_bit:
                state = lowbit_attention_state(queries, segment.data, segment.view_positions(offset, batch, heads,
                                               self.device), segment.valid, state, precision, use_triton, joined)
            elif segment.flat:
                state = flat_attention_state(queries, segment.data.keys[0, 0], segment.data.values[0, 0],
                                             segment.positions[0, 0], segment.starts(), segment.lengths, state,
                                             use_triton, joined)
            else:
                state = dense_attention_state(queries, segment.data.keys, segment.data.values,
                                              segment.view_positions(offset, batch, heads, self.device),
                                              segment.valid, state)
        return finish(empty_state(queries.grouped(self.num_kv_heads)) if state is None else state, queries)

    def _rectangle(self, segments) -> tuple | None:
        """(keys, values, positions, valid) [B, Hkv, n(, D)] of full-precision (segment, offset)s side by side in
        their padded views (a flat segment's is a transient copy; one rectangular segment's are its own tensors);
        None when they hold no slot."""
        batch, heads = self._shape()
        parts = [s.padded(offset, batch, heads, self.device) for s, offset in segments if s.width]
        if len(parts) == 1:
            return parts[0]
        return tuple(torch.cat(tensors, 2) for tensors in zip(*parts)) if parts else None

    def attend(self, read: Read, base) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The read path of one attention call: (output [B, q_len, Hq, D] in transformers' layout, the attention
        probabilities [B, Hq, q_len, T] fp32 when read.probabilities and the layer is one rectangle, else None).
        `base(query, keys, values, mask)` runs the model's own attention implementation; mask None means
        transformers' mask (valid only while slot j holds position j), UNMASKED none at all, else a boolean
        [B, Hq, q, T] mask."""
        queries = read.queries
        if read.probabilities and read.select is None and len(self.segments) == 1 and not self.tail.flat:
            return self._attend_with_probs(queries, self.tail.data.keys if read.keys is None else read.keys)
        return self._attend(read, base), None

    def _attend_with_probs(self, queries: Queries, keys: torch.Tensor):
        """Attention written out (logits, softmax, weighted values) so its probabilities come with it: what a policy
        that scores by them (H2O, TOVA) reads, without a second pass over the keys."""
        tail = self.tail
        q = queries.grouped(self.num_kv_heads)
        batch, heads, group, rows, dim = q.shape
        # each KV head's GQA group of query rows as one matrix (einsum computes the same, with more overhead)
        logits = (q.reshape(batch, heads, group * rows, dim) * queries.scaling) @ keys.float().transpose(-1, -2)
        logits = logits.view(batch, heads, group, rows, -1)
        if queries.softcap is not None:
            logits = torch.tanh(logits / queries.softcap) * queries.softcap
        if not queries.reads_every_slot(tail.valid):
            allowed = queries.allowed(self.key_positions(), tail.valid)
            logits = logits.masked_fill_(~allowed[:, :, None], float("-inf"))
        probs = logits.softmax(-1)
        out = probs.view(batch, heads, group * rows, -1) @ tail.data.values.float()
        hq = heads * group
        out = out.view(batch, hq, rows, dim).to(queries.values.dtype).transpose(1, 2).contiguous()
        return out, probs.reshape(batch, hq, rows, -1)

    def _attend(self, read: Read, base) -> torch.Tensor:
        queries = read.queries
        if read.select is not None and self.low_bit is None:
            self.to_rectangular()  # read views pick slots of a rectangle
            keys = self.keys_view() if read.keys is None else read.keys
            out = sparse_attention(queries, keys, self.values_view(), self.key_positions(), read.select())
            return out.transpose(1, 2).contiguous()
        if len(self.segments) > 1 or self.tail.flat:
            # low-bit codes or flat runs: each segment through its own kernel, one softmax. Long queries (a chunk of
            # a chunked prefill, a model-level probe's replay) run in row blocks: the kernels write out rows x slots
            # logits, which for 2K rows over 4K slots would be hundreds of MB.
            rows = queries.values.shape[2]
            outs = [self.attention(queries.rows(start, start + _MASK_ROWS), read.precision)
                    for start in range(0, rows, _MASK_ROWS)]
            return (outs[0] if len(outs) == 1 else torch.cat(outs, 2)).transpose(1, 2).contiguous()
        keys = self.tail.data.keys if read.keys is None else read.keys
        if not self.compacted:
            return base(queries.values, keys, self.tail.data.values, None)
        if queries.reads_every_slot(self.tail.valid):
            return base(queries.values, keys, self.tail.data.values, UNMASKED)
        # Slot j no longer sits at position j: transformers' mask does not describe this layer; build ours. Long
        # queries (a chunked prefill's next chunk, a long extension) run in row blocks so the mask stays small.
        positions, valid = self.key_positions(), self.tail.valid
        outs = []
        for start in range(0, queries.values.shape[2], _MASK_ROWS):
            rows = queries.rows(start, start + _MASK_ROWS)
            allowed = rows.allowed(positions, valid).repeat_interleave(rows.values.shape[1] // self.num_kv_heads, 1)
            outs.append(base(rows.values, keys, self.tail.data.values, allowed))
        return outs[0] if len(outs) == 1 else torch.cat(outs, 1)

    def key_logits(self, query: torch.Tensor, scaling: float, softcap: float | None = None, upto: int | None = None,
                   block: int = 4096, fp32_keys: dict | None = None) -> torch.Tensor:
        """fp32 logits [B, Hkv, g, r, T'] of query rows [B, Hq, r, D] against the first `upto` slots of the padded
        view (all by default), grouping query heads under their KV head; low-bit codes are read block by block.
        `fp32_keys`: a dict a caller that asks for many query blocks passes again each time, so full-precision
        keys of a low-precision model are converted once."""
        batch, hq, rows, dim = query.shape
        hkv = self.num_kv_heads
        upto = self.stored if upto is None else upto
        # scaled on the query side: r x D multiplies instead of r x T (these logits are a policy's largest work)
        q = query.reshape(batch, hkv, hq // hkv, rows, dim).float() * scaling
        parts, offset = [], 0
        for i, segment in enumerate(self.segments):
            n = min(segment.width, upto - offset)
            if n <= 0:
                break
            if segment.low_bit and not segment.flat:
                for start in range(0, n, block):
                    keys = segment.data.dequantize_keys(start, min(start + block, n))
                    parts.append(torch.einsum("bhgrd,bhtd->bhgrt", q, keys))
            else:
                keys = None if fp32_keys is None else fp32_keys.get(i)
                if keys is None:
                    keys = self._view_part(segment, values=False, dtype=torch.float32).float()
                    if fp32_keys is not None and segment.data.key_dtype != torch.float32:
                        fp32_keys[i] = keys
                parts.append(torch.einsum("bhgrd,bhtd->bhgrt", q, keys[:, :, :n]))
            offset += segment.width
        logits = parts[0] if len(parts) == 1 else torch.cat(parts, -1)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    # ------------------------------------------------------------------ bytes
    def nbytes(self) -> int:
        """Bytes held by this layer's storage tensors (keys, values or codes, positions, validity, state)."""
        return sum(t.numel() * t.element_size() for s in self.segments for t in s.tensors()) \
            if self.is_initialized else 0

    def kv_nbytes(self) -> int:
        """Bytes held by keys and values (or their codes) alone."""
        return sum(s.kv_nbytes() for s in self.segments) if self.is_initialized else 0

    # ------------------------------------------------------------------ rows of one batch
    @classmethod
    def stack(cls, layers: list["KVPressLayer"]) -> "KVPressLayer":
        """Rows of one batch from single-row layers that have seen the same tokens. Rectangular layers are
        left-padded to the widest with invalid slots (sorted order holds: fillers sit at position 0); if any
        layer is flat, every layer's tokens go flat and the runs are concatenated (no padding). Low-bit layers
        cannot be stacked."""
        if len(layers) == 1:
            return layers[0].fork()
        if len({l.seen for l in layers}) != 1:
            raise ValueError(f"stack: rows of one batch must have seen the same tokens; got {[l.seen for l in layers]}")
        if any(l.low_bit is not None for l in layers):
            raise ValueError("stack: layers holding low-bit codes cannot be stacked as rows; decode them alone")
        first = layers[0]
        out = cls()
        out.is_initialized, out.dtype, out.device = True, first.dtype, first.device
        out.seen, out.last_q_len = first.seen, first.last_q_len
        out.rollback_floor = max(l.rollback_floor for l in layers)
        out.compacted = True
        out.sorted = all(l.sorted for l in layers)
        names = sorted({n for l in layers for s in l.segments for n in s.state})
        if any(l.is_flat for l in layers):
            flats = [l._flat_full_precision(names) for l in layers]
            seg = Segment(FullPrecision(torch.cat([f.data.keys for f in flats], 2),
                                        torch.cat([f.data.values for f in flats], 2)),
                          torch.cat([f.positions for f in flats], -1),
                          state={n: torch.cat([f.state[n] for f in flats], -1) for n in names},
                          lengths=torch.cat([f.lengths for f in flats]))
            out.segments = [seg]
            out.segments.append(out._empty_tail(seg))
        else:
            width = max(l.stored for l in layers)
            pads = [width - l.stored for l in layers]
            pad = torch.nn.functional.pad
            keys = torch.cat([pad(l.keys_view(), (0, 0, p, 0)) for l, p in zip(layers, pads)])
            values = torch.cat([pad(l.values_view(), (0, 0, p, 0)) for l, p in zip(layers, pads)])
            positions = torch.cat([pad(l.key_positions(), (p, 0)) for l, p in zip(layers, pads)])
            valid = torch.cat([pad(l.key_valid(), (p, 0), value=False) for l, p in zip(layers, pads)])
            batch_heads = (1, first.num_kv_heads)
            state = {n: torch.cat([pad(l.get_state(n) if l.get_state(n) is not None else
                                       torch.zeros(*batch_heads, l.stored, device=first.device), (p, 0))
                                   for l, p in zip(layers, pads)]) for n in names}
            out.segments = [Segment(FullPrecision(keys, values), positions, valid, state)]
        if all(l.row_budget is not None for l in layers):
            out.row_budget = torch.cat([l.row_budget for l in layers])
        if any(l.padding is not None for l in layers):
            out.padding = torch.cat([l.padding if l.padding is not None else
                                     torch.zeros(l.key_positions().shape[0], dtype=torch.long, device=first.device)
                                     for l in layers])
        out.stats = {name: torch.cat([l.stats[name] for l in layers]) for name in first.stats
                     if all(name in l.stats for l in layers)}
        if len({l.decode_start for l in layers}) == 1:
            out.decode_start = first.decode_start
        return out


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """Per-segment views joined along the slot axis (no copy for a layer of one segment)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, -1)


def _cat(a, b):
    return None if a is None and b is None else torch.cat([a, b], -1)


def _cat_valid(a: Segment, b: Segment):
    if a.valid is None and b.valid is None:
        return None
    batch, heads = a.data_shape()
    return torch.cat([a.view_valid(batch, heads, a.valid.device if a.valid is not None else b.valid.device),
                      b.view_valid(batch, heads, b.valid.device if b.valid is not None else a.valid.device)], -1)


@dataclass
class _NoFlushBefore:
    """Derived state (layer.aux) of a flat flush: no head can fill a group to move before `layer.appended`
    reaches this. An append adds at most one token per head per token appended; every other change (eviction,
    rollback, forgetting observers) only removes tokens, or restructures the layer and drops aux."""

    appended: int

    def truncate(self, n: int) -> None:  # a rollback removes tokens: the bound stays safe
        pass


def _rows_differ_only(counts: torch.Tensor) -> bool:
    """Every row's heads hold the same count [B, Hkv] (rows may differ from each other, as left padding does)."""
    return bool((counts == counts[:, :1]).all())


def _right_aligned(flat: Segment, keep: torch.Tensor) -> Segment:
    """The slots of the flat segment's padded view where keep [B, H, W] as one rectangular segment whose rows
    end together: each (row, head)'s kept slots, in order, at the right end, behind leading invalid fillers (as
    a left-padded row; fillers sit at position 0). What a flat flush leaves in full precision when rows differ
    only from each other: the window is then read in place at every step instead of being gathered from runs."""
    count = keep.sum(-1)
    width = int(count.max()) if count.numel() else 0
    order, _ = _rank_select(keep)
    rank = torch.arange(width, device=keep.device) - (width - count)[..., None]
    real = rank >= 0
    slots = flat.grid()[0].gather(-1, order.gather(-1, rank.clamp(min=0)))  # [B, H, width] into the store
    data = FullPrecision(flat.data.keys[0, 0][slots], flat.data.values[0, 0][slots])  # as Segment.padded reads
    return Segment(data, torch.where(real, flat.positions[0, 0][slots], 0),
                   None if bool(real.all()) else real, {n: s[0, 0][slots] for n, s in flat.state.items()})


def _rank_select(mask: torch.Tensor):
    """(indices, ok) of the True entries of mask [B, H, W], per head, in order, padded to the widest head."""
    count = mask.sum(-1)
    width = int(count.max()) if count.numel() else 0
    order = (~mask).long().argsort(dim=-1, stable=True)[..., :width]
    ok = torch.arange(width, device=mask.device) < count[..., None]
    return order, ok
