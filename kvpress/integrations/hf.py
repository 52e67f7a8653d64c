"""The one attention integration: a registered attention function + mask function, hooks that bind the live
cache, and patch_model / unpatch (instance-level only; nothing happens at import).

Inside every supported HF attention module the order is projections -> RoPE -> cache.update -> attention
function. So the attention function sees the post-RoPE query and the layer's stored keys/values; it runs
the model's own base implementation (sdpa / eager / flash), then lets the policy compact the layer.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import numbers
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..cache import KVPressCache, KVPressLayer
from ..cache.layer import UNMASKED, Read
from ..kernels.online_softmax import Queries
from ..kernels.sparse_attention import Selection
from ..policies import Context, Policy, resolve_policy
from ..policies.base import ModelInfo, ModelPass
from ..heads import SINGLE, HeadShards
from ..formats.calibration import model_identity
from ..positions import Rotary

SUPPORTED_BASES = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
_PREFIX = "kvpress_"

# transformers 5.2x renamed the forwards' cache argument from `past_key_values` to `cache` (the old name is accepted,
# deprecated, until 5.40). The hooks read whichever a forward was given; kvpress's own calls pass the name the model's
# forward declares. One place for the name, so a forward's cache is never missed (a missed cache would run the model
# uncompressed).
def given_cache(kwargs: dict):
    """The cache a forward (or generate call) was given, under either name; None when none was."""
    cache = kwargs.get("cache")
    return kwargs.get("past_key_values") if cache is None else cache


def cache_argument(model) -> str:
    """The name `model`'s forward takes its cache under."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def with_cache(model, cache, **kwargs) -> dict:
    """Forward arguments `kwargs` plus `cache` under the name `model` takes it."""
    return {**kwargs, cache_argument(model): cache}


_BINDINGS: "weakref.WeakKeyDictionary[torch.nn.Module, _Binding]" = weakref.WeakKeyDictionary()
_PATCHES: "weakref.WeakKeyDictionary[torch.nn.Module, Patch]" = weakref.WeakKeyDictionary()
_LAST_STATS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


@dataclass
class _Binding:
    """Per attention module: its patch, its RoPE (for policies that need it) and its (rank, count) among the
    layers whose budget kvpress spreads. What a forward in flight hands the module (its cache, its input hidden
    states) is not here: it lives per thread on the patch (Patch.live), so concurrent forwards never see each
    other's cache."""

    patch: "Patch"
    rotary: Rotary | None = None
    budget_layer: tuple[int, int] | None = None


class _InFlight(threading.local):
    """Per thread: attention module -> (cache, input hidden states) of the forward it is running, and the patched
    generate / forward calls this thread has entered (innermost last: the cache a forward was given, None for a
    generate call)."""

    def __init__(self):
        self.calls = {}
        self.entered = []


# ---------------------------------------------------------------------------- the attention function
def kvpress_attention(module, query, key, value, attention_mask, **kwargs):
    binding = _BINDINGS.get(module)
    if binding is None:
        raise RuntimeError(f"{type(module).__name__} runs kvpress attention but is not patched by kvpress")
    patch = binding.patch
    cache, hidden_states = patch.live.calls.get(module, (None, None))
    if cache is None and patch.live.entered and isinstance(patch.live.entered[-1], KVPressCache):
        # the model's forward was given a KVPressCache but this module was not (a transformers release that passes
        # it under another name): running it would read and keep nothing compressed
        raise RuntimeError(f"kvpress: {type(module).__name__} (layer {module.layer_idx}) ran without the KVPressCache "
                           f"its model's forward was given; transformers passed it under a name kvpress does not "
                           f"read (kvpress reads `cache` and `past_key_values`)")
    layer = cache.layers[module.layer_idx] if isinstance(cache, KVPressCache) else None
    if not isinstance(layer, KVPressLayer):  # no cache, a stock cache, or a stock (sliding) layer
        return patch.base_attention(module, query, key, value, attention_mask, **kwargs)

    past = layer.seen - layer.last_q_len
    # Every chunk of a chunked prefill is a prefill step: the policy compresses after each one. A probe (extra
    # tokens a model-level hook runs over the cache) reads everything and changes nothing.
    prompt_tokens, prompt_length = cache.chunked_prompt or (None, None)
    if cache.probe is not None:
        phase = "probe"
    elif past == 0 or prompt_tokens is not None:
        phase = "prefill"
    else:
        phase = "decode" if layer.last_q_len == 1 else "extend"
    ctx = Context(
        module=module, layer_idx=module.layer_idx, layer=layer, phase=phase, query=query,
        scaling=kwargs.get("scaling", getattr(module, "scaling", query.shape[-1] ** -0.5)),
        softcap=kwargs.get("softcap"), sliding_window=kwargs.get("sliding_window"),
        prompt_tokens=prompt_tokens, prompt_length=prompt_length, observers=cache.observers,
        budget_layer=binding.budget_layer,
        rope_positions=kwargs.get("position_ids"), rotary=binding.rotary, hidden_states=hidden_states,
        shards=HeadShards.of(query.shape[1], _config_heads(module.config)[0]) if patch.needs.all_heads else SINGLE,
    )
    policy = patch.policy
    # A read view: the cache's draft view during self-speculation, else a read policy after prefill.
    view = cache.read_policy
    if view is None and policy.selects and phase not in ("prefill", "probe"):
        view = policy
    read = Read(
        Queries(query, ctx.query_positions(), ctx.scaling, ctx.softcap, ctx.sliding_window),
        keys=policy.key_view(ctx) if policy.rewrites_keys else None,
        select=(lambda: Selection(*_selection(view, ctx))) if view is not None and view.selects else None,
        precision=None if view is None else view.read_precision,
        probabilities=phase == "decode" and patch.needs.probabilities,
    )

    def base(q, keys, values, mask):
        if mask is None:
            return patch.base_attention(module, q, keys, values, attention_mask, **kwargs)[0]
        return patch.masked_attention(module, q, keys, values, None if mask is UNMASKED else mask, **kwargs)[0]

    output, ctx.probs = layer.attend(read, base)
    out = (output, None)
    # Attention above used the full, uncompressed view (prefill is exact); now the policy may evict.
    if phase == "probe":
        cache.probe(ctx)
        return out
    policy.observe(ctx)
    if phase == "prefill":
        policy.on_prefill(ctx)
    elif phase == "decode":
        policy.on_decode(ctx)
    else:
        policy.on_extend(ctx)
    return out


def _selection(view, ctx: Context):
    indices, valid = view.select(ctx)
    return indices, valid & ctx.layer.key_valid().gather(-1, indices)


# ---------------------------------------------------------------------------- patch
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
            model.forward = self._wrap_forward(model.forward)
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

    # -- chunked prefill
    def _wrap_forward(self, forward):
        chunk = self.prefill_chunk_size

        @functools.wraps(forward)
        def chunked_prefill_forward(*args, **kwargs):
            if len(args) == 1 and "input_ids" not in kwargs:
                kwargs["input_ids"], args = args[0], ()
            cache = given_cache(kwargs)
            tokens = kwargs.get("input_ids")
            tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
            mask = kwargs.get("attention_mask")
            keep = kwargs.get("logits_to_keep", 0)
            if (args or not isinstance(cache, KVPressCache) or cache.get_seq_length() != 0 or tokens is None
                    or (tokens.shape[1] <= chunk and cache.question_ids is None)  # one chunk, no question to add
                    or (mask is not None and mask.dim() != 2)
                    or not isinstance(keep, int)):
                return forward(*args, **kwargs)  # not a prompt we can split: one shot
            return self._chunked_prefill(forward, cache, chunk, tokens.shape[0], tokens.shape[1], mask, keep,
                                         kwargs)

        return chunked_prefill_forward

    def _chunked_prefill(self, forward, cache, chunk, batch, length, mask, logits_to_keep, kwargs):
        """Feed the prompt `chunk` tokens at a time (the first chunk takes the remainder); after each chunk every
        kvpress layer runs the policy's prefill hook and the model-level hook runs once, so the cache holds at most
        budget + one chunk. Budgets follow the whole prompt's length (see chunk_share in policies/base.py). With a
        known question (question_tokens, or the cache's question_ids), chunks that do not already end with it get it
        appended as observation queries: the policy judges the chunk with them (they are never kept), then every
        layer forgets them.
        Returns the last forward's output, with the logits the caller asked for (logits_to_keep: 0 = all)."""
        real = mask.sum(-1) if mask is not None else torch.full((batch,), length)
        ids = kwargs.get("input_ids")
        device = next(t for t in (ids, kwargs.get("inputs_embeds")) if t is not None).device
        question, question_from = self._question(cache, ids, length, batch)
        if question is not None:  # the question's RoPE positions: where it sits (or will sit) after the prompt
            n = question.shape[1]
            prompt_positions = kwargs.get("position_ids")
            if prompt_positions is None:
                prompt_positions = torch.arange(length, device=device)[None].expand(batch, -1)
            last = prompt_positions[..., -1:]
            question_positions = prompt_positions[..., length - n:] if question_from <= length else \
                last + torch.arange(1, n + 1, device=device)
        cache.chunked_prompt = (real.to(device), length)
        logits = []
        try:
            # Chunks end at the prompt's end (the remainder goes first): every row of a left-padded batch ends
            # there too, so each row's chunks hold exactly the tokens they hold when the row runs alone.
            first = length - (length - 1) // chunk * chunk
            for start, end in zip([0, *range(first, length, chunk)], range(first, length + 1, chunk)):
                step = dict(kwargs)
                for name in _PER_TOKEN_INPUTS:
                    if kwargs.get(name) is not None:
                        step[name] = kwargs[name][..., start:end] if name == "position_ids" else kwargs[name][:, start:end]
                if kwargs.get("cache_position") is not None:
                    step["cache_position"] = kwargs["cache_position"][start:end]
                if mask is not None:
                    step["attention_mask"] = mask[:, :end]
                # logits this chunk must return: all (0), its tail that falls in the last `logits_to_keep`, or
                # one that is dropped
                wanted = end - start if logits_to_keep == 0 else min(end - start, logits_to_keep - (length - end))
                step["logits_to_keep"] = max(wanted, 1) if logits_to_keep != 0 else 0
                observers = question.shape[1] if question is not None and end <= question_from else 0
                run = _with_observers(step, question, question_positions, start, end) if observers else step
                if observers:
                    run["logits_to_keep"] = 0 if logits_to_keep == 0 else step["logits_to_keep"] + observers
                    cache.observe_next(observers)
                cache.set_attention_mask(run.get("attention_mask"))
                out = forward(**run)
                if observers:
                    out.logits = out.logits[:, :-observers]
                    cache.forget_observers()
                self._after_prompt(cache, (), step)  # the chunk loop runs below the model's own hooks
                if wanted > 0:
                    logits.append(out.logits)
        finally:
            cache.chunked_prompt = None
            cache.observers = 0
        out.logits = torch.cat(logits, 1) if len(logits) > 1 else logits[0]
        return out

    def _question(self, cache, ids, length, batch):
        """(question ids [B, n] or None, the prompt position from which chunks already hold it)."""
        if cache.question_ids is None and self.question_tokens is None:
            return None, length + 1
        if ids is None:  # the question is appended to each chunk as token ids
            raise ValueError("a question for a chunked prefill (question_tokens, or KVPressCache(question_ids=...)) "
                             "needs the prompt as input_ids; allowed: input_ids, not inputs_embeds")
        if cache.question_ids is not None:
            question = cache.question_ids
            if question.shape[0] not in (1, batch):
                raise ValueError(f"question_ids of shape {tuple(question.shape)}; allowed: [1, n] or [batch={batch}, n]")
            return question.to(ids.device).expand(batch, -1), length + 1
        n = min(self.question_tokens, length)
        return ids[:, length - n:], length - n

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


_ABSENT = object()
_PER_TOKEN_INPUTS = ("input_ids", "inputs_embeds", "position_ids", "token_type_ids")


# cuDNN's fused attention builds a new execution plan for every key length it meets, and a decode step's key length
# grows by one each step: on an H100 (torch 2.11, cuDNN 9) each such call spent 28 ms on the host against 20 us
# on the GPU. kvpress's reads of a CUDA cache go to torch's other sdpa backends (flash, memory-efficient, math).
# The choice is torch's process-wide flag set for the duration of the call; a thread that enters and leaves it
# while another reads may let that read take cuDNN again, which costs time only.
_NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa_backends(query: torch.Tensor):
    return sdpa_kernel(_NOT_CUDNN) if query.is_cuda else contextlib.nullcontext()


def _with_observers(step: dict, question: torch.Tensor, question_positions: torch.Tensor, start: int,
                    end: int) -> dict:
    """One chunk's forward inputs extended with the question's tokens, right after the chunk in the cache, at the
    RoPE positions the question really has (the prompt's end): the question then weighs each chunk as it would
    weigh it in a one-shot prefill (RoPE distances included). They are real tokens of every row."""
    step, n = dict(step), question.shape[1]
    step["input_ids"] = torch.cat([step["input_ids"], question.to(step["input_ids"])], 1)
    positions = step.get("position_ids")
    if positions is None:
        positions = torch.arange(start, end, device=question.device)[None].expand(question.shape[0], -1)
    step["position_ids"] = torch.cat([positions, question_positions.to(positions).expand(positions.shape[0], -1)], -1)
    ahead = torch.arange(1, n + 1, device=question.device)
    if step.get("cache_position") is not None:
        step["cache_position"] = torch.cat([step["cache_position"], step["cache_position"][-1:] + ahead])
    if step.get("token_type_ids") is not None:
        step["token_type_ids"] = torch.cat([step["token_type_ids"], step["token_type_ids"][:, -1:].expand(-1, n)], 1)
    if step.get("attention_mask") is not None:
        mask = step["attention_mask"]
        step["attention_mask"] = torch.cat([mask, mask.new_ones(mask.shape[0], n)], 1)
    return step


def _config_heads(config) -> tuple[int, int]:
    """(query heads, KV heads) of the whole model, as its config states them (no GQA: as many KV as query heads)."""
    query = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None)  # GPT-2 / OPT configs have no KV-head count
    return query, kv or query


def _eager_function(attention_module):
    """The model's own eager attention (transformers keeps it in the modeling file, not in the registry)."""
    import sys

    fn = getattr(sys.modules[type(attention_module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise ValueError(
            f"attn_implementation='eager': {type(attention_module).__name__}'s module has no eager_attention_forward; "
            f"load the model with attn_implementation='sdpa'"
        )
    return fn


# ---------------------------------------------------------------------------- discovery and validation
def attention_modules_of(model) -> list[torch.nn.Module]:
    """Attention modules that follow transformers' attention-interface pattern: a causal self-attention module with
    a layer index (Llama-style GQA modules, and GPT-2 / GPT-NeoX / OPT, which have no KV-head groups)."""
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "is_causal")]


def patch_model(model, policy: str | Policy | None = "none", prefill_chunk_size: int | None = None,
                question_tokens: int | None = None, **params) -> Patch:
    """Make `model.generate` (and forwards given a KVPressCache) keep a compressed KV cache.

    `policy` is a name from `kvpress.list_policies()` or a Policy instance; `params` are its
    hyper-parameters (e.g. compression_ratio=0.75, or budget=512). `prefill_chunk_size` feeds long prompts
    in chunks and compresses after each one, so the cache never holds more than budget + one chunk (see
    docs/architecture.md for how this differs from one-shot prefill). `question_tokens=N` declares the prompt's
    last N tokens the question: each earlier chunk is then judged with the question appended as observation
    queries (CItruS-style; their K/V are dropped after the chunk). A question asked later can be given per cache
    instead: `KVPressCache(config, question_ids=ids)`. Returns a Patch: use it as a context manager or call
    `.unpatch()`. All checks run before the model is touched."""
    policy = resolve_policy(policy, **params)
    _check_chunk_size(prefill_chunk_size, policy)
    if question_tokens is not None:
        if isinstance(question_tokens, bool) or not isinstance(question_tokens, numbers.Integral) or question_tokens < 1:
            raise ValueError(f"question_tokens={question_tokens!r}; allowed values: None or an int >= 1")
        if prefill_chunk_size is None:
            raise ValueError(f"question_tokens={question_tokens} declares the question for a chunked prefill; a one-shot "
                             f"prefill already judges the prompt with it; allowed: question_tokens with "
                             f"prefill_chunk_size=<int>, or question_tokens=None")
        question_tokens = int(question_tokens)
    if model in _PATCHES:
        raise ValueError("model is already patched by kvpress; call .unpatch() on the existing patch first")
    modules = attention_modules_of(model)
    backend_ok = getattr(type(model), "is_backend_compatible", lambda: False)()
    if not modules or not backend_ok:
        raise ValueError(
            f"model: {type(model).__name__} does not run its attention through transformers' AttentionInterface "
            f"(the attention function kvpress hooks); allowed: models whose attention modules call "
            f"ALL_ATTENTION_FUNCTIONS, e.g. Llama, Mistral, Qwen2, Qwen3, Gemma3, Phi3, GPT-2, GPT-NeoX, OPT"
        )
    base = model.config._attn_implementation
    if base is not None and base.startswith(_PREFIX):
        raise ValueError("model is already patched by kvpress; call .unpatch() on the existing patch first")
    if base not in SUPPORTED_BASES:
        raise ValueError(f"attn_implementation={base!r} cannot be wrapped; allowed values: {list(SUPPORTED_BASES)}")
    text_config = model.config.get_text_config(decoder=True)
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    info = model_info(model, modules, head_dim)
    policy = policy.for_model(info)
    try:
        rotaries = [info.rotary(m.layer_idx) if policy.needs().rotary else None for m in modules]
    except ValueError as e:
        raise ValueError(f"policy {policy.describe()} needs the model's rotary embedding (RoPE): {e}") from None
    return Patch(model, policy, base, modules, rotaries, prefill_chunk_size, question_tokens)


def model_info(model, modules, head_dim: int) -> ModelInfo:
    """What policies see of a transformers model before it is patched (Policy.for_model)."""
    by_index = {m.layer_idx: m for m in modules}
    source = getattr(model.config, "_name_or_path", "")  # the folder it was loaded from, a hub name, or nothing
    folder = Path(source) if source and Path(source).is_dir() else None
    return ModelInfo(config=model.config.get_text_config(decoder=True), layers=list(by_index), head_dim=head_dim,
                     identity=lambda: model_identity(model), folder=folder,
                     rotary=lambda i: Rotary.of(model, by_index[i]), model=model, modules=modules)


def _check_chunk_size(chunk, policy: Policy) -> None:
    if chunk is None:
        return
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"prefill_chunk_size={chunk!r}; allowed values: None or an int >= 1")
    policy.check_chunking(chunk)


def unpatch(model) -> None:
    patch = _PATCHES.get(model)
    if patch is not None:
        patch.unpatch()


def cache_summary(cache: KVPressCache, policy: Policy | None = None) -> dict:
    layers = cache.stats()
    return dict(
        policy=policy.describe() if policy is not None else None,
        seen=max((row["seen"] for row in layers), default=0),
        kv_bytes=sum(row["kv_bytes"] for row in layers),
        bytes=cache.nbytes(),
        prefill_kv_bytes=cache.prefill_kv_nbytes,
        prefill_bytes=cache.prefill_nbytes,
        layers=layers,
    )


def last_cache_stats(model) -> dict:
    """Summary of the cache of the last `generate` run through a kvpress patch on `model`: tokens seen,
    bytes kept (total and right after prefill), and per-layer rows (seen, stored, kept per head, bytes)."""
    if model not in _LAST_STATS:
        raise ValueError("no kvpress generate has run on this model yet; call model.generate inside patch_model")
    return _LAST_STATS[model]
