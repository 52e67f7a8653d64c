"""Patch: what patch_model installs on one model (attention implementation, hooks, instance-level wrappers), and
unpatch(), which takes it all off again exactly."""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
import weakref
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..cache import KVPressCache
from ..cache.cache import layout
from ..heads import SINGLE, HeadShards
from ..policies import Policy
from ..policies.base import ModelInfo, ModelPass
from .checks import check_forward, check_generate
from .chunked import wrap_forward
from .hf import (_BINDINGS, _LAST_STATS, _PATCHES, _PREFIX, _Binding, _InFlight, _config_heads, _eager_function,
                 _sdpa_backends, attention_modules_of, cache_argument, cache_summary, decoder_of, given_cache,
                 kvpress_attention, model_info, with_cache)

_ABSENT = object()
# patch_model and unpatch take this while they check and change which models are patched: two threads patching one
# model at once would both pass the "already patched" check and both install (every later forward then failed)
PATCHING = threading.RLock()


@dataclass
class _Forward:
    """A patched forward in flight on this thread: its cache, and how far it got (what a failure leaves behind)."""

    cache: object
    module: object  # the model or its decoder: whichever was called (the outermost serves the call)
    checked: bool = False  # its inputs passed every check: from here on it may change the cache
    done: bool = False  # it returned, the model-level hook included
    was_empty: bool = False  # it was a prompt's forward (the cache was empty)
    marks: tuple = ()  # the cache's append counters when it started


class Patch:
    """A patched model. Use as a context manager, or call `unpatch()`.

    Everything is installed or nothing: the constructor undoes what it installed when a step fails. The decoder (the
    module that runs the attention layers: `model.model` of a causal LM, or the model itself) carries the hooks
    that decide, for every forward whoever calls it (the model, the decoder directly, a chunk of a chunked prefill),
    whether it is served and how (checks.py)."""

    def __init__(self, model, policy: Policy, base: str, info: ModelInfo, prefill_chunk_size: int | None = None,
                 question_tokens: int | None = None):
        attention_modules = info.modules
        try:
            rotaries = [info.rotary(m.layer_idx) if policy.needs().rotary else None for m in attention_modules]
        except ValueError as e:
            raise ValueError(f"policy {policy.describe()} needs the model's rotary embedding (RoPE): {e}") from None
        # Weak references to the model and its modules: the module-level registries (keyed weakly by them) hold
        # this patch, so a strong reference here would keep a model that is dropped while patched alive forever.
        self._model = weakref.ref(model)
        decoder = decoder_of(model)
        self._decoder = weakref.ref(decoder)
        self.live = _InFlight()
        self.policy = policy
        self.base = base
        self.head_dim = info.head_dim
        self.prefill_chunk_size = prefill_chunk_size
        self.question_tokens = question_tokens
        self.needs = policy.needs()
        text_config = model.config.get_text_config(decoder=True)
        # layers whose cache kvpress compresses (hybrid models' sliding-window layers keep their own cache):
        # layer-wise budgets (PyramidKV) are spread over these
        layer_types = getattr(text_config, "layer_types", None) or ["full_attention"] * len(attention_modules)
        self.layer_kinds = layout(model.config, len(attention_modules))  # what a KVPressCache must be built for
        every = [m.layer_idx for m in attention_modules]
        budget_layers = [i for i in every if layer_types[i] != "sliding_attention"] or every
        # patched generate / forward calls running on any thread: unpatch() waits until there are none, so a call
        # never runs half patched (its cache compressed by some steps and read as a stock cache by the next)
        self._running = 0
        self._running_changed = threading.Condition()
        self._base_fn = _eager_function(attention_modules[0]) if base == "eager" else ALL_ATTENTION_FUNCTIONS[base]
        self.attn_implementation = _PREFIX + base
        # what _install changed, for _restore to undo exactly
        self._handles = []
        self._bound = []  # attention modules bound to this patch
        self._attributes = []  # (module, name, previous instance attribute or _ABSENT)
        self._switched = False
        try:
            self._install(model, decoder, attention_modules, rotaries, budget_layers)
        except BaseException:
            self._restore()
            raise
        policy.claim(+1)
        _PATCHES[model] = self

    def _install(self, model, decoder, attention_modules, rotaries, budget_layers) -> None:
        name = self.attn_implementation
        AttentionInterface.register(name, kvpress_attention)
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[self.base])
        self._switched = True
        model.set_attn_implementation(name)
        if model.config._attn_implementation != name:
            raise ValueError(f"{type(model).__name__} refused attn_implementation={name!r}; it cannot be patched")
        for module, rotary in zip(attention_modules, rotaries):
            rank = budget_layers.index(module.layer_idx) if module.layer_idx in budget_layers else None
            _BINDINGS[module] = _Binding(self, rotary, None if rank is None else (rank, len(budget_layers)))
            self._bound.append(weakref.ref(module))
            self._handles.append(module.register_forward_pre_hook(self._bind, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._unbind, always_call=True))
        for module in dict.fromkeys([model, decoder]):  # the model, and its decoder when that is another module
            self._handles.append(module.register_forward_pre_hook(self._enter_forward, with_kwargs=True, prepend=True))
            self._handles.append(module.register_forward_pre_hook(self._before_forward, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._after_forward, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._exit_forward, with_kwargs=True, always_call=True))
        if callable(getattr(model, "generate", None)):  # a base model (e.g. LlamaModel) has no generate
            self._set(model, "generate", self._wrap_generate(model.generate))
        if self.prefill_chunk_size is not None:
            # the model's own forward is split where logits are kept (only the last ones a caller asks for); the
            # decoder's where it is called directly (its hidden states): either way each chunk is one decoder forward
            for module, output in ((model, "logits"), (decoder, "last_hidden_state")):
                if module is decoder and output == "logits":
                    continue  # a base model: the decoder alone
                self._set(module, "forward", wrap_forward(module.forward, self.prefill_chunk_size,
                                                          self.question_tokens, output, self._after_prompt,
                                                          self.running))
        self._set(model, "__deepcopy__", self._copy_model)

    def _set(self, module, name: str, value) -> None:
        """An instance attribute of `module`, put back as it was by _restore."""
        self._attributes.append((weakref.ref(module), name, module.__dict__.get(name, _ABSENT)))
        module.__dict__[name] = value

    @property
    def model(self):
        return self._model()

    @property
    def decoder(self):
        return self._decoder()

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

    # -- the model-level hooks, on the model and on its decoder: every forward, whoever calls it, is checked here
    # before it changes anything. The outermost patched forward serves the call: the decoder's forward inside the
    # model's does nothing more (and under torch.compile of the model its hooks, traced, are no-ops: the model's
    # own hooks run outside the graph).
    def _inner(self, module) -> bool:
        if module is self.model:
            return False
        return torch.compiler.is_compiling() or bool(self.live.forwards) and self.live.forwards[-1].module is self.model

    def _enter_forward(self, module, args, kwargs):
        if self._inner(module):
            return
        cache = given_cache(kwargs)
        self._enter(cache)
        self.live.forwards.append(_Forward(cache, module))

    def _before_forward(self, module, args, kwargs):
        if self._inner(module):
            return
        check_forward(self, module, args, kwargs)
        forward = self.live.forwards[-1]
        cache = forward.cache
        if isinstance(cache, KVPressCache):
            cache.set_attention_mask(kwargs.get("attention_mask"))
            # a prompt's forward; a chunk of a chunked prefill is not (the chunk loop runs the after-prompt step)
            cache.prefilling = cache.probe is None and cache.chunked_prompt is None and cache.get_seq_length() == 0
            forward.was_empty, forward.marks = cache.get_seq_length() == 0, cache.append_marks()
        forward.checked = True

    def _after_forward(self, module, args, kwargs, output):
        if self._inner(module):
            return
        cache = given_cache(kwargs)
        if isinstance(cache, KVPressCache) and cache.prefilling:
            self._after_prompt(cache, kwargs, args)
        self.live.forwards[-1].done = True

    def _exit_forward(self, module, args, kwargs, output):
        # runs even when the forward raised (always_call); a forward that began before this patch existed (on
        # another thread) entered nothing and leaves nothing
        if not self.live.forwards or self.live.forwards[-1].module is not module or (
                module is not self.model and torch.compiler.is_compiling()):
            return
        forward = self.live.forwards.pop()
        try:
            if forward.checked and not forward.done:
                self._after_failure(forward)
        finally:
            self._exit()

    @staticmethod
    def _after_failure(forward: _Forward) -> None:
        """A forward that raised once it could change its cache: a prompt's leaves the cache empty again (a retry is
        a prompt again, never a continuation of half a prompt); any other that appended to some layer leaves the
        cache refused from then on. A probe puts the cache back itself."""
        cache = forward.cache
        if not isinstance(cache, KVPressCache) or cache.probe is not None or cache.append_marks() == forward.marks:
            return
        if forward.was_empty:
            cache.clear()
        else:
            cache.broken = ("a forward on this cache raised after some of its layers had appended that forward's "
                            "tokens, so its layers no longer agree")

    def _after_prompt(self, cache: KVPressCache, kwargs, args=()) -> None:
        """After a prompt forward (or one chunk of a chunked prefill): the model-level hook, then the bytes held."""
        cache.prefilling = False
        if self.needs.model_pass:
            with torch.no_grad():  # what the hook keeps must hold no autograd history
                self.policy.after_prefill(self.model_pass(cache, kwargs, args))
        cache.prefill_nbytes = cache.nbytes()
        cache.prefill_kv_nbytes = sum(row["kv_bytes"] for row in cache.stats())

    # -- the model-level hook
    def model_pass(self, cache: KVPressCache, kwargs, args=()) -> ModelPass:
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
            with torch.no_grad():  # one logit row at most: a probe needs what attention sees, not logits
                logits = {} if self.model is self.decoder else dict(logits_to_keep=1)
                self.model(**with_cache(self.model, cache, input_ids=input_ids, attention_mask=attention_mask,
                                        position_ids=position_ids, use_cache=True, **logits))
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
            check_generate(self, model, kwargs)
            if given_cache(kwargs) is None and kwargs.get("use_cache", True):
                kwargs[cache_argument(model)] = KVPressCache(model.config)
            with self.running(None):
                out = generate(*args, **kwargs)
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
            with PATCHING:
                if _PATCHES.get(self.model) is self:
                    self._restore()
                    self.policy.claim(-1)

    def _restore(self) -> None:
        """Undo what _install did (all of it, or the part it got through)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for ref in self._bound:
            module = ref()
            if module is not None and _BINDINGS.get(module) is not None and _BINDINGS[module].patch is self:
                del _BINDINGS[module]
        self._bound = []
        for ref, name, previous in reversed(self._attributes):
            module = ref()
            if module is None:
                continue
            if previous is _ABSENT:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = previous
        self._attributes = []
        model = self.model
        if self._switched and model is not None:
            model.set_attn_implementation(self.base)
            self._switched = False
        if model is not None and _PATCHES.get(model) is self:
            del _PATCHES[model]

    # -- copy
    def _copy_model(self, memo: dict):
        """copy.deepcopy(model) while patched: a copy of the model as it was before patch_model, patched again with
        the same policy and settings (the hooks and wrappers bound to this model, and its per-thread state, never
        reach the copy)."""
        model, decoder = self.model, self.decoder
        ours = {}  # id of a hooks dict -> (the dict, ids of the hooks this patch put in it)
        for handle in self._handles:
            hooks = handle.hooks_dict_ref()
            if hooks is not None:
                ours.setdefault(id(hooks), (hooks, set()))[1].add(handle.id)
        for hooks, ids in ours.values():  # deepcopy meets these dicts in the modules: it takes them without ours
            memo[id(hooks)] = copy.deepcopy(type(hooks)((k, v) for k, v in hooks.items() if k not in ids), memo)
        clones = {}
        for module in dict.fromkeys([model, decoder]):
            clones[module] = memo[id(module)] = object.__new__(type(module))
        for module, clone in clones.items():
            state = module.__getstate__()
            for ref, name, previous in self._attributes:
                if ref() is module:
                    state.pop(name, None)
                    if previous is not _ABSENT:
                        state[name] = previous
            clone.__setstate__(copy.deepcopy(state, memo))
        twin = clones[model]
        twin.set_attn_implementation(self.base)  # its config was copied naming kvpress's implementation
        with PATCHING:
            Patch(twin, self.policy, self.base, model_info(twin, attention_modules_of(twin), self.head_dim),
                  self.prefill_chunk_size, self.question_tokens)
        return twin

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.unpatch()
        return False

    def __repr__(self):
        return f"Patch({type(self.model).__name__}, policy={self.policy.describe()}, base={self.base!r})"
