"""A patched model's `generate`: checked before it starts (checks.py), given a KVPressCache when the caller gave none,
counted as a call running on the model (what unpatch waits for), and its cache summarised afterwards
(kvpress.last_cache_stats)."""

from __future__ import annotations

import functools

from ..cache import KVPressCache
from .checks import check_generate
from .hf import cache_argument, cache_summary, given_cache, renamed_for
from .registry import record_stats


def wrap_generate(patch, generate):
    """`generate` (the model's own, bound) as a patched model runs it."""
    model = patch.model

    @functools.wraps(generate)
    def kvpress_generate(*args, **kwargs):
        if not patch.serves_this_thread():  # a kvpress call's own patch, outside its scope: generate as unpatched
            return generate(*args, **kwargs)
        kwargs = renamed_for(model, kwargs) or kwargs
        check_generate(patch, model, args, kwargs)
        if given_cache(kwargs) is None and kwargs.get("use_cache", True):
            kwargs[cache_argument(model)] = KVPressCache(model.config)
        with patch.running(None):
            out = generate(*args, **kwargs)
        cache = given_cache(kwargs) if kwargs.get("use_cache", True) else None
        if isinstance(cache, KVPressCache):
            record_stats(model, cache_summary(cache, patch.policy))
        return out

    return kvpress_generate
