"""What kvpress did in an engine, counted where it happens (the scheduler's page manager: pages.py) and exported
beside vLLM's own figures.

- Prometheus: `kvpress:*` counters and a gauge through prometheus_client, which vLLM's `/metrics` endpoint serves.
  They live in the engine core's process: `/metrics` shows them when that is the server's process too, or when the
  server runs in prometheus_client's multiprocess mode (`PROMETHEUS_MULTIPROC_DIR` set: vLLM then reads every
  process's metrics; it sets it itself for several API servers). vLLM's scheduler statistics, which do cross to the
  server's process, have no field for a plugin's figures.
- A log line every `LOG_EVERY_S` seconds from the engine core, as vLLM's stats logger logs its own (only while
  vLLM logs statistics, and only when something changed).
- `Stats.snapshot()`: the same counts as a dict (the scheduler's `kvpress_stats`, for tests and tools).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

from prometheus_client import Counter, Gauge  # (vLLM's own dependency: this module runs inside vLLM)

logger = logging.getLogger("kvpress")
LOG_EVERY_S = 10.0


@dataclass
class Counts:
    prompts_compressed: int = 0  # prompts (or declared contexts) cut where they end by the request itself
    prompt_tokens: int = 0  # their tokens
    kept_tokens: int = 0  # the tokens per KV head they kept
    pages_freed_prompt: int = 0  # pages given back at a prompt's (or context's) cut
    pages_freed_decoding: int = 0  # pages given back at decode-time cuts
    contexts_compacted: int = 0  # declared contexts compacted and named in the prefix cache
    contexts_held: int = 0  # of those, still cached (named pages not evicted by the block pool)
    contexts_evicted: int = 0  # compacted contexts the block pool evicted to make room
    context_hits: int = 0  # requests handed a compacted context instead of computing it


class Stats:
    """One engine's counts, and the process's Prometheus metrics they feed."""

    def __init__(self):
        self.counts = Counts()
        self._prometheus = _prometheus()
        self._logged: Counts | None = None
        self._last_log = time.monotonic()

    def add(self, **increments: int) -> None:
        for name, n in increments.items():
            if n:
                setattr(self.counts, name, getattr(self.counts, name) + n)
                self._prometheus[name].inc(n)

    def held(self, contexts: int) -> None:
        self.counts.contexts_held = contexts
        self._prometheus["contexts_held"].set(contexts)

    def snapshot(self) -> dict:
        return asdict(self.counts)

    def maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < LOG_EVERY_S or self.counts == self._logged:
            return
        c = self.counts
        kept = f"{c.kept_tokens / c.prompt_tokens:.1%}" if c.prompt_tokens else "-"
        logger.info("kvpress: %d prompts compressed (kept %s of their tokens per KV head); pages freed: %d at prompts' "
                    "cuts, %d while decoding; contexts: %d compacted, %d held, %d evicted, %d hits",
                    c.prompts_compressed, kept, c.pages_freed_prompt, c.pages_freed_decoding, c.contexts_compacted,
                    c.contexts_held, c.contexts_evicted, c.context_hits)
        self._logged, self._last_log = Counts(**asdict(c)), now


_METRICS: dict = {}  # prometheus_client metrics, made once per process (several engines of one process share them)

_HELP = {
    "prompts_compressed": "Prompts (or declared contexts) kvpress cut where they end",
    "prompt_tokens": "Tokens of the prompts kvpress cut",
    "kept_tokens": "Tokens per KV head the cut prompts kept (kept fraction: this over prompt_tokens)",
    "pages_freed_prompt": "KV pages kvpress gave back at prompts' cuts",
    "pages_freed_decoding": "KV pages kvpress gave back at decode-time cuts",
    "contexts_compacted": "Declared contexts compacted and named in the prefix cache",
    "contexts_evicted": "Compacted contexts evicted from the prefix cache",
    "context_hits": "Requests handed a compacted context from the prefix cache",
}


def _prometheus() -> dict:
    if not _METRICS:
        for name, text in _HELP.items():
            _METRICS[name] = Counter(f"kvpress:{name}", text)
        _METRICS["contexts_held"] = Gauge("kvpress:contexts_held", "Compacted contexts cached now",
                                          multiprocess_mode="livemax")
    return _METRICS
