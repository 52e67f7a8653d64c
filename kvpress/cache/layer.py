"""One layer of a KVPressCache: the tokens a layer really keeps, where each came from, and how many it has seen.

This file holds the layer's state, the transformers layer API and the storage shape; the methods delegate to files
of one concept each: view.py (the padded view policies see, per-slot state), append.py (appends to the tail),
room.py (the tail's reserved room: captured decode steps), eviction.py (keep/compact, sort, in-place eviction,
flat back to rectangle), flush.py (the low-bit flush), read.py (attention and key logits, one reader per storage
kind), rollback.py (crop); rows.py stacks single-row layers as the rows of one batch.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import CacheLayerMixin

from ..kernels.online_softmax import Queries
from . import append, eviction, flush, prefix as prefixes, rollback, room as rooms, view
from . import read as read_path  # (attend's argument is named `read`)
from .held import shared_in, storage_nbytes, tensors_in
from .read import Read
from .segments import Segment, dense


class KVPressLayer(CacheLayerMixin):
    """Keys/values of one attention layer, stored per KV head (never repeated for GQA), as an ordered list of
    storage segments (segments.py), oldest slots first, every head's slots sorted by original position (except
    after `replace_newest`, a decode-time eviction in place: then `sorted` is False until a keep() sorts again;
    what depends on order (crop, low-bit flushes) sorts first, and policies rank slots by position):

      [low-bit codes]*  [flat full precision]?  tail
    tail      rectangular full precision [B, Hkv, T, D]: where new tokens are appended (in place, with spare room,
              for one-token appends), and the only part `crop` rolls back; behind flat codes, the window a flat
              flush left, its heads' tokens ending together behind leading invalid fillers
    flat      the kept tokens of heads that keep different counts: no padding, so freed bytes equal removed tokens
    low-bit   codes of the oldest slots: rectangular, or flat (per-head runs) in a flat layer; one segment (KIVI,
              GEAR) or one per bit width (ZipCache: slot order is position order within a segment, not across)
    The layout rule lives in one place (eviction.compact): a keep() that leaves the heads of a row with different
    counts makes the layer flat unless it holds rectangular codes (then heads get invalid fillers); a flat layer
    stays flat and flushes to flat codes; rows that differ only from each other (left padding, eval configs stacked
    as rows) stay rectangular with fillers, like the padding of the prompt itself.

    Policies see one padded view over all segments (key_positions, key_valid, get_state, keys_view), the flat
    part padded to its longest head with invalid slots; slot j of that view is what keep() takes. A `prefix` (a
    one-row KVPressLayer every row shares: prefix.py) precedes the segments; the view is then the rows' own slots.
      row_budget     [B] tokens each row may keep (per KV head, on average), fixed by the policy at prefill
      decode_start   tokens seen when the prompt ended (generated tokens have positions >= it)
      seen           tokens seen so far (positions of new tokens derive from it, never from the slot count)
      appended       tokens ever appended (never steps back; bounds how far any head's count can have grown)
      last_q_len     tokens appended by the latest update (tells prefill / decode / extend apart)
      policy_stats   per-layer policy statistics, batch-first (e.g. ExpectedAttention's query moments)
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, **kwargs):
        # (CacheLayerMixin.__init__ would set keys/values attributes; this layer's storage is its segments)
        self.is_initialized = False
        self._segments: list[Segment] = []
        # slot j no longer holds position j (evicted, flat runs): segments record positions, attention masks by them
        self._explicit_positions = False
        self.room: rooms.TailRoom | None = None  # the tail's reserved room, for captured decode steps (room.py)
        self.sorted = True  # every head's slots follow original position order (false after in-place eviction)
        self.row_budget: torch.Tensor | None = None
        self.decode_start = 0
        self.derived: dict = {}  # read-side DerivedStates (Quest's page statistics): dropped on any change
        self.policy_stats: dict[str, torch.Tensor] = {}  # per-layer policy statistics, batch-first [B, ...]
        self.seen = 0
        self.appended = 0  # tokens ever appended (never steps back, unlike seen): bounds how much a head grew
        self.rollback_floor = 0  # seen at the last change other than an append: crop stops there (rollback.py)
        self.last_q_len = 0
        # [B] padding tokens each row has seen (None: none), all before the row's first token (after a shared prefix)
        self.padding: torch.Tensor | None = None
        self.prefix = None  # the context every row shares, held once (prefix.py: SharedPrefix, ParallelPrefix)
        self.copied_on_write = False  # its rows were given their own copy of a shared prefix (prefix.unshare)

    def reserve(self, n: int) -> None:  # spare room for n more tokens in the tail (a probe's: written in place)
        if self.is_initialized:
            tail = self.tail
            self.segments[-1] = dataclasses.replace(tail, data=tail.data.reserve(n))

    def checkpoint(self) -> dict:
        """This layer's state, to put back with restore(), sharing every tensor (appends go past its slots)."""
        return {**self.__dict__, "_segments": list(self._segments), "policy_stats": dict(self.policy_stats),
                "derived": {}}

    def restore(self, state: dict) -> None:
        self.__dict__.clear()
        self.__dict__.update(state)

    def fork(self) -> "KVPressLayer":
        """A copy sharing every tensor; neither copy appends into the tail's buffer in place any more."""
        out = object.__new__(type(self))
        out.__dict__.update(self.__dict__)
        self.segments = [s.detach() for s in self.segments]
        out.segments = list(self.segments)
        out.policy_stats = dict(self.policy_stats)
        out.derived = {}
        out.room = self.room = None  # a room is written in place: neither copy may keep writing into shared slots
        return out

    __copy__ = fork

    # ------------------------------------------------------------------ captured decode steps (room.py)
    @property
    def captured(self) -> bool:
        """Code traced by torch.compile for a forward whose room is prepared: it sees the tail as the whole room."""
        return torch.compiler.is_compiling() and self.room is not None and self.room.ready

    @property
    def segments(self) -> list[Segment]:  # (traced code of a captured step sees the whole room as the tail)
        return (*self._segments[:-1], self.room.segment) if self.captured else self._segments

    @segments.setter
    def segments(self, value: list[Segment]) -> None:
        if self.captured:  # (a tuple above: an item assignment fails as loudly)
            raise RuntimeError("a captured decode step cannot restructure a layer (the host does, after it: room.py)")
        self._segments = value

    @property
    def tail_exact(self) -> Segment:  # the tail as eager code sees it (its filled slots), traced or not
        return self._segments[-1]

    @property
    def explicit_positions(self) -> bool:
        return self._explicit_positions or self.captured  # a room's unfilled slots are masked by position

    @explicit_positions.setter
    def explicit_positions(self, value: bool) -> None:
        self._explicit_positions = value

    def first_new_slot(self, q_len: int):
        """View slot of the first of the forward's q_len new tokens (an int; a device tensor in a captured step)."""
        if self.captured:
            return self.tail_start() + self.room.counters[0] + self.room.pending - q_len
        return self.view_width - q_len

    def newest_positions(self, n: int) -> torch.Tensor:
        """[n] positions of the newest n tokens seen (a captured step reads them from the room's counters)."""
        return self.get_seq_length() - n + torch.arange(n, device=self.device)

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
        if self.room is not None and self.room.ready:  # prepared: append by index into the room (room.py)
            rooms.append(self, self.room, key_states, value_states, new_valid)
            if not torch.compiler.is_compiling():  # eager: count it now (a traced step: the host, after the graph)
                self.room.derived.clear()  # read-side state a captured step updates in place: rebuilt before one
                rooms.settle(self)
            return self.tail.data.keys, self.tail.data.values
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        append.to_tail(self, key_states, value_states, new_valid)
        return self.tail.data.keys, self.tail.data.values

    def get_seq_length(self) -> int:
        # Tokens SEEN, not stored: generate derives new positions from it, and eviction must not shift them. (A
        # captured step's count is on the device, as transformers' StaticLayer gives its own.)
        if self.captured:
            return self.room.counters[1] + self.room.pending
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Same contract as transformers' sliding-window layer: stored slots + new tokens, offset by the gap. (A
        # captured step masks by the room's positions, never by this mask: no count that changes per step.)
        if self.captured:
            return self.view_width + query_length, 0
        return self.view_width + query_length, self.seen - self.view_width

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__()

    def crop(self, tokens_to_remove: int) -> None:
        """crop(-n) forgets the last n tokens seen, crop(n > 0) keeps the first n; refused (ValueError, nothing
        changed) where it would not give back the layer as it was (rollback.py)."""
        rollback.crop(self, tokens_to_remove)

    def mark_changed(self) -> None:
        """The layer just changed in a way a rollback cannot undo (evicted, re-encoded, rescored earlier slots)."""
        if self.captured:
            self.room.changed = True  # the host marks it when it counts the step (room.settle)
            return
        self.rollback_floor = self.seen

    def token_index(self) -> torch.Tensor:
        """[B, Hkv, T] each slot's index among its row's own tokens (its position minus the row's padding): what
        the slot's position would be if the row ran alone."""
        positions = self.key_positions()
        return positions if self.padding is None else positions - self.padding.view(-1, 1, 1).to(positions.dtype)

    def forget_newest(self, n: int) -> None:
        """Forget the `n` newest tokens seen (observation tokens), wherever their slots are; seen steps back."""
        rollback.forget_newest(self, n)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_rows(lambda t: t.index_select(0, indices.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def share_prefix(self) -> None:  # (prefix.py)
        prefixes.share(self)

    def unshare(self) -> None:
        prefixes.unshare(self)

    def offload(self) -> None:
        self.segments, self.room = [s.to("cpu") for s in self.segments], None

    def prefetch(self) -> None:
        self.segments = [s.to(self.device) for s in self.segments]

    def _map_rows(self, fn) -> None:
        self.segments, self.room = [s.map_rows(fn) for s in self.segments], None
        if self.row_budget is not None:
            self.row_budget = fn(self.row_budget)
        if self.padding is not None:
            self.padding = fn(self.padding)
        self.policy_stats = {name: fn(t) for name, t in self.policy_stats.items()}
        self.derived = {}

    # ------------------------------------------------------------------ storage shape
    @property
    def tail(self) -> Segment:
        return self.segments[-1]

    @property
    def codes(self) -> list[Segment]:
        """The segments of low-bit codes, which lead the layer: none, one, or one per bit width (flush.py)."""
        return [s for s in self.segments if s.low_bit]

    @property
    def is_flat(self) -> bool:
        """Heads hold different numbers of tokens: the kept tokens live in flat per-head runs."""
        return any(s.flat for s in self.segments)

    @property
    def view_width(self) -> int:
        """Width of the padded view: the longest flat run + every rectangular slot."""
        return sum(s.width for s in self.segments)

    @property
    def quantized_len(self) -> int:
        return sum(s.width for s in self.codes)

    @property
    def num_kv_heads(self) -> int:
        return self.tail.data.keys.shape[1]

    @property
    def stock_readable(self) -> bool:
        """A model's own attention can read this layer: one full-precision rectangle whose slot j holds position j
        (nothing evicted, nothing low-bit, no flat runs)."""
        return not self.explicit_positions and len(self.segments) <= 1 and not (self.segments and self.tail.flat) \
            and self.prefix is None

    def offsets(self) -> list[int]:
        """Each segment's first slot in the padded view."""
        widths = [s.width for s in self.segments]
        return [sum(widths[:i]) for i in range(len(widths))]

    @property
    def batch_heads(self) -> tuple[int, int]:
        """(B, Hkv) of every segment's padded view."""
        return self.tail.data.batch_heads

    def tail_start(self) -> int:
        """The padded view's first slot of the tail (where appended tokens go)."""
        return self.view_width - self.tail.width

    # ------------------------------------------------------------------ the padded view and per-slot state (view.py)
    def key_positions(self, start: int = 0) -> torch.Tensor:
        """int32 [B, Hkv, T]: original position of every slot of the padded view (fillers at 0), from slot `start`."""
        return view.key_positions(self, start)

    def key_valid(self, start: int = 0) -> torch.Tensor:
        """[B, Hkv, T] which slots of the padded view (from slot `start` on) hold real tokens."""
        return view.key_valid(self, start)

    def key_valid_or_none(self) -> torch.Tensor | None:
        """key_valid(), or None when every slot of the view is a real token (masks can skip the check)."""
        return view.key_valid_or_none(self)

    def leading_fillers(self) -> torch.Tensor | None:
        return view.leading_fillers(self)

    def generated_in_tail(self) -> bool:
        return view.generated_in_tail(self)

    def keys_view(self) -> torch.Tensor:
        """[B, Hkv, T, D] keys of the padded view (a transient copy unless the layer is one rectangle)."""
        return view.keys_view(self)

    def values_view(self) -> torch.Tensor:
        return view.values_view(self)

    def tokens_per_head(self) -> torch.Tensor:
        """[B, Hkv] real tokens kept in each head."""
        return view.tokens_per_head(self)

    def get_state(self, name: str, start: int = 0) -> torch.Tensor | None:
        """Per-slot policy state [B, Hkv, T] over the padded view, or None if the policy never set it."""
        return view.get_state(self, name, start)

    def set_state(self, name: str, state: torch.Tensor) -> None:
        view.set_state(self, name, state)

    def add_state(self, name: str, values: torch.Tensor) -> None:
        view.add_state(self, name, values)

    def set_newest_state(self, name: str, values: torch.Tensor) -> None:
        view.set_newest_state(self, name, values)

    def drop_state(self, name: str) -> None:
        view.drop_state(self, name)

    # ------------------------------------------------------------------ eviction (eviction.py)
    def keep(self, indices: torch.Tensor, keep_valid: torch.Tensor | None = None) -> None:
        """Evict: compact storage to `indices` [B, Hkv, T'] (view slots to keep per row and KV head; `keep_valid`
        False marks fillers kept to stay rectangular). Frees the rest; a rollback cannot go back before it."""
        self.compact(indices, keep_valid)
        self.mark_changed()

    def compact(self, indices: torch.Tensor, keep_valid: torch.Tensor | None = None) -> None:
        """keep() without marking a change: for what keeps the same tokens (sorting) or rolls back (crop)."""
        eviction.compact(self, indices, keep_valid)

    def sort(self) -> None:
        eviction.sort(self)

    def replace_newest(self, victims: torch.Tensor) -> bool:
        """Evict one slot per (row, KV head) in place: the newest slot is written into `victims` [B, Hkv]. False,
        changing nothing, where the storage cannot do it in place."""
        return eviction.replace_newest(self, victims)

    def to_rectangular(self) -> None:
        eviction.to_rectangular(self)

    # ------------------------------------------------------------------ low-bit flush (flush.py)
    def flush_low_bit(self, residual: int, group: int, encode, partition=None) -> None:
        """Move the oldest full-precision slots into low-bit codes via `encode(keys, values, valid)`, keeping at
        least `residual` newest slots in full precision (with `partition`: one encoder per bit width, flush.py)."""
        flush.flush_low_bit(self, residual, group, encode, partition)

    # ------------------------------------------------------------------ reading (read.py)
    def attention(self, queries: Queries, precision: int | None = None, use_triton: bool | None = None,
                  state=None) -> torch.Tensor:
        """Attention of `queries` over every stored slot, [B, Hq, r, D]."""
        return read_path.attention(self, queries, precision, use_triton, state)

    def attend(self, read: Read, base) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The read path of one attention call (output, probabilities or None); `base` runs the model's own
        attention."""
        return read_path.attend(self, read, base)

    def key_logits(self, query: torch.Tensor, scaling: float, softcap: float | None = None, upto: int | None = None,
                   block: int = 4096, fp32_keys: dict | None = None) -> torch.Tensor:
        """fp32 logits [B, Hkv, g, r, T'] of query rows [B, Hq, r, D] against the first `upto` slots of the view."""
        return read_path.key_logits(self, query, scaling, softcap, upto, block, fp32_keys)

    # ------------------------------------------------------------------ bytes
    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer holds: its segments, per-layer policy state and counters, read-side state derived
        from the storage, a capture room (reserved slots included). nbytes() counts their distinct allocations."""
        held = [t for s in self._segments for t in s.tensors()] + list(self.policy_stats.values())
        held += [t for t in (self.padding, self.row_budget) if t is not None] + tensors_in(self.derived)
        held += self.prefix.held_tensors() if self.prefix is not None else []  # (one copy, whatever the rows)
        return held + (self.room.tensors() if self.room is not None else [])

    def nbytes(self) -> int:
        return storage_nbytes(self.held_tensors()) if self.is_initialized else 0

    def shared_tensors(self) -> list[torch.Tensor]:
        """Tables this layer reads that the model owns (CommVQ's codebooks, a calibration's channels): reported apart
        from nbytes(), once for every cache of the model (KVPressCache.shared_nbytes)."""
        shared = [t for s in self._segments for t in s.data.shared_tensors()] + shared_in(self.derived)
        return shared + (self.prefix.shared_tensors() if self.prefix is not None else [])

    def kv_nbytes(self) -> int:
        """Bytes held by keys and values (or their codes) alone."""
        return sum(s.kv_nbytes() for s in self.segments) if self.is_initialized else 0
