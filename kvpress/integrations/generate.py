"""A patched model's `generate`: checked before it starts (checks.py), given a KVPressCache when the caller gave none,
counted as a call running on the model (what unpatch waits for), and its cache summarised afterwards
(kvpress.last_cache_stats). Its continuous batching (`generate_batch`, `init_continuous_batching`, `transformers
serve`) is refused: it runs a paged cache and paged attention of its own, which kvpress does not compress."""

from __future__ import annotations

import copy
import functools

from ..cache import KVPressCache
from .checks import CONTINUOUS_BATCHING, check_generate
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
        if kwargs.get("cache_implementation") == "dynamic":  # what a KVPressCache is (checks.py refuses others)
            del kwargs["cache_implementation"]
        if "generation_config" in kwargs and getattr(kwargs["generation_config"], "cache_implementation", None) == \
                "dynamic":  # (the same, set in the config given)
            kwargs["generation_config"] = copy.deepcopy(kwargs["generation_config"])
            kwargs["generation_config"].cache_implementation = None
        elif getattr(model.generation_config, "cache_implementation", None) == "dynamic":  # in the model's own
            kwargs["cache_implementation"] = None
        if given_cache(kwargs) is None and kwargs.get("use_cache", True):
            kwargs[cache_argument(model)] = KVPressCache(model.config)
        with patch.running(None):
            out = generate(*args, **kwargs)
        cache = given_cache(kwargs) if kwargs.get("use_cache", True) else None
        if isinstance(cache, KVPressCache):
            record_stats(model, cache_summary(cache, patch.policy))
        return out

    return kvpress_generate


def refuse_continuous_batching(*args, **kwargs):
    """A patched model's init_continuous_batching (generate_batch and the context manager go through it)."""
    raise ValueError(CONTINUOUS_BATCHING)
