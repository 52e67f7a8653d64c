"""The scheduler's side: which pages of a request go back to the block pool, and which get a name to be shared.

Layers that kvpress compresses declare a `KVPressSpec` (the backend's customize_spec turns their full-attention spec
into one); vLLM picks the manager of a spec through its spec registry, and a `KVPressManager` is vLLM's full-attention
manager, plus, per request (its plan: plans.py, a function of the request, computed here as in the workers):
- once the prompt is computed up to the plan's `end`, the request's leading `evicted / P` pages are freed: the
  workers moved each layer's kept tokens to the logical slots [evicted, end); and at each decode-time cut, the next
  `cut / P` (the workers moved the kept tokens behind them: Plan.evicted_at). The freed entries of its block list
  become vLLM's null block, as a sliding window's do, so the pool's accounting, preemption and the request's end
  stay vLLM's own.
- prefix caching names pages only when they hold what their name says. A request that compresses its prompt at its
  own end never names its pages (they hold kept tokens of that prompt alone). A declared context's pages get names
  (its salted hash chain: plans.py) only from the step that computes the context's end, and only from page
  `evicted / P` on: the compacted pages, which `shared_context_hit` hands to later requests. Stock requests, and
  requests whose compression evicts nothing, are vLLM's as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from .metrics import Stats
from .plans import Plan, plan_of_request


@dataclass(frozen=True, kw_only=True)
class KVPressSpec(FullAttentionSpec):
    """A full-attention layer whose requests give back the pages of their evicted prompt tokens."""

    settings: str = ""  # EngineSettings.text: the engine's policy, each request's plan starts from it

    @classmethod
    def merge(cls, specs: list["KVPressSpec"]) -> "KVPressSpec":
        texts = {spec.settings for spec in specs}
        if len(texts) != 1:
            raise ValueError(f"kvpress: the layers of one KV cache group carry different settings: {sorted(texts)}")
        base = FullAttentionSpec.merge(specs)
        return cls(**{name: getattr(base, name) for name in base.__dataclass_fields__}, settings=texts.pop())


class KVPressManager(FullAttentionManager):
    """vLLM's full-attention manager, plus each request's evicted pages and the names of a shared context's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the requests that compress, from their arrival to their end (kvpress's scheduler tells: a request keeps
        # its plan through preemption, when its blocks are freed and allocated again)
        self._plans: dict[str, Plan] = {}
        self.stats = Stats()
        self._past_end: dict[str, bool] = {}  # requests past their plan's end in this allocation -> handed a context
        self._contexts: dict[int, tuple] = {}  # block id -> (block, its hash): each named context's first page

    def arrived(self, request) -> Plan:
        plan = plan_of_request(self.kv_cache_spec.settings, request, self.block_size)
        if plan.compresses:
            self._plans[request.request_id] = plan
        return plan

    def planned(self, request_id: str) -> Plan | None:
        """The plan of a request that compresses; None for one that vLLM serves as it is."""
        return self._plans.get(request_id)

    def finished(self, request_id: str) -> None:
        self._plans.pop(request_id, None)

    def cache_blocks(self, request, num_tokens: int, *args, **kwargs) -> None:
        plan = self._plans.get(request.request_id)
        if plan is None:
            return super().cache_blocks(request, num_tokens, *args, **kwargs)
        if not plan.shared or num_tokens < plan.end:
            return  # never named, or not yet: before the step that compacts them, they hold the whole context
        first = plan.evicted // self.block_size  # the evicted pages are freed unnamed
        before = self.num_cached_block[request.request_id] = max(self.num_cached_block.get(request.request_id, 0),
                                                                 first)
        super().cache_blocks(request, num_tokens, *args, **kwargs)
        if before == first < self.num_cached_block[request.request_id] and \
                not self._past_end.get(request.request_id, False):  # this request's own compacted context, named
            block = self.req_to_blocks[request.request_id][first]
            self.count_held()  # (the page may have held another context's, evicted since)
            self._contexts[block.block_id] = (block, block.block_hash)
            self.stats.add(contexts_compacted=1)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)
        plan = self._plans.get(request_id)
        evicted = 0 if plan is None else plan.evicted_at(processed_computed_tokens)
        if not evicted:
            return  # nothing to free, or the prompt is not computed and compacted yet
        page, blocks = self.block_size, self.req_to_blocks[request_id]
        first = plan.evicted // page
        live = [i for i in range(min(evicted // page, len(blocks))) if not blocks[i].is_null]
        prompt_pages = sum(i < first for i in live)
        if request_id not in self._past_end:  # the first step past the prompt's end (in this allocation)
            handed = plan.evicted > 0 and not prompt_pages  # its evicted pages were never its own
            self._past_end[request_id] = handed
            self.stats.add(context_hits=int(handed), prompts_compressed=int(prompt_pages > 0),
                           prompt_tokens=plan.end if prompt_pages else 0,
                           kept_tokens=plan.end - plan.evicted if prompt_pages else 0)
        self.stats.add(pages_freed_prompt=prompt_pages, pages_freed_decoding=len(live) - prompt_pages)
        # iterates from the last evicted page down and stops at a freed one: a no-op until the next cut
        self._remove_blocks_in_range(request_id, 0, evicted // page)

    def free(self, request_id: str) -> None:
        self._past_end.pop(request_id, None)  # (preempted: it computes its prompt again, and cuts it again)
        super().free(request_id)

    def count_held(self) -> None:
        """Which named contexts are still cached: the block pool evicts a cached page by dropping its name."""
        for block_id, (block, name) in list(self._contexts.items()):
            if block.block_hash != name:
                del self._contexts[block_id]
                self.stats.add(contexts_evicted=1)
        self.stats.held(len(self._contexts))

    def shared_context_hit(self, request, plan: Plan, max_length: int) -> tuple[list, int]:
        """A later request's share of a compacted context: null blocks for its evicted pages, then the context's
        compacted pages and whatever pages after them hold the same tokens over the same context (the salted
        chain), up to `max_length` tokens; ([], 0) unless every compacted page of the context is cached."""
        page = self.block_size
        hashes = request.block_hashes
        blocks = [self._null_block] * (plan.evicted // page)
        for i in range(plan.evicted // page, min(len(hashes), max_length // page)):
            cached = self.block_pool.get_cached_block(hashes[i], [self.kv_cache_group_id])
            if cached is None:
                break
            blocks.append(cached[0])
        if len(blocks) * page < plan.end:
            return [], 0  # part of the context is gone (evicted from the cache): compute it again
        return blocks, len(blocks) * page


def register_pages() -> None:
    """Tell vLLM's spec registry which manager serves KVPressSpec (after its built-in specs: the registry fills
    itself with them only while it is empty)."""
    KVCacheSpecRegistry.check_kv_cache_spec_registry({})  # registers the built-in specs if nothing is yet
    KVCacheSpecRegistry.register(KVPressSpec, KVPressManager, uniform_type_base_spec=FullAttentionSpec)
