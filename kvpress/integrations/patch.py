"""Patch: what patch_model installs on one model (attention implementation, hooks, instance-level wrappers), and
unpatch(), which takes it all off again exactly. What the installed pieces do is elsewhere: attention.py (the
attention function), forwards.py (the model-level hooks), generate.py (generate), chunked.py (chunked prefill)."""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref

from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from ..cache import KVPressCache
from ..cache.cache import layout
from ..policies import Policy
from ..policies.base import ModelInfo
from .attention import BaseAttention, kvpress_attention
from .chunked import wrap_forward
from .forwards import ForwardHooks
from .generate import refuse_continuous_batching, wrap_generate
from .hf import ATTENTION_PREFIX, attention_modules_of, decoder_of, given_cache, model_info
from .registry import PATCHING, Binding, bind, patch_of, register, unbind, unregister

_ABSENT = object()


class InFlight(threading.local):
    """Per thread: attention module -> (cache, input hidden states) of the forward it is running, and the patched
    generate / forward calls this thread has entered (innermost last: the cache a forward was given, None for a
    generate call)."""

    def __init__(self):
        self.calls = {}
        self.entered = []
        self.forwards = []  # decoder forwards in flight (forwards.ForwardInFlight), innermost last
        self.scopes = 0  # kvpress calls this thread runs inside a ScopedPatch's scope (scoped.py), nested


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
        self.live = InFlight()
        self.policy = policy
        self.base = base
        self.head_dim = info.head_dim
        self.prefill_chunk_size = prefill_chunk_size
        self.question_tokens = question_tokens
        self.needs = policy.needs()
        self.layer_kinds = layout(model.config, len(attention_modules))  # what a KVPressCache must be built for
        # layer-wise budgets (PyramidKV) are spread over the layers kvpress compresses (info.layers: hybrid models'
        # sliding-window layers keep their own cache)
        budget_layers = info.layers or [m.layer_idx for m in attention_modules]
        # patched generate / forward calls running on any thread: unpatch() waits until there are none, so a call
        # never runs half patched (its cache compressed by some steps and read as a stock cache by the next)
        self._running = 0
        self._running_changed = threading.Condition()
        self.attention = BaseAttention(base, attention_modules[0])
        self.attn_implementation = ATTENTION_PREFIX + base
        self.hooks = ForwardHooks(self)
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
        register(model, self)

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
            bind(module, Binding(self, rotary, None if rank is None else (rank, len(budget_layers))))
            self._bound.append(weakref.ref(module))
            self._handles.append(module.register_forward_pre_hook(self._record_call, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._drop_call, always_call=True))
        for module in dict.fromkeys([model, decoder]):  # the model, and its decoder when that is another module
            self._handles.extend(self.hooks.install(module))
        if callable(getattr(model, "generate", None)):  # a base model (e.g. LlamaModel) has no generate
            self._set(model, "generate", wrap_generate(self, model.generate))
        if callable(getattr(model, "init_continuous_batching", None)):  # (generate_batch goes through it)
            self._set(model, "init_continuous_batching", refuse_continuous_batching)
        if self.prefill_chunk_size is not None:
            # the model's own forward is split where logits are kept (only the last ones a caller asks for); the
            # decoder's where it is called directly (its hidden states): either way each chunk is one decoder forward
            for module, output in ((model, "logits"), (decoder, "last_hidden_state")):
                if module is decoder and output == "logits":
                    continue  # a base model: the decoder alone
                self._set(module, "forward", wrap_forward(module.forward, self.prefill_chunk_size,
                                                          self.question_tokens, output, self.hooks.after_prompt,
                                                          self.running, self.serves_this_thread))
        self._set(model, "__deepcopy__", self._copy_model)

    def _set(self, module, name: str, value) -> None:
        """An instance attribute of `module`, put back as it was by _restore."""
        self._attributes.append((weakref.ref(module), name, module.__dict__.get(name, _ABSENT)))
        module.__dict__[name] = value

    @property
    def model(self):
        return self._model()

    def serves_this_thread(self) -> bool:
        """Whether calls on this thread run patched. A caller's own patch serves every thread; a ScopedPatch only
        the kvpress calls inside its scope (scoped.py): the model runs unpatched for everything else."""
        return True

    @property
    def decoder(self):
        return self._decoder()

    # -- hooks: what each forward hands kvpress (per thread, dropped when the module's forward ends)
    def _record_call(self, module, args, kwargs):
        if not self.serves_this_thread():
            return
        hidden = (args[0] if args else kwargs.get("hidden_states")) if self.needs.hidden_states else None
        self.live.calls[module] = (given_cache(kwargs), hidden)

    def _drop_call(self, module, args, output):
        self.live.calls.pop(module, None)

    # -- calls in flight (what unpatch waits for)
    def enter_call(self, cache) -> None:
        """A patched call (given `cache`, None for generate) starts running on this thread."""
        with self._running_changed:
            self._running += 1
        self.live.entered.append(cache)
        if isinstance(cache, KVPressCache):
            cache.patched_forwards += 1

    def exit_call(self) -> None:
        """The innermost patched call running on this thread returns (or raises)."""
        cache = self.live.entered.pop()
        if isinstance(cache, KVPressCache):
            cache.patched_forwards -= 1
        with self._running_changed:
            self._running -= 1
            self._running_changed.notify_all()

    @contextlib.contextmanager
    def running(self, cache):
        """A patched call (given `cache`) running on this thread, for as long as the block runs."""
        self.enter_call(cache)
        try:
            yield
        finally:
            self.exit_call()

    # -- undo
    def unpatch(self) -> None:
        """Restore the model exactly as it was before patch_model, once no generate or forward call is running on
        it (calls that other threads start meanwhile are waited for too)."""
        if self.model is None or patch_of(self.model) is not self:
            return
        if self.live.entered:
            raise RuntimeError("unpatch() was called inside a generate or forward call of the model it unpatches; "
                               "call it after that call returns")
        with self._running_changed:
            self._running_changed.wait_for(lambda: self._running == 0)
            with PATCHING:
                if patch_of(self.model) is self:
                    self._restore()
                    self.policy.claim(-1)

    def _restore(self) -> None:
        """Undo what _install did (all of it, or the part it got through)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for ref in self._bound:
            module = ref()
            if module is not None:
                unbind(module, self)
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
        if model is not None:
            unregister(model, self)

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
        self._patch_copy(twin)
        return twin

    def _patch_copy(self, twin) -> None:
        """The copy of a patched model is patched again with the same policy and settings."""
        with PATCHING:
            Patch(twin, self.policy, self.base, model_info(twin, attention_modules_of(twin), self.head_dim),
                  self.prefill_chunk_size, self.question_tokens)

    def model_info(self) -> ModelInfo:
        """What policies see of the patched model (the ModelInfo a policy's for_model resolves against)."""
        return model_info(self.model, attention_modules_of(self.model), self.head_dim)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.unpatch()
        return False

    def __repr__(self):
        return f"Patch({type(self.model).__name__}, policy={self.policy.describe()}, base={self.base!r})"
