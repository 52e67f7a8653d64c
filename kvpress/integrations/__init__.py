from .hf import cache_summary, kvpress_attention, last_cache_stats
from .patch import Patch
from .patching import patch_model, unpatch

__all__ = ["Patch", "cache_summary", "kvpress_attention", "last_cache_stats", "patch_model", "unpatch"]
