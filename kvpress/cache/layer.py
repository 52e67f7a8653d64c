"""One layer of a KVPressCache: the tokens a layer really keeps, where each came from, and how many it has seen."""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from .codecs import QuantizedSegment
from .ragged import RaggedSegment


class KVPressLayer(CacheLayerMixin):
    """Keys/values of one attention layer, stored per KV head (never repeated for GQA).

    Storage, oldest slots first; slots are sorted by original position in every head:
      ragged         heads that keep different numbers of tokens, stored flat without padding (a
                     RaggedSegment with its own positions and per-slot state); None while storage is rectangular
      quantized      the oldest Tq rectangular slots in low-bit form (a QuantizedSegment), None without a codec
                     (a layer never holds both: codecs need rectangular heads)
      keys, values   [B, Hkv, Tr, D]  the newest slots in full precision
    Per-slot tensors of the rectangular part (quantized + keys/values, width Tq + Tr):
      positions      [B, Hkv, Tq+Tr]  original (raw, pre-eviction) index of each slot; None while the layer
                                      still holds every token it has seen, in order (then it is arange(T))
      valid          [B, Hkv, Tq+Tr]  False for left padding and for filler slots (rectangular rows whose budget
                                      is below the batch's widest row); None while every slot is a real token
      slot_state     name -> [B, Hkv, Tq+Tr] per-slot tensors a policy keeps in step with the slots (read and
                                      write them with get_state / set_state, which span the ragged part too)
    Policies see one padded view over all parts (key_positions, key_valid, get_state, keys_view: the ragged
    part padded to its longest head with invalid slots); slot j of that view is what keep() takes.
      row_budget     [B] tokens each row may keep (per KV head, on average), fixed by the policy at prefill
      decode_start   tokens seen when the prompt ended (generated tokens have positions >= it)
      seen           tokens seen so far (positions of new tokens derive from it, never from T)
      last_q_len     tokens appended by the latest update (tells prefill / decode / extend apart)
    `keys` / `values` may be the filled prefix of a larger buffer the layer allocated itself: one-token appends
    (decode) get spare room, so a generated token is written in place instead of copying the layer (torch.cat
    copies it all, every step). Multi-token appends and compactions allocate exactly; nbytes() counts the room.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, **kwargs):
        super().__init__()
        self.quantized: QuantizedSegment | None = None
        self.ragged: RaggedSegment | None = None
        self.positions: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self.slot_state: dict[str, torch.Tensor] = {}
        self.row_budget: torch.Tensor | None = None
        self.decode_start = 0
        self.aux: dict = {}  # derived read-side state (e.g. per-page key statistics); dropped on compaction
        self.seen = 0
        self.last_q_len = 0

    # Assigning keys/values (a compaction, a batch reorder...) replaces the storage: the buffer this layer wrote
    # in place is dropped, so tensors it did not allocate are never written into.
    @property
    def keys(self) -> torch.Tensor | None:
        return self._keys

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._keys, self._room = tensor, None

    @property
    def values(self) -> torch.Tensor | None:
        return self._values

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._values, self._room = tensor, None

    def __copy__(self):
        # A shallow copy shares the buffer: neither copy may append into it in place any more.
        out = object.__new__(type(self))
        out.__dict__.update(self.__dict__)
        out._room = self._room = None
        return out

    # ------------------------------------------------------------------ transformers layer API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads, _, dim = key_states.shape
        self.keys = key_states.new_empty(batch, heads, 0, dim)
        self.values = value_states.new_empty(batch, heads, 0, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states, value_states, *args, new_valid: torch.Tensor | None = None, **kwargs):
        """Append `q_len` new tokens. `new_valid` [B, q_len] marks which are real (not padding)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch, heads, q_len, _ = key_states.shape
        rect_before = self.rect_len
        self._append_kv(key_states, value_states)
        if self.positions is not None:
            new_pos = torch.arange(self.seen, self.seen + q_len, device=self.device, dtype=self.positions.dtype)
            self.positions = torch.cat([self.positions, new_pos.expand(batch, heads, q_len)], dim=-1)
        if new_valid is not None and (self.valid is not None or not bool(new_valid.all())):
            if self.valid is None:
                self.valid = torch.ones(batch, heads, rect_before, dtype=torch.bool, device=self.device)
            new_valid = new_valid.to(device=self.device, dtype=torch.bool)[:, None, :].expand(batch, heads, q_len)
            self.valid = torch.cat([self.valid, new_valid], dim=-1)
        elif self.valid is not None:
            self.valid = torch.cat([self.valid, self.valid.new_ones(batch, heads, q_len)], dim=-1)
        for name, state in self.slot_state.items():
            self.slot_state[name] = torch.cat([state, state.new_zeros(batch, heads, q_len)], dim=-1)
        self.seen += q_len
        self.last_q_len = q_len
        return self.keys, self.values

    @staticmethod
    def _spare_slots(n: int) -> int:
        """Room added when a one-token append outgrows the buffer: amortised O(1) copies per token."""
        return max(64, n // 16)

    def _append_kv(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        filled = self._keys.shape[-2]
        need = filled + key_states.shape[-2]
        room = self._room
        if room is not None and room[0].shape[-2] >= need:
            room[0][:, :, filled:need] = key_states
            room[1][:, :, filled:need] = value_states
        else:
            capacity = need + (self._spare_slots(need) if key_states.shape[-2] == 1 else 0)
            room = tuple(self._grown(old, new, capacity) for old, new in
                         ((self._keys, key_states), (self._values, value_states)))
        self._keys, self._values = room[0][:, :, :need], room[1][:, :, :need]
        self._room = room

    @staticmethod
    def _grown(old: torch.Tensor, new: torch.Tensor, capacity: int) -> torch.Tensor:
        batch, heads, filled, dim = old.shape
        buffer = old.new_empty(batch, heads, capacity, dim)
        buffer[:, :, :filled] = old
        buffer[:, :, filled:filled + new.shape[-2]] = new
        return buffer

    def get_seq_length(self) -> int:
        # Tokens SEEN, not stored: generate derives new positions from it, and eviction must not shift them.
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Same contract as transformers' sliding-window layer: stored slots + new tokens, offset by the gap.
        return self.stored + query_length, self.seen - self.stored

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False
        self.quantized = self.ragged = self.positions = self.valid = self.row_budget = None
        self.slot_state = {}
        self.aux = {}
        self.seen = self.last_q_len = self.decode_start = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Roll back the most recent tokens: `crop(-n)` forgets the last n seen, `crop(n)` (n > 0) keeps the
        first n seen (transformers' legacy meaning). Only the uncommitted tail can be rolled back; tokens
        evicted earlier are gone for good."""
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        new_seen = self.seen + tokens_to_remove if tokens_to_remove < 0 else tokens_to_remove
        if not 0 <= new_seen <= self.seen:
            raise ValueError(f"crop(tokens_to_remove={tokens_to_remove}) is out of range for {self.seen} seen tokens")
        # Slots are sorted by position in every head, so the tail to drop is a suffix, of equal length in every
        # head only if the rolled-back tokens were all still stored: require that.
        n_drop = (self.key_positions() >= new_seen).sum(-1)
        if bool((n_drop != n_drop.flatten()[0]).any()):
            raise RuntimeError("crop: the rolled-back tokens were partly evicted; only an unevicted tail can be cropped")
        keep = self.stored - int(n_drop.flatten()[0])
        if keep < self.ragged_len + self.quantized_len:
            raise RuntimeError("crop: the rolled-back tokens reach into the quantized or ragged segment; only the "
                               "full-precision residual can be rolled back")
        self._truncate(keep)
        self.seen = new_seen

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        self._map_tensors(lambda t: t.index_select(0, indices.to(t.device)), include_rows=True)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if not self.is_initialized:
            return
        self._map_tensors(lambda t: t.repeat_interleave(repeats, dim=0), include_rows=True)

    # ------------------------------------------------------------------ kvpress API
    @property
    def stored(self) -> int:
        """Width of the padded view: the longest ragged head + every rectangular slot."""
        return self.ragged_len + self.rect_len

    @property
    def rect_len(self) -> int:
        return self.quantized_len + (0 if self.keys is None else self.keys.shape[-2])

    @property
    def ragged_len(self) -> int:
        return 0 if self.ragged is None else self.ragged.width

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def quantized_len(self) -> int:
        return 0 if self.quantized is None else self.quantized.num_slots

    @property
    def is_compacted(self) -> bool:
        """True once any token was evicted: slot j no longer sits at position j."""
        return self.positions is not None

    def key_positions(self) -> torch.Tensor:
        """[B, Hkv, T] original position of every slot of the padded view (fillers sit at 0)."""
        if self.positions is not None:
            rect = self.positions
        else:
            batch, heads = self.keys.shape[:2]
            rect = torch.arange(self.rect_len, device=self.keys.device).expand(batch, heads, self.rect_len)
        if self.ragged is None:
            return rect
        return torch.cat([self.ragged.padded(self.ragged.positions).to(rect.dtype), rect], -1)

    def key_valid(self) -> torch.Tensor:
        """[B, Hkv, T] which slots of the padded view hold real tokens."""
        if self.valid is not None:
            rect = self.valid
        else:
            batch, heads = self.keys.shape[:2]
            rect = torch.ones(batch, heads, self.rect_len, dtype=torch.bool, device=self.keys.device)
        if self.ragged is None:
            return rect
        return torch.cat([self.ragged.index_grid()[1], rect], -1)

    def key_valid_or_none(self) -> torch.Tensor | None:
        """key_valid(), or None when every slot of the view is a real token (masks can skip the check)."""
        return None if self.valid is None and self.ragged is None else self.key_valid()

    def keys_view(self) -> torch.Tensor:
        """[B, Hkv, T', D] full-precision keys a policy may score: the stored residual, behind the padded ragged
        part when there is one (a transient copy). Quantized slots are not included (use key_logits)."""
        if self.ragged is None:
            return self.keys
        return torch.cat([self.ragged.padded(self.ragged.keys), self.keys], 2)

    def values_view(self) -> torch.Tensor:
        if self.ragged is None:
            return self.values
        return torch.cat([self.ragged.padded(self.ragged.values), self.values], 2)

    def get_state(self, name: str) -> torch.Tensor | None:
        """Per-slot policy state [B, Hkv, T] over the padded view, or None if the policy never set it."""
        if name not in self.slot_state:
            return None
        rect = self.slot_state[name]
        if self.ragged is None:
            return rect
        return torch.cat([self.ragged.padded(self.ragged.state[name]), rect], -1)

    def set_state(self, name: str, state: torch.Tensor) -> None:
        """Store per-slot policy state given over the padded view [B, Hkv, T]."""
        if self.ragged is None:
            self.slot_state[name] = state
            return
        width = self.ragged_len
        flat = state[..., :width][self.ragged.index_grid()[1]]
        # a new segment object: layers cloned by evals share the old one
        self.ragged = RaggedSegment(self.ragged.keys, self.ragged.values, self.ragged.positions,
                                    self.ragged.lengths, {**self.ragged.state, name: flat})
        self.slot_state[name] = state[..., width:]

    def tokens_per_head(self) -> torch.Tensor:
        """[B, Hkv] real tokens kept in each head."""
        return self.key_valid().sum(-1)

    def keep(self, indices: torch.Tensor, keep_valid: torch.Tensor | None = None) -> None:
        """Compact storage to `indices` [B, Hkv, T'] (slots to keep, per row and KV head). `keep_valid`
        [B, Hkv, T'] flags slots kept only to make rows rectangular; they become invalid. Frees the rest."""
        batch, heads = self.keys.shape[:2]
        if indices.dim() != 3 or indices.shape[:2] != (batch, heads):
            raise ValueError(f"keep: indices must be [B={batch}, Hkv={heads}, T'], got {tuple(indices.shape)}")
        indices, order = indices.sort(dim=-1)  # keep slots sorted by position
        if keep_valid is not None:
            keep_valid = keep_valid.gather(-1, order)
        if self.quantized is None:
            real = self.key_valid().gather(-1, indices)
            if keep_valid is not None:
                real = real & keep_valid
            counts = real.sum(-1)
            # Heads of a row that keep different counts go flat (no padding to the longest head). Rows that only
            # differ from each other (left padding, configs stacked by evals) stay rectangular with filler slots,
            # like the padding of the prompt itself, and keep the fast dense decode path.
            if self.ragged is not None or bool((counts != counts[:, :1]).any()):
                self._keep_ragged(indices, real)
                return
        width_q = 0
        if self.quantized is not None:
            indices, keep_valid, width_q = self._keep_segments(indices, keep_valid)
        positions = self.key_positions().to(torch.int32)
        valid = None if self.valid is None else self.valid.gather(-1, indices)
        if keep_valid is not None and not bool(keep_valid.all()):
            valid = keep_valid if valid is None else valid & keep_valid
        n_q = self.quantized_len
        if self.quantized is not None:
            real = None if keep_valid is None else keep_valid[..., :width_q]
            self.quantized = self.quantized.gather(indices[..., :width_q], real)
        residual_idx = indices[..., width_q:] - n_q
        self.keys, self.values = self._take_slots(self.keys, residual_idx), self._take_slots(self.values, residual_idx)
        self.positions = positions.gather(-1, indices)
        self.valid = valid
        self.slot_state = {name: s.gather(-1, indices) for name, s in self.slot_state.items()}
        self.aux = {}

    @staticmethod
    def _take_slots(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """tensor[b, h, indices[b, h, t]] as a new [B, H, T', D] tensor. Whole D-rows are copied by one flat
        index_select over the storage (a gather with indices expanded over D reads an index per element and is
        about 5x slower); `tensor` may be the filled prefix of a larger buffer."""
        batch, heads, _, dim = tensor.shape
        if tensor.stride(-1) != 1 or tensor.stride(-2) != dim or any(
                n % dim for n in (tensor.stride(0), tensor.stride(1), tensor.storage_offset())):
            tensor = tensor.contiguous()
        rows = tensor.as_strided((tensor.untyped_storage().nbytes() // (tensor.element_size() * dim), dim), (dim, 1), 0)
        first = (tensor.storage_offset()
                 + torch.arange(batch, device=indices.device)[:, None, None] * tensor.stride(0)
                 + torch.arange(heads, device=indices.device)[None, :, None] * tensor.stride(1)) // dim
        return rows.index_select(0, (indices + first).flatten()).view(batch, heads, indices.shape[-1], dim)

    def _keep_ragged(self, indices, real):
        """Compact into a flat RaggedSegment: exactly the real kept slots, no fillers; the residual empties."""
        batch, heads, rect, dim = self.keys.shape
        width = self.ragged_len
        slot = indices[real]  # view slot of every kept token, in (row, head, position) order
        head = torch.arange(batch * heads, device=indices.device).view(batch, heads, 1).expand_as(indices)[real]
        from_ragged = slot < width
        src_rect = (head * rect + slot - width)[~from_ragged]
        if self.ragged is not None:
            src_ragged = (self.ragged.starts().flatten()[head] + slot)[from_ragged]

        def pick(ragged_flat, rect_tensor):
            out = rect_tensor.new_zeros(slot.shape[0], *rect_tensor.shape[3:])
            if ragged_flat is not None:
                out[from_ragged] = ragged_flat[src_ragged]
            out[~from_ragged] = rect_tensor.reshape(batch * heads * rect, *rect_tensor.shape[3:])[src_rect]
            return out

        rect_positions = self.key_positions()[..., width:].to(torch.int32)
        old = self.ragged
        self.ragged = RaggedSegment(
            pick(old and old.keys, self.keys), pick(old and old.values, self.values),
            pick(old and old.positions, rect_positions), real.sum(-1),
            {name: pick(old and old.state.get(name), state) for name, state in self.slot_state.items()},
        )
        self.keys = self.keys.new_empty(batch, heads, 0, dim)
        self.values = self.values.new_empty(batch, heads, 0, self.values.shape[-1])
        self.positions = rect_positions.new_empty(batch, heads, 0)
        self.valid = None
        self.slot_state = {name: s.new_empty(batch, heads, 0) for name, s in self.slot_state.items()}
        self.aux = {}

    def to_rectangular(self) -> None:
        """Pad ragged heads back into the rectangular layout (invalid filler slots), for readers that index a
        rectangle (low-bit codecs, read views). Costs the widest head's memory in every head."""
        # every view first: each one reads the current split between the ragged and rectangular parts
        views = (self.keys_view(), self.values_view(), self.key_positions().to(torch.int32), self.key_valid(),
                 {name: self.get_state(name) for name in self.slot_state})
        self.keys, self.values, self.positions, self.valid, self.slot_state = views
        self.ragged = None
        self.aux = {}

    def _keep_segments(self, indices, keep_valid):
        """Kept slots of each row/head split into quantized and full-precision parts; rows/heads that keep
        fewer in a part get invalid filler slots there, so both parts stay rectangular and aligned."""
        n_q = self.quantized_len
        width = indices.shape[-1]
        in_q = (indices < n_q).sum(-1)  # [B, H]; sorted, so quantized slots come first
        width_q, width_r = int(in_q.max()), int((width - in_q).max())
        rank_q = torch.arange(width_q, device=indices.device)
        rank_r = torch.arange(width_r, device=indices.device)
        q_idx = indices.gather(-1, rank_q.expand(*indices.shape[:2], width_q).clamp(max=width - 1))
        q_ok = rank_q < in_q[..., None]
        r_pos = (in_q[..., None] + rank_r).clamp(max=width - 1)
        r_idx = indices.gather(-1, r_pos)
        r_ok = rank_r < (width - in_q)[..., None]
        valid = torch.ones_like(indices, dtype=torch.bool) if keep_valid is None else keep_valid
        new_valid = torch.cat([q_ok & valid.gather(-1, rank_q.expand_as(q_idx).clamp(max=width - 1)),
                               r_ok & valid.gather(-1, r_pos)], -1)
        new_idx = torch.cat([torch.where(q_ok, q_idx, 0), torch.where(r_ok, r_idx, n_q)], -1)
        return new_idx, new_valid, width_q

    def quantize_oldest(self, n: int, encode) -> None:
        """Move the oldest `n` full-precision slots into the quantized segment via `encode(k, v, valid)`."""
        if n <= 0:
            return
        if self.ragged is not None:
            # Low-bit groups span the same slots in every head: pad ragged heads back to a rectangle with invalid
            # fillers (only left-padded batch rows get here; per-head budgets + codec is refused at validation).
            self.to_rectangular()
        start = self.quantized_len
        segment = encode(self.keys[:, :, :n], self.values[:, :, :n], self.key_valid()[..., start:start + n])
        self.quantized = segment if self.quantized is None else self.quantized.append(segment)
        self.keys = self.keys[:, :, n:].clone()
        self.values = self.values[:, :, n:].clone()
        self.aux = {}

    def key_logits(self, query: torch.Tensor, scaling: float, softcap: float | None = None,
                   upto: int | None = None, block: int = 4096, residual_fp32: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """fp32 logits [B, Hkv, g, r, T'] of query rows [B, Hq, r, D] against the first `upto` slots (all by
        default), grouping query heads under their KV head; the quantized part is read block by block.
        `residual_fp32`: `keys.float()` computed once by a caller that asks for many query blocks."""
        batch, hq, rows, dim = query.shape
        hkv = self.keys.shape[1]
        upto = self.stored if upto is None else upto
        # scaled on the query side: r x D multiplies instead of r x T (these logits are a policy's largest work)
        q = query.reshape(batch, hkv, hq // hkv, rows, dim).float() * scaling
        parts = []
        if self.ragged is not None:  # (never together with a quantized segment)
            keys = self.keys_view()[:, :, :upto].float()
            parts.append(torch.einsum("bhgrd,bhtd->bhgrt", q, keys))
            upto = 0
        for start in range(0, min(upto, self.quantized_len), block):
            keys = self.quantized.dequantize_keys(start, min(start + block, upto, self.quantized_len))
            parts.append(torch.einsum("bhgrd,bhtd->bhgrt", q, keys))
        if upto > self.quantized_len:
            keys = self.keys if residual_fp32 is None else residual_fp32
            parts.append(torch.einsum("bhgrd,bhtd->bhgrt", q, keys[:, :, : upto - self.quantized_len].float()))
        logits = parts[0] if len(parts) == 1 else torch.cat(parts, -1)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    def nbytes(self) -> int:
        """Bytes held by this layer's storage tensors (keys, values, positions, validity, policy state)."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def kv_nbytes(self) -> int:
        """Bytes held by keys and values alone."""
        if not self.is_initialized:
            return 0
        quantized = 0 if self.quantized is None else self.quantized.nbytes()
        quantized += 0 if self.ragged is None else self.ragged.kv_nbytes()
        return quantized + sum(t.numel() * t.element_size() for t in self._kv_storage())

    # ------------------------------------------------------------------ internals
    def _kv_storage(self) -> tuple:
        """The full-precision K/V tensors as allocated: the buffers with their spare room, if any."""
        return (self._keys, self._values) if self._room is None else self._room

    def _tensors(self):
        if not self.is_initialized:
            return []
        extra = [t for t in (self.positions, self.valid) if t is not None]
        quantized = [] if self.quantized is None else self.quantized.tensors()
        quantized += [] if self.ragged is None else self.ragged.tensors()
        return [*self._kv_storage(), *quantized, *extra, *self.slot_state.values()]

    def _truncate(self, n: int) -> None:
        """Keep the first n slots of the view (all ragged and quantized ones among them). K/V in the layer's own
        buffer just shrink their view (the rest becomes spare room, counted by nbytes()); anything else is cloned:
        a view would keep the whole old tensor alive and nbytes() would under-report it."""
        view_n, n = n, n - self.ragged_len
        r = n - self.quantized_len
        if self._room is not None:
            self._keys, self._values = self._room[0][:, :, :r], self._room[1][:, :, :r]
        else:
            self.keys = self.keys[:, :, :r].clone()
            self.values = self.values[:, :, :r].clone()
        if self.positions is not None:
            self.positions = self.positions[..., :n].clone()
        if self.valid is not None:
            self.valid = self.valid[..., :n].clone()
        self.slot_state = {name: s[..., :n].clone() for name, s in self.slot_state.items()}
        for derived in self.aux.values():
            derived.truncate(view_n)

    def _map_tensors(self, fn, include_rows: bool = False) -> None:
        self.keys, self.values = fn(self.keys), fn(self.values)
        if self.quantized is not None:
            self.quantized = self.quantized.map_rows(fn)
        if self.ragged is not None:
            self.ragged = self.ragged.map_rows(fn)
        if self.positions is not None:
            self.positions = fn(self.positions)
        if self.valid is not None:
            self.valid = fn(self.valid)
        self.slot_state = {name: fn(s) for name, s in self.slot_state.items()}
        if include_rows and self.row_budget is not None:
            self.row_budget = fn(self.row_budget)
        self.aux = {}
