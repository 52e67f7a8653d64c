"""Which models kvpress has patched: the one owner of the patch registry.

Three tables, all keyed weakly (a model dropped while patched is freed with its patch): model -> its Patch, attention
module -> its Binding, model -> the summary of its last generate call's cache. patch.py registers and unregisters;
everything else asks through the public functions here (patch_of, binding_of, ...). PATCHING serialises every
check-then-change of the tables.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch

from ..positions import Rotary

# patch_model and unpatch take this while they check and change which models are patched: two threads patching one
# model at once would both pass the "already patched" check and both install (every later forward then failed)
PATCHING = threading.RLock()

# the tables hold Patch objects (patch.py), which this module never imports: patch.py registers itself here
_PATCHES: "weakref.WeakKeyDictionary[torch.nn.Module, object]" = weakref.WeakKeyDictionary()
_BINDINGS: "weakref.WeakKeyDictionary[torch.nn.Module, Binding]" = weakref.WeakKeyDictionary()
_LAST_STATS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


@dataclass
class Binding:
    """Per attention module: its patch, its RoPE (for policies that need it) and its (rank, count) among the
    layers whose budget kvpress spreads. What a forward in flight hands the module (its cache, its input hidden
    states) is not here: it lives per thread on the patch (Patch.live), so concurrent forwards never see each
    other's cache."""

    patch: object  # the Patch that bound the module
    rotary: Rotary | None = None
    budget_layer: tuple[int, int] | None = None


# ---------------------------------------------------------------------------- patches
def patch_of(model):
    """The Patch installed on `model`, or None when kvpress has not patched it."""
    return _PATCHES.get(model)


def is_patched(model, modules) -> bool:
    """Whether `model`, or any of its attention `modules`, is patched (itself, or as part of another model)."""
    return model in _PATCHES or any(m in _BINDINGS for m in modules)


def register(model, patch) -> None:
    _PATCHES[model] = patch


def unregister(model, patch) -> None:
    """Forget `patch` as `model`'s (nothing when another patch, or none, is registered)."""
    if _PATCHES.get(model) is patch:
        del _PATCHES[model]


# ---------------------------------------------------------------------------- attention modules
def binding_of(module) -> Binding | None:
    """What the attention function reads for `module` (None: no kvpress patch binds it)."""
    return _BINDINGS.get(module)


def bind(module, binding: Binding) -> None:
    _BINDINGS[module] = binding


def unbind(module, patch) -> None:
    """Drop `module`'s binding when it belongs to `patch`."""
    binding = _BINDINGS.get(module)
    if binding is not None and binding.patch is patch:
        del _BINDINGS[module]


# ---------------------------------------------------------------------------- the last generate call's cache
def record_stats(model, summary: dict) -> None:
    _LAST_STATS[model] = summary


def last_cache_stats(model) -> dict:
    """Summary of the cache of the last `generate` run through a kvpress patch on `model`: tokens seen,
    bytes kept (total and right after prefill), and per-layer rows (seen, stored, kept per head, bytes)."""
    if model not in _LAST_STATS:
        raise ValueError("no kvpress generate has run on this model yet; call model.generate inside patch_model")
    return _LAST_STATS[model]
