from .hf import Patch, cache_summary, kvpress_attention, last_cache_stats, patch_model, unpatch

__all__ = ["Patch", "cache_summary", "kvpress_attention", "last_cache_stats", "patch_model", "unpatch"]
