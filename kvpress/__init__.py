"""kvpress: KV-cache compression and sparse-attention middleware for Hugging Face transformers."""

from . import policies
from .cache import KVPressCache, KVPressLayer
from .integrations import Patch, last_cache_stats, patch_model, unpatch
from .policies import list_policies
from . import speculative
from .compressed import Answers, CompressedContext, ask, compress, load
from .combine import combine
from .speculative import speculative_generate
from .version import __version__

__all__ = [
    "KVPressCache", "KVPressLayer", "Patch", "patch_model", "unpatch", "last_cache_stats", "list_policies",
    "policies", "speculative", "speculative_generate", "compress", "ask", "load", "combine", "CompressedContext", "Answers",
    "__version__",
]
