"""ShadowKV storage (Sun et al. 2025): the prompt's keys as a low-rank factorisation, its values in a file tier.

One segment holds a layer's whole prompt. What stays in memory (the primary tier):
  coeffs     [B, 1, W, r]   each slot's coefficients over the row's rank-r basis of pre-RoPE keys (the SVD of the
                            row's keys with every KV head side by side, [T, Hkv * D], as the paper's; fillers 0)
  basis      [B, Hkv, r, D] singular values times right singular vectors, per KV head
  rope       [B, W]         each slot's RoPE position, to rotate a rebuilt key exactly as the model did
  landmarks  [B, Hkv, N, D] the mean post-RoPE key of each selectable chunk (`chunk_size` slots counted from the row's
                            first real slot), with the chunk's first slot and whether the entry is real (rows of a
                            padded batch hold different chunk counts)
  exact      keys and values of the slots always read exactly: the outlier chunks (whose keys stray most from their
             chunk's mean) and the local chunks at the prompt's end
The values of every slot live in a memory-mapped file (`FileTier`), so their bytes leave RAM: a read touches only
the pages of the chunks it selects. `nbytes()` counts the primary tier; `offloaded_nbytes()` the file.

A read (any number of query rows) scores the landmarks (softmax of q . landmark per query head, summed over the rows,
max over the GQA group), takes the top `select` chunks per KV head, rebuilds their keys (coeffs . basis, then RoPE at
their positions) and fetches their values from the file, and folds them and the exact slots into one online softmax.
The segment keeps every token: it is never gathered, concatenated or flattened (a policy that evicts cannot compose
with it; the policy refuses that first).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..formats.slots import take_slots
from ..kernels.online_softmax import dense_attention_state
from ..positions import apply_rotary
from .segments import Segment, dense

SHADOW = "shadow"


class FileTier:
    """Tensors moved into files of a folder and memory-mapped back: pages the OS may drop from RAM and read again
    on demand. Each file is unlinked once mapped (the mapping keeps it alive until the tensor is freed)."""

    def __init__(self, folder: str | None = None):
        self.folder = folder or os.environ.get("KVPRESS_OFFLOAD_DIR") or tempfile.gettempdir()

    def memory_filesystem(self) -> str | None:
        """The file system type when the folder lives in memory (tmpfs, ramfs: its files would stay in RAM), else
        None (Linux's mount table; None where there is none)."""
        try:
            with open("/proc/mounts") as f:
                mounts = [line.split()[1:3] for line in f]
        except OSError:
            return None
        folder = os.path.realpath(self.folder)
        inside = [(point, kind) for point, kind in mounts
                  if folder == point or folder.startswith(point.rstrip("/") + "/")]
        point, kind = max(inside, key=lambda m: len(m[0]), default=("", ""))
        return kind if kind in ("tmpfs", "ramfs") else None

    def writable(self) -> str | None:
        """None when a file can be made in the folder, else why not (checked before a patch, not mid-generate)."""
        try:
            fd, path = tempfile.mkstemp(prefix="kvpress-shadow-probe-", dir=self.folder)
        except OSError as e:
            return e.strerror or str(e)
        os.close(fd)
        os.unlink(path)
        return None

    def put(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach().to("cpu").contiguous()
        fd, path = tempfile.mkstemp(prefix="kvpress-shadow-", suffix=".bin", dir=self.folder)
        try:
            with os.fdopen(fd, "wb") as f:
                tensor.view(torch.uint8).numpy().tofile(f)  # (no copy of the tensor in between)
                f.flush()
                os.fsync(f.fileno())
                if hasattr(os, "posix_fadvise"):  # written and synced: its page-cache copy may go now
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            if not tensor.numel():
                return tensor.clone()
            mapped = torch.from_file(path, shared=True, size=tensor.numel(), dtype=tensor.dtype)
        finally:
            os.unlink(path)
        return mapped.view(tensor.shape)


def chosen_chunks(q: torch.Tensor, scaling: float, landmarks: torch.Tensor, ok: torch.Tensor, start: torch.Tensor,
                  select: int, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ShadowKV's selection: (slots [B, Hkv, n * chunk_size], ok) of the top n = min(select, N) chunks per KV head by
    softmax(q . landmark * scaling) over the landmarks [B, Hkv, N, D] (ok: real entries; start: each chunk's first
    slot), summed over the query rows of q [B, Hkv, g, r, D] and maxed over the group."""
    logits = torch.einsum("bhgrd,bhnd->bhgrn", q, landmarks.float()) * scaling
    logits = logits.masked_fill(~ok[:, :, None, None], float("-inf"))
    score = logits.softmax(-1).nan_to_num(0.0).sum(3).amax(2)  # [B, Hkv, N]
    score = score.masked_fill(~ok, float("-inf"))
    chunks = score.topk(min(select, score.shape[-1]), dim=-1).indices.sort(-1).values
    slots = (start.gather(-1, chunks)[..., None] + torch.arange(chunk_size, device=start.device)).flatten(-2)
    return slots, ok.gather(-1, chunks).repeat_interleave(chunk_size, -1)


@dataclass
class ShadowKeys:
    """One layer's prompt in ShadowKV's two tiers (module docstring). Follows `Payload` (payloads.py)."""

    low_bit: ClassVar[bool] = False
    storage_kind: ClassVar[str | None] = SHADOW

    coeffs: torch.Tensor  # [B, 1, W, r] model dtype
    basis: torch.Tensor  # [B, Hkv, r, D] model dtype
    rope: torch.Tensor  # [B, W] int32
    landmarks: torch.Tensor  # [B, Hkv, N, D] model dtype
    landmark_start: torch.Tensor  # [B, Hkv, N] first slot of each landmark's chunk
    landmark_ok: torch.Tensor  # [B, Hkv, N] a real chunk (not padding)
    exact_slots: torch.Tensor  # [B, Hkv, E] slots read exactly (outlier and local chunks)
    exact_ok: torch.Tensor  # [B, Hkv, E]
    exact_keys: torch.Tensor  # [B, Hkv, E, D] model dtype
    exact_values: torch.Tensor  # [B, Hkv, E, D]
    values: torch.Tensor  # [B, Hkv, W, D] model dtype, in the file tier
    chunk_size: int
    select: int  # chunks each read takes per KV head
    rotary: object  # positions.Rotary of the layer (cos/sin at any position)
    tier: FileTier

    # -- shape
    @property
    def num_slots(self) -> int:
        return self.coeffs.shape[2]

    @property
    def batch_heads(self) -> tuple[int, int]:
        return self.basis.shape[0], self.basis.shape[1]

    @property
    def device(self) -> torch.device:
        return self.coeffs.device

    @property
    def key_dtype(self) -> torch.dtype:
        return torch.float32

    # -- what a read rebuilds
    def rebuilt_keys(self, slots: torch.Tensor) -> torch.Tensor:
        """fp32 post-RoPE keys [B, Hkv, K, D] of slots [B, Hkv, K]: coeffs . basis, rotated at the slots' RoPE
        positions."""
        batch, heads = self.batch_heads
        coeffs = take_slots(self.coeffs.expand(batch, heads, -1, -1), slots).float()
        keys = coeffs @ self.basis.float()
        rope = self.rope.gather(1, slots.flatten(1)).long()  # [B, Hkv * K]
        cos, sin = self.rotary.cos_sin(rope, keys)
        return apply_rotary(keys.flatten(1, 2)[:, None], cos, sin)[:, 0].view_as(keys)

    def chosen_slots(self, q: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots [B, Hkv, select * chunk_size], ok) of the chunks query rows q [B, Hkv, g, r, D] select."""
        return chosen_chunks(q, scaling, self.landmarks, self.landmark_ok, self.landmark_start, self.select,
                             self.chunk_size)

    def attention_state(self, queries, positions: torch.Tensor, valid: torch.Tensor | None, state):
        """Fold the selected chunks and the exact slots into the online softmax `state` (positions, valid: the
        segment's per-slot [B, Hkv, W])."""
        slots, ok = self.chosen_slots(queries.grouped(self.batch_heads[1]), queries.scaling)
        if valid is not None:
            ok = ok & valid.gather(-1, slots)
        state = dense_attention_state(queries, self.rebuilt_keys(slots), self.fetch_values(slots),
                                      positions.gather(-1, slots), ok, state)
        return dense_attention_state(queries, self.exact_keys, self.exact_values,
                                     positions.gather(-1, self.exact_slots), self.exact_ok, state)

    def fetch_values(self, slots: torch.Tensor) -> torch.Tensor:
        """Values [B, Hkv, K, D] of slots [B, Hkv, K], read from the file tier (only their pages are touched)."""
        return take_slots(self.values, slots)

    def read_slots(self) -> int:
        """Slots one read takes per KV head: the selected chunks and the exact slots (the widest row)."""
        return min(self.select, self.landmarks.shape[2]) * self.chunk_size + self.exact_slots.shape[2]

    # -- the Payload protocol
    def gather(self, indices, real=None):
        raise ValueError("shadowkv keeps every prompt token in its two tiers; its slots cannot be evicted or "
                         "reordered (compose it with no eviction policy)")

    cat = flatten = gather

    def _with_memory(self, fn, **changes) -> "ShadowKeys":
        """A copy with `fn` applied to every memory-tier tensor."""
        return dataclasses.replace(self, **{name: fn(getattr(self, name)) for name in MEMORY_TIER}, **changes)

    def map_rows(self, fn) -> "ShadowKeys":
        return self._with_memory(fn, values=self.tier.put(fn(self.values)))

    def to(self, device) -> "ShadowKeys":
        return self._with_memory(lambda t: t.to(device))  # the file tier stays where it is

    def detach(self) -> "ShadowKeys":
        return self  # never written in place

    def dequantize(self, start: int, end: int, precision: int | None = None):
        keys = self.readable_keys(torch.float32)[:, :, start:end]
        return keys, self.values[:, :, start:end].float()

    def readable_keys(self, dtype: torch.dtype) -> torch.Tensor:
        """Every slot's key as a read sees it: rebuilt, except the exact slots (a transient copy)."""
        batch, heads = self.batch_heads
        slots = torch.arange(self.num_slots, device=self.device).expand(batch, heads, -1)
        keys = self.rebuilt_keys(slots)
        at = self.exact_slots[..., None].expand_as(self.exact_keys)
        exact = torch.where(self.exact_ok[..., None], self.exact_keys.float(), keys.gather(2, at))
        return keys.scatter(2, at, exact).to(dtype)

    def readable_values(self, dtype: torch.dtype) -> torch.Tensor:
        return self.values.to(dtype=dtype, copy=True)

    def tensors(self) -> list[torch.Tensor]:
        """The primary tier (the values' file is `offloaded_nbytes`)."""
        return [getattr(self, name) for name in MEMORY_TIER]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def shared_tensors(self) -> list[torch.Tensor]:
        return []

    def offloaded_nbytes(self) -> int:
        return self.values.numel() * self.values.element_size()


# the fields of ShadowKeys held in memory (all its tensors but the values)
MEMORY_TIER = ("coeffs", "basis", "rope", "landmarks", "landmark_start", "landmark_ok", "exact_slots", "exact_ok",
               "exact_keys", "exact_values")


def store(layer, payload: ShadowKeys) -> None:
    """Make `layer`'s prompt (its one full-precision rectangle) the ShadowKV segment `payload`, with an empty tail
    behind it for the tokens to come."""
    tail = layer.tail
    batch, heads, _, dim = tail.data.keys.shape
    empty = tail.data.keys.new_empty(batch, heads, 0, dim)
    layer.segments = [Segment(payload, tail.positions, tail.valid), dense(empty, empty.clone())]
    layer.derived = {}
    layer.mark_changed()
