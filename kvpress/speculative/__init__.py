"""Self-speculative decoding: the model drafts from a cheap view of its own compressed cache (generate.py), or from a
retrieved short context in a cache of its own (rapid.py, RAPID)."""

from pathlib import Path

from .generate import DRAFTS, custom_generate, speculative_generate
from .rapid import bm25_chunks, rapid_generate
from .sampling import accept
from .stats import SpeculativeStats, last_stats

# transformers' hub-style folder (custom_generate/generate.py): generate(custom_generate=str(HUB_FOLDER), ...)
HUB_FOLDER = Path(__file__).parent / "hub"

__all__ = ["DRAFTS", "HUB_FOLDER", "SpeculativeStats", "accept", "bm25_chunks", "custom_generate", "last_stats", "rapid_generate",
           "speculative_generate"]
