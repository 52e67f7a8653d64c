"""The engine core's side of each request: where its prompt may be cut, and what it is handed from the prefix cache.

vLLM's scheduler, plus three things per request, each from its plan (plans.py; stock requests and those that evict
nothing are left to vLLM):
- its pages' names: a compressing request's prefix-cache hash chain is salted with the kvpress settings and its
  context's tokens (`Plan.salt`, vLLM's own `cache_salt` mechanism), so its pages are never handed to a stock
  request, nor stock pages to it, nor one context's compacted pages to another context;
- a step never runs past the plan's `end` before it is computed (the tokens after a context are computed over the
  compacted context), nor past a decode-time cut (Plan.next_stop: a request recomputed after preemption computes
  its generated tokens in steps that end where its decode steps cut);
- its figures (metrics.py): counted by its page manager, logged and exported with vLLM's statistics;
- its prefix-cache lookup: a declared context already compacted by an earlier request is handed over whole
  (KVPressManager.shared_context_hit: null blocks for its evicted pages, then the compacted pages), and the
  request starts at the context's end; anything less than the whole compacted context is no hit at all (a
  request never starts from part of a context, whose pages would have to be compacted again).
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler as VLLMScheduler

from .pages import KVPressManager


class Scheduler(VLLMScheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        managers = self.kv_cache_manager.coordinator.single_type_managers
        kvpress = [m for m in managers if isinstance(m, KVPressManager)]
        # A shared context is handed over in one group only: a hybrid model's sliding-window group would need its
        # own pages of the context too (not served yet: such requests compute their context each time).
        self._shares = kvpress[0] if len(kvpress) == 1 and len(managers) == 1 else None
        self._compressed = kvpress[0] if kvpress else None

    def add_request(self, request) -> None:
        if self._compressed is not None:
            plan = self._compressed.arrived(request)
            if plan.compresses:
                # vLLM computed the request's block hashes when it built it; they are computed again with the salt
                request.cache_salt = plan.salt(request.prompt_token_ids, request.cache_salt)
                request.block_hashes.clear()
                request.update_block_hashes()
        super().add_request(request)

    def make_stats(self, *args, **kwargs):
        stats = super().make_stats(*args, **kwargs)
        if stats is not None and self._compressed is not None:  # (None: vLLM logs no statistics)
            self._compressed.count_held()
            self._compressed.stats.maybe_log()
        return stats

    def kvpress_stats(self) -> dict:
        """What kvpress did in this engine so far (metrics.Counts), e.g. through the engine core's utility calls."""
        if self._compressed is None:
            return {}
        self._compressed.count_held()
        return self._compressed.stats.snapshot()

    def _free_request(self, request, *args, **kwargs):
        out = super()._free_request(request, *args, **kwargs)
        if self._compressed is not None:
            self._compressed.finished(request.request_id)
        return out

    def _reserve_prefill_lookahead(self, request, num_computed_tokens: int, num_new_tokens: int) -> int:
        num_new_tokens = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        plan = None if self._compressed is None else self._compressed.planned(request.request_id)
        stop = None if plan is None else plan.next_stop(num_computed_tokens)
        if stop is not None and stop < num_computed_tokens + num_new_tokens:
            num_new_tokens = stop - num_computed_tokens  # the step ends where the context does, or at a decode cut
        return num_new_tokens

    def _get_local_prefix_cache_hit(self, request):
        plan = None if self._compressed is None else self._compressed.planned(request.request_id)
        if plan is None:
            return super()._get_local_prefix_cache_hit(request)
        manager = self.kv_cache_manager
        if not plan.shared or self._shares is None or not manager.prefix_cache_lookup_enabled(request):
            return manager.empty_kv_cache_blocks, 0, 0, False
        blocks, hit = self._shares.shared_context_hit(request, plan, request.num_tokens - 1)
        if not blocks:
            return manager.empty_kv_cache_blocks, 0, 0, False
        return manager.create_kv_cache_blocks((blocks,)), hit, 0, False
