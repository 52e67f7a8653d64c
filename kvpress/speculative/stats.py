"""What a speculative call did and where its time went (SpeculativeStats), and the last one per model."""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

# model -> the SpeculativeStats of the last call that finished on it (last_stats): reachable after
# model.generate(custom_generate=...), which returns ids only
_LAST_LOCK = threading.Lock()
_LAST: "weakref.WeakKeyDictionary[torch.nn.Module, SpeculativeStats]" = weakref.WeakKeyDictionary()


@dataclass
class SpeculativeStats:
    """What one speculative_generate call did, and where its time went.

    rounds: draft-then-verify rounds; drafted / accepted: draft tokens proposed / accepted, summed over rows;
    emitted: new tokens per row in the returned ids (the prefill's first token included, cut at EOS as generate
    cuts); per_round_accepted: per round, each row's accepted count.
    Wall-clock seconds (time.perf_counter; on CUDA the device is synchronised at each phase boundary, so a phase
    is charged its own kernels): prefill_s, the forward over the prompt (or over the part of it past a given
    cache=) that yields the first token; draft_s, the draft forwards and their rollback; verify_s, the
    verification forwards and acceptance; total_s, the whole call inside the loop (the rest is bookkeeping).
    With compare=True: plain_decode_s, plain decoding of as many tokens over a copy of the same prefilled cache, one
    forward per token (what speculation must beat; `speedup` is their ratio, below 1 when speculation is slower),
    and plain_matches, whether greedy plain decoding gave the same tokens (None when sampling)."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    per_round_accepted: list = field(default_factory=list)
    per_round_drafts: list = field(default_factory=list)  # drafts proposed per row, each round (gamma="adaptive")
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    select_s: float = 0.0  # CLaSp's choices of the layers to skip (layer_skip.py)
    skipped_layers: list = field(default_factory=list)  # the layers skipped, at each choice (or the fixed set once)
    plain_decode_s: float | None = None
    plain_matches: bool | None = None

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(1, self.drafted)

    @property
    def tokens_per_round(self) -> float:
        """Tokens committed per verification forward (the smallest accepted prefix of the batch + 1)."""
        return sum(min(n) + 1 for n in self.per_round_accepted) / max(1, self.rounds)

    @property
    def decode_s(self) -> float:
        return max(0.0, self.total_s - self.prefill_s)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per row per second after the first (the prefill's), over decode_s; 0 when nothing was decoded."""
        return (self.emitted - 1) / self.decode_s if self.emitted > 1 and self.decode_s > 0 else 0.0

    @property
    def speedup(self) -> float | None:
        """Plain decoding's time over speculation's for the same tokens (compare=True; None without)."""
        return None if self.plain_decode_s is None or not self.decode_s else self.plain_decode_s / self.decode_s


def last_stats(model) -> SpeculativeStats:
    """SpeculativeStats of the last speculative_generate (or custom_generate) call that finished on `model`,
    as kvpress.last_cache_stats(model) reports the last patched generate's cache."""
    with _LAST_LOCK:
        stats = _LAST.get(model)
    if stats is None:
        raise ValueError("no speculative_generate has finished on this model yet; call kvpress.speculative_generate "
                         "or model.generate(..., custom_generate=kvpress.speculative.custom_generate)")
    return stats


def clock(device: torch.device) -> float:
    if device.type == "cuda":  # kernels run asynchronously: without this, a phase would be charged the previous one's
        torch.cuda.synchronize(device)
    return time.perf_counter()


def record(model, stats: SpeculativeStats) -> None:
    with _LAST_LOCK:
        _LAST[model] = stats
