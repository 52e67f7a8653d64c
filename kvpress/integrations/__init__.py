from .attention import kvpress_attention
from .hf import cache_summary
from .patch import Patch
from .patching import patch_model, unpatch
from .registry import last_cache_stats, patch_of

__all__ = ["Patch", "cache_summary", "kvpress_attention", "last_cache_stats", "patch_model", "patch_of", "unpatch"]
