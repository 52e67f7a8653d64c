"""ForwardState: what a patched model tells a KVPressCache about the forward running on it.

The cache itself holds no policy and runs no model; the integration (kvpress/integrations/) sets these fields around
each forward so the cache's layers and the attention function know what the forward is (a prompt, a chunk of a
chunked prompt, a probe, a forward ending with observation tokens) and which of its new tokens are padding. A new
state is what a cache that runs nothing holds: KVPressCache.fork and clear start one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class ForwardState:
    # the 2-D padding mask [B, seen + q_len] of the forward about to run (None: no per-token padding known); each
    # layer reads which of its new tokens are padding from its last columns
    token_mask: torch.Tensor | None = None
    # the forward in flight is a prompt's forward (set by the patch's model hooks; a chunk of a chunked prompt is not:
    # the chunk loop runs the after-prompt step itself)
    prefilling: bool = False
    # while a chunked prefill runs (set by the chunk loop): (real tokens of the whole prompt per row [B], the prompt's
    # padded length). Every chunk is then a prefill step and budgets follow the whole prompt; None otherwise.
    chunked_prompt: tuple[torch.Tensor, int] | None = None
    # while a model-level hook probes the cache (the patch's probe): called with each kvpress layer's Context after
    # attention, instead of the policy's hooks; None otherwise
    probe: Callable | None = None
    # while a forward computes stored tokens again (CacheBlend's recompute, kvpress/combined.py): their positions [n],
    # increasing; each kvpress layer overwrites those tokens' slots (overwrite.py) instead of appending, and attention
    # reads every stored slot up to each token's position; None otherwise
    recompute: torch.Tensor | None = None
    # the forward in flight ends with this many observation tokens (dropped after it: KVPressCache.forget_observers)
    observers: int = 0
    # stock sliding layers recording their past meanwhile, so they can give those tokens back
    recording: list = field(default_factory=list)
    # what the layers of the forward in flight hand to the layers after them (a read view that selects in one layer
    # for the next ones: TidalDecode); emptied before each forward
    shared: dict = field(default_factory=dict)

    def ended(self) -> None:
        """The forward returned: drop what only it needed (the caller's mask, what its layers handed each other), so
        the cache holds no tensor past its own storage."""
        self.token_mask = None
        self.shared = {}
