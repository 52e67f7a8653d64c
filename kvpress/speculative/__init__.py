"""Self-speculative decoding: the model drafts from a cheap view of its own compressed cache."""

from .generate import DRAFTS, SpeculativeStats, accept, custom_generate, last_stats, speculative_generate

__all__ = ["DRAFTS", "SpeculativeStats", "accept", "custom_generate", "last_stats", "speculative_generate"]
