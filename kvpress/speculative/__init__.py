"""Self-speculative decoding: the model drafts from a cheap view of its own compressed cache (generate.py), or from a
retrieved short context in a cache of its own (rapid.py, RAPID)."""

from .generate import DRAFTS, SpeculativeStats, custom_generate, last_stats, speculative_generate
from .rapid import bm25_chunks, rapid_generate
from .sampling import accept

__all__ = ["DRAFTS", "SpeculativeStats", "accept", "bm25_chunks", "custom_generate", "last_stats", "rapid_generate",
           "speculative_generate"]
