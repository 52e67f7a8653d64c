"""What a cache holds, in bytes: the distinct allocations behind the tensors it keeps.

Counting distinct storages (not each tensor's numel) is what makes `nbytes()` never read below what is held: a view of
a bigger buffer counts the whole buffer, two views of one buffer count it once, and state kept beside the segments (a
read view's page statistics in `layer.derived`, a capture room, per-layer counters) counts like the segments.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


class DerivedState:
    """Read-side state a policy keeps beside a layer's segments (`layer.derived`: Quest's page statistics, a
    selection reused between steps). Its tensors are the layer's bytes; the attributes named in `shared` hold the
    model's tables (a calibration's channels), which every cache shares and nbytes() reports apart."""

    shared: ClassVar[tuple[str, ...]] = ()

    def tensors(self) -> list[torch.Tensor]:
        return tensors_in([v for k, v in vars(self).items() if k not in self.shared])

    def shared_tensors(self) -> list[torch.Tensor]:
        return tensors_in([getattr(self, k) for k in self.shared])


def tensors_in(obj) -> list[torch.Tensor]:
    """Every tensor inside `obj`: itself, or inside its dicts, lists, tuples, dataclass fields and DerivedStates,
    at any depth. Any other object is refused (TypeError): state whose bytes could not be counted."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, DerivedState):
        return obj.tensors()
    if isinstance(obj, dict):
        children = obj.values()
    elif isinstance(obj, (list, tuple)):
        children = obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        children = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    elif isinstance(obj, _PLAIN):
        return []
    else:
        raise TypeError(f"{type(obj).__name__} holds state whose bytes are not counted; allowed: tensors, "
                        f"containers, dataclasses, or a cache.held.DerivedState")
    return [t for child in children for t in tensors_in(child)]


def shared_in(obj) -> list[torch.Tensor]:
    """The model's tables the DerivedStates inside `obj` read (see DerivedState.shared)."""
    if isinstance(obj, DerivedState):
        return obj.shared_tensors()
    children = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return [t for child in children for t in shared_in(child)]


def storage_nbytes(tensors) -> int:
    """Bytes of the distinct allocations behind `tensors` (a view counts its whole buffer, once)."""
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes():  # (an empty tensor may sit at the address of another's allocation: it holds nothing)
            storages[(storage.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())
