"""kvpress: KV-cache compression and sparse-attention middleware for Hugging Face transformers.

The names below load on first use (PEP 562), so that `kvpress --help` and `import kvpress.version` do not wait for
torch and transformers; `import kvpress; kvpress.compress(...)` reads as before."""

from __future__ import annotations

import importlib

from .version import __version__

_WHERE = {  # public name -> the module that defines it
    "KVPressCache": ".cache", "KVPressLayer": ".cache",
    "Patch": ".integrations", "patch_model": ".integrations", "unpatch": ".integrations",
    "last_cache_stats": ".integrations",
    "list_policies": ".policies",
    "Answers": ".compressed", "CompressedContext": ".compressed", "ask": ".compressed", "compress": ".compressed",
    "load": ".compressed", "DEFAULT_POLICY": ".compressed", "DEFAULT_PARAMS": ".compressed",
    "combine": ".combined",
    "speculative_generate": ".speculative",
}
_MODULES = ("policies", "speculative")

__all__ = [*_WHERE, *_MODULES, "__version__"]


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    elif name in _MODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'kvpress' has no attribute {name!r}")
    globals()[name] = value  # (loaded once)
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
