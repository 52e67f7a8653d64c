"""kvpress: KV-cache compression and sparse-attention middleware for Hugging Face transformers."""

from . import policies
from .cache import KVPressCache, KVPressLayer
from .integrations import Patch, last_cache_stats, patch_model, unpatch
from .policies import list_policies
from . import speculative
from .speculative import speculative_generate

__version__ = "0.1.0"
__all__ = [
    "KVPressCache", "KVPressLayer", "Patch", "patch_model", "unpatch", "last_cache_stats", "list_policies",
    "policies", "speculative", "speculative_generate",
]
