"""RULER-style synthetic long-context tasks, generated locally and sized in the model's own tokens."""

from .tasks import DEFAULT_TASKS, TASKS, generate

__all__ = ["DEFAULT_TASKS", "TASKS", "generate"]
