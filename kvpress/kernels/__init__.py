"""Kernels. Each has a torch reference; Triton versions join them with the same signatures."""

from .scores import allowed_mask, attention_column_sums, attention_probs, masked_softmax_

__all__ = ["allowed_mask", "attention_column_sums", "attention_probs", "masked_softmax_"]
