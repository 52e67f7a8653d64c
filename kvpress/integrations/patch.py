"""Patch: what patch_model installs on one model (attention implementation, hooks, instance-level wrappers), and
unpatch(), which takes it all off again exactly."""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..cache import KVPressCache
from ..heads import SINGLE, HeadShards
from ..policies import Policy
from ..policies.base import ModelPass
from .chunked import wrap_forward
from .hf import (_BINDINGS, _LAST_STATS, _PATCHES, _PREFIX, _Binding, _InFlight, _config_heads, _eager_function,
                 _sdpa_backends, cache_argument, cache_summary, given_cache, kvpress_attention, with_cache)

_ABSENT = object()


class Patch:
    """A patched model. Use as a context manager, or call `unpatch()`."""

    def __init__(self, model, policy: Policy, base: str, attention_modules, rotaries,
                 prefill_chunk_size: int | None = None, question_tokens: int | None = None):
        # Weak references to the model and its modules: the module-level registries (keyed weakly by them) hold
        # this patch, so a strong reference here would keep a model that is dropped while patched alive forever.
        self._model = weakref.ref(model)
        self.live = _InFlight()
        self.policy = policy
        self.base = base
        self.prefill_chunk_size = prefill_chunk_size
        self.question_tokens = question_tokens
        self.needs = policy.needs()
        text_config = model.config.get_text_config(decoder=True)
        # layers whose cache kvpress compresses (hybrid models' sliding-window layers keep their own cache):
        # layer-wise budgets (PyramidKV) are spread over these
        layer_types = getattr(text_config, "layer_types", None) or ["full_attention"] * len(attention_modules)
        every = [m.layer_idx for m in attention_modules]
        budget_layers = [i for i in every if layer_types[i] != "sliding_attention"] or every
        self._handles = []
        # patched generate / forward calls running on any thread: unpatch() waits until there are none, so a call
        # never runs half patched (its cache compressed by some steps and read as a stock cache by the next)
        self._running = 0
        self._running_changed = threading.Condition()
        self._previous = {name: model.__dict__.get(name, _ABSENT) for name in ("generate", "forward")}
        if base == "eager":
            self._base_fn = _eager_function(attention_modules[0])
        else:
            self._base_fn = ALL_ATTENTION_FUNCTIONS[base]

        name = self.attn_implementation = _PREFIX + base
        AttentionInterface.register(name, kvpress_attention)
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
        model.set_attn_implementation(name)
        if model.config._attn_implementation != name:
            model.set_attn_implementation(base)
            raise ValueError(f"{type(model).__name__} refused attn_implementation={name!r}; it cannot be patched")

        for module, rotary in zip(attention_modules, rotaries):
            rank = budget_layers.index(module.layer_idx) if module.layer_idx in budget_layers else None
            _BINDINGS[module] = _Binding(self, rotary, None if rank is None else (rank, len(budget_layers)))
            self._handles.append(module.register_forward_pre_hook(self._bind, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._unbind, always_call=True))
        self._handles.append(model.register_forward_pre_hook(self._enter_forward, with_kwargs=True, prepend=True))
        self._handles.append(model.register_forward_pre_hook(self._before_forward, with_kwargs=True))
        self._handles.append(model.register_forward_hook(self._after_forward, with_kwargs=True))
        self._handles.append(model.register_forward_hook(self._exit_forward, with_kwargs=True, always_call=True))
        self._attention_modules = [weakref.ref(m) for m in attention_modules]
        model.generate = self._wrap_generate(model.generate)
        if prefill_chunk_size is not None:
            model.forward = wrap_forward(model.forward, prefill_chunk_size, question_tokens, "logits",
                                         lambda cache, kwargs: self._after_prompt(cache, (), kwargs), self.running)
        _PATCHES[model] = self

    @property
    def model(self):
        return self._model()

    # -- hooks: what each forward hands kvpress (per thread, dropped when the module's forward ends)
    def _bind(self, module, args, kwargs):
        hidden = (args[0] if args else kwargs.get("hidden_states")) if self.needs.hidden_states else None
        self.live.calls[module] = (given_cache(kwargs), hidden)

    def _unbind(self, module, args, output):
        self.live.calls.pop(module, None)

    # -- calls in flight (what unpatch waits for)
    def _enter(self, cache) -> None:
        with self._running_changed:
            self._running += 1
        self.live.entered.append(cache)
        if isinstance(cache, KVPressCache):
            cache.patched_forwards += 1

    def _exit(self) -> None:
        cache = self.live.entered.pop()
        if isinstance(cache, KVPressCache):
            cache.patched_forwards -= 1
        with self._running_changed:
            self._running -= 1
            self._running_changed.notify_all()

    @contextlib.contextmanager
    def running(self, cache):
        """A patched call (given `cache`) running on this thread, for as long as the block runs."""
        self._enter(cache)
        try:
            yield
        finally:
            self._exit()

    def _enter_forward(self, model, args, kwargs):
        self._enter(given_cache(kwargs))

    def _exit_forward(self, model, args, kwargs, output):
        # runs even when the forward raised (always_call); a forward that began before this patch existed (on
        # another thread) entered nothing and leaves nothing
        if self.live.entered:
            self._exit()

    def _before_forward(self, model, args, kwargs):
        # Compression must never switch itself off without a word: a stock cache, or an attention implementation
        # changed under the patch, would run the model uncompressed. Checked before anything is computed.
        if _PATCHES.get(model) is not self:  # unpatch() ran on another thread just as this forward started
            raise RuntimeError("kvpress: this model was unpatched (by another thread) as this forward started; "
                               "run the call again")
        if model.config._attn_implementation != self.attn_implementation:
            raise RuntimeError(
                f"attn_implementation was changed to {model.config._attn_implementation!r} while kvpress patched "
                f"this model (it must stay {self.attn_implementation!r}); unpatch() first, change it, then patch again")
        cache = given_cache(kwargs)
        if cache is not None and not isinstance(cache, KVPressCache):
            raise ValueError(
                f"{'cache' if kwargs.get('cache') is not None else 'past_key_values'}={type(cache).__name__}: a "
                f"kvpress-patched model compresses only a KVPressCache; "
                f"allowed values: kvpress.KVPressCache(model.config), or None (generate then makes one)")
        if isinstance(cache, KVPressCache) and cache.question_ids is not None and self.prefill_chunk_size is None:
            raise ValueError("KVPressCache(question_ids=...) gives the question to a chunked prefill, but this patch "
                             "prefills in one shot; allowed: patch_model(..., prefill_chunk_size=<int>), or a cache "
                             "without question_ids (a one-shot prefill judges the prompt with its own last tokens)")
        if isinstance(cache, KVPressCache):
            cache.set_attention_mask(kwargs.get("attention_mask"))
            cache.prefilling = cache.probe is None and cache.get_seq_length() == 0

    def _after_forward(self, model, args, kwargs, output):
        cache = given_cache(kwargs)
        if isinstance(cache, KVPressCache) and cache.prefilling:
            self._after_prompt(cache, args, kwargs)

    def _after_prompt(self, cache: KVPressCache, args, kwargs) -> None:
        """After a prompt forward (or one chunk of a chunked prefill): the model-level hook, then the bytes held."""
        cache.prefilling = False
        if self.needs.model_pass:
            self.policy.after_prefill(self.model_pass(cache, args, kwargs))
        cache.prefill_nbytes = cache.nbytes()
        cache.prefill_kv_nbytes = sum(row["kv_bytes"] for row in cache.stats())

    # -- the model-level hook
    def model_pass(self, cache: KVPressCache, args, kwargs) -> ModelPass:
        """What after_prefill sees after a prompt forward with these arguments."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        mask = mask if mask is not None and mask.dim() == 2 else None
        positions = kwargs.get("position_ids")
        seen = cache.get_seq_length()
        tokens = ids if ids is not None else kwargs["inputs_embeds"]
        batch, device = tokens.shape[0], tokens.device
        if positions is not None:
            next_positions = positions[..., -1].reshape(-1).expand(batch).long() + 1
        else:  # transformers' default: the forward's tokens sit at seen - n .. seen - 1
            next_positions = torch.full((batch,), seen, dtype=torch.long, device=device)
        prompt_tokens, prompt_length = cache.chunked_prompt or (None, None)
        shards, layers = SINGLE, cache.kvpress_layers() if self.needs.all_heads else []
        if layers:
            shards = HeadShards.of(layers[0][1].num_kv_heads,
                                   _config_heads(self.model.config.get_text_config(decoder=True))[1])
        return ModelPass(self.model, cache, ids, mask, next_positions, prompt_tokens, prompt_length,
                         functools.partial(self.probe, cache), shards=shards)

    def probe(self, cache: KVPressCache, input_ids, attention_mask, position_ids, on_layer) -> None:
        """Run `input_ids` [B, n] over the cache (attending to everything it holds), calling `on_layer(ctx)` in every
        kvpress layer after attention; then put every layer back exactly as it was (nothing the probe appended
        stays; seen and positions are untouched)."""
        saved = cache._checkpoint(room=input_ids.shape[1])
        mask = cache._token_mask
        cache.probe = on_layer
        try:
            with torch.no_grad():
                self.model(**with_cache(self.model, cache, input_ids=input_ids, attention_mask=attention_mask,
                                        position_ids=position_ids, use_cache=True, logits_to_keep=1))
        finally:
            cache.probe = None
            cache._restore(saved)
            cache._token_mask = mask

    # -- attention helpers
    def base_attention(self, module, query, key, value, attention_mask, **kwargs):
        with _sdpa_backends(query):
            return self._base_fn(module, query, key, value, attention_mask, **kwargs)

    def masked_attention(self, module, query, key, value, allowed, **kwargs):
        """Base attention with kvpress's own boolean mask [B, Hq, q, T] (a compacted layer), or none (None: every
        query reads every slot)."""
        if self.base == "eager":
            mask = None
            if allowed is not None:
                mask = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
                mask = mask.masked_fill(~allowed, torch.finfo(query.dtype).min)
            return self._base_fn(module, query, key, value, mask, **kwargs)
        # sdpa takes the boolean mask as is; flash kernels cannot take an arbitrary mask, so sdpa serves them.
        with _sdpa_backends(query):
            return sdpa_attention_forward(module, query, key, value, allowed, **kwargs)

    # -- generate
    def _wrap_generate(self, generate):
        model = self.model

        @functools.wraps(generate)
        def kvpress_generate(*args, **kwargs):
            if given_cache(kwargs) is None and kwargs.get("use_cache", True):
                kwargs[cache_argument(model)] = KVPressCache(model.config)
            self._enter(None)
            try:
                out = generate(*args, **kwargs)
            finally:
                self._exit()
            cache = given_cache(kwargs) if kwargs.get("use_cache", True) else None
            if isinstance(cache, KVPressCache):
                _LAST_STATS[model] = cache_summary(cache, self.policy)
            return out

        return kvpress_generate

    # -- undo
    def unpatch(self) -> None:
        """Restore the model exactly as it was before patch_model, once no generate or forward call is running on
        it (calls that other threads start meanwhile are waited for too)."""
        if self.model is None or _PATCHES.get(self.model) is not self:
            return
        if self.live.entered:
            raise RuntimeError("unpatch() was called inside a generate or forward call of the model it unpatches; "
                               "call it after that call returns")
        with self._running_changed:
            self._running_changed.wait_for(lambda: self._running == 0)
            self._restore()

    def _restore(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for ref in self._attention_modules:
            module = ref()
            if module is not None:
                _BINDINGS.pop(module, None)
        for name, previous in self._previous.items():
            if previous is _ABSENT:
                self.model.__dict__.pop(name, None)
            else:
                self.model.__dict__[name] = previous
        self.model.set_attn_implementation(self.base)
        del _PATCHES[self.model]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.unpatch()
        return False

    def __repr__(self):
        return f"Patch({type(self.model).__name__}, policy={self.policy.describe()}, base={self.base!r})"
