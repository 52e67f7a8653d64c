"""The scheduler's side: which pages of a request go back to the block pool, and when.

Layers that kvpress compresses declare a `KVPressSpec` (the backend's customize_spec turns their full-attention spec
into one); vLLM picks the manager of a spec through its spec registry, and a `KVPressManager` is vLLM's full-attention
manager that, once a request's prompt is computed, frees the request's leading pages: the `evicted_tokens` that the
workers emptied by moving each layer's kept tokens to the end of the prompt range (docs/serving.md, section 2). The
freed entries of the request's block list become vLLM's null block, as a sliding window's do, so the pool's
accounting, preemption and the request's end stay vLLM's own. The evicted count is a function of the prompt length
and the settings, computed by the same code in the workers: the scheduler needs no message from them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from ..prompts import evicted_tokens
from .settings import EngineSettings


@dataclass(frozen=True, kw_only=True)
class KVPressSpec(FullAttentionSpec):
    """A full-attention layer whose requests give back the pages of their evicted prompt tokens."""

    settings: str = ""  # EngineSettings.text: what the manager needs to know each request's evicted count

    @classmethod
    def merge(cls, specs: list["KVPressSpec"]) -> "KVPressSpec":
        texts = {spec.settings for spec in specs}
        if len(texts) != 1:
            raise ValueError(f"kvpress: the layers of one KV cache group carry different settings: {sorted(texts)}")
        base = FullAttentionSpec.merge(specs)
        return cls(**{name: getattr(base, name) for name in base.__dataclass_fields__}, settings=texts.pop())


@functools.lru_cache(maxsize=8)
def _policy(text: str):
    return EngineSettings.parse(text).policy


class KVPressManager(FullAttentionManager):
    """vLLM's full-attention manager, plus: a request whose prompt has been computed frees the pages of its
    evicted tokens (each layer's kept tokens now sit at the end of the prompt range)."""

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)
        if num_prompt_tokens is None or processed_computed_tokens < num_prompt_tokens:
            return  # the prompt is not computed (and compacted) yet
        evicted = evicted_tokens(_policy(self.kv_cache_spec.settings), num_prompt_tokens, self.block_size)
        # iterates from the last evicted page down and stops at a freed one: a no-op after the first call
        self._remove_blocks_in_range(request_id, 0, evicted // self.block_size)


def register_pages() -> None:
    """Tell vLLM's spec registry which manager serves KVPressSpec (after its built-in specs: the registry fills
    itself with them only while it is empty)."""
    KVCacheSpecRegistry.check_kv_cache_spec_registry({})  # registers the built-in specs if nothing is yet
    KVCacheSpecRegistry.register(KVPressSpec, KVPressManager, uniform_type_base_spec=FullAttentionSpec)
