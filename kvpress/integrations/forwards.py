"""What happens around every forward of a patched model: the model-level hooks (on the model and on its decoder),
and the model-level pass a policy's after_prefill gets after a prompt.

Every forward, whoever calls it (the model, its decoder directly, a chunk of a chunked prefill), is checked
(checks.py) before it changes anything. The outermost patched forward serves the call: the decoder's forward inside
the model's does nothing more (and under torch.compile of the model its hooks, traced, are no-ops: the model's own
hooks run outside the graph). A forward that raises once it could change its cache leaves the cache empty again (a
prompt) or refused (anything else).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from ..cache import KVPressCache
from ..heads import SINGLE, HeadShards
from ..policies.base import ModelPass
from .attention import after_step
from .checks import check_forward
from .hf import config_heads, given_cache, renamed_for, with_cache


@dataclass
class ForwardInFlight:
    """A patched forward in flight on this thread: its cache, and how far it got (what a failure leaves behind)."""

    cache: object
    module: object  # the model or its decoder: whichever was called (the outermost serves the call)
    checked: bool = False  # its inputs passed every check: from here on it may change the cache
    done: bool = False  # it returned, the model-level hook included
    was_empty: bool = False  # it was a prompt's forward (the cache was empty)
    marks: tuple = ()  # the cache's append counters when it started


class ForwardHooks:
    """The model-level hooks of one patch (Patch.live.forwards holds this thread's forwards in flight)."""

    def __init__(self, patch):
        self.patch = patch

    def install(self, module) -> list:
        """Hook `module` (the model, or its decoder); returns the hooks' handles."""
        hooks = [self._enter, self._check, self._after, self._exit]
        if module is self.patch.model:
            hooks = [torch.compiler.disable(h) for h in hooks]
        enter, check, after, exit_ = hooks
        return [module.register_forward_pre_hook(enter, with_kwargs=True, prepend=True),
                module.register_forward_pre_hook(check, with_kwargs=True),
                module.register_forward_hook(after, with_kwargs=True),
                module.register_forward_hook(exit_, with_kwargs=True, always_call=True)]

    def _inner(self, module) -> bool:
        """Whether this hook does nothing for this forward: one inside the patched forward serving the call, or any
        forward on a thread the patch does not serve (a ScopedPatch's outside its scope: the model runs unpatched)."""
        patch = self.patch
        if not patch.serves_this_thread():
            return True
        if module is patch.model:
            return False
        return torch.compiler.is_compiling() or bool(patch.live.forwards) and patch.live.forwards[-1].module is patch.model

    def _enter(self, module, args, kwargs):
        if self._inner(module):
            return
        renamed = renamed_for(module, kwargs) if module is self.patch.model else None
        kwargs = renamed or kwargs
        cache = given_cache(kwargs)
        self.patch.enter_call(cache)
        self.patch.live.forwards.append(ForwardInFlight(cache, module))
        return None if renamed is None else (args, renamed)

    def _check(self, module, args, kwargs):
        if self._inner(module):
            return
        check_forward(self.patch, module, args, kwargs)
        forward = self.patch.live.forwards[-1]
        cache = forward.cache
        if isinstance(cache, KVPressCache):
            cache.set_attention_mask(kwargs.get("attention_mask"))
            state = cache.forward_state
            state.shared = {}
            # a prompt's forward; a chunk of a chunked prefill is not (the chunk loop runs the after-prompt step)
            state.prefilling = state.probe is None and state.chunked_prompt is None and cache.get_seq_length() == 0
            forward.was_empty, forward.marks = cache.get_seq_length() == 0, cache.append_marks()
            if cache.capture_reserve is not None and not state.prefilling and state.probe is None \
                    and state.chunked_prompt is None:
                cache.prepare_step(_new_tokens(args, kwargs))  # the room a captured step writes into
                for _, layer in cache.kvpress_layers():
                    if layer.room is not None:
                        self.patch.policy.prepare_step(layer)  # and what the policy updates in it
        forward.checked = True

    def _after(self, module, args, kwargs, output):
        if self._inner(module):
            return
        cache = given_cache(kwargs)
        if isinstance(cache, KVPressCache) and cache.capture_reserve is not None:
            # a traced step appended by index and observed; the policy's decode hook runs here, outside the graph,
            # on the layer the host has counted (its probabilities were over the whole room: recomputed if read)
            for layer in cache.settle_step():
                ctx, layer.room.context = layer.room.context, None
                after_step(self.patch.policy, dataclasses.replace(ctx, probs=None))
        if isinstance(cache, KVPressCache) and cache.forward_state.prefilling:
            self.after_prompt(cache, kwargs, args, output)
        self.patch.live.forwards[-1].done = True

    def _exit(self, module, args, kwargs, output):
        # runs even when the forward raised (always_call); a forward that began before this patch existed (on
        # another thread) entered nothing and leaves nothing
        forwards = self.patch.live.forwards
        if not self.patch.serves_this_thread() or not forwards or forwards[-1].module is not module or (
                module is not self.patch.model and torch.compiler.is_compiling()):
            return
        forward = forwards.pop()
        try:
            if forward.checked and not forward.done:
                _after_failure(forward)
        finally:
            if isinstance(forward.cache, KVPressCache) and not forwards:
                forward.cache.forward_state.ended()
            self.patch.exit_call()

    def after_prompt(self, cache: KVPressCache, kwargs, args=(), output=None) -> None:
        """After a prompt forward (or one chunk of a chunked prefill) that returned `output`: the model-level hook,
        then the bytes held."""
        cache.forward_state.prefilling = False
        if self.patch.needs.model_pass:
            with torch.no_grad():  # what the hook keeps must hold no autograd history
                self.patch.policy.after_prefill(self.model_pass(cache, kwargs, args, output))
        cache.trim_stock_layers()
        cache.prefill_nbytes = cache.nbytes()
        cache.prefill_kv_nbytes = sum(row["kv_bytes"] for row in cache.stats())

    # -- the model-level hook
    def model_pass(self, cache: KVPressCache, kwargs, args=(), output=None) -> ModelPass:
        """What after_prefill sees after a prompt forward with these arguments that returned `output`."""
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
        prompt_tokens, prompt_length = cache.forward_state.chunked_prompt or (None, None)
        model = self.patch.model
        shards, layers = SINGLE, cache.kvpress_layers() if self.patch.needs.all_heads else []
        if layers:
            shards = HeadShards.of(layers[0][1].num_kv_heads, config_heads(model.config.get_text_config(decoder=True))[1])
        return ModelPass(model, cache, ids, mask, next_positions, prompt_tokens, prompt_length,
                         functools.partial(self.probe, cache), shards=shards, logits=_last_logits(output))

    def probe(self, cache: KVPressCache, input_ids, attention_mask, position_ids, on_layer, view=None):
        """Run `input_ids` [B, n] over the cache (attending to everything it holds, or to what the ReadView `view`
        selects), calling `on_layer(ctx)` in every kvpress layer after attention; then put every layer back exactly
        as it was (nothing the probe appended stays; seen and positions are untouched). Returns the next-token
        logits [B, vocab] after the last token (None for a bare decoder)."""
        saved = cache.checkpoint(room=input_ids.shape[1])
        state = cache.forward_state
        mask = state.token_mask
        state.probe = on_layer
        read_policy, cache.read_policy = cache.read_policy, view
        model = self.patch.model
        try:
            with torch.no_grad():  # one logit row at most: a probe needs what attention sees, and the next token
                logits = {} if model is self.patch.decoder else dict(logits_to_keep=1)
                output = model(**with_cache(model, cache, input_ids=input_ids, attention_mask=attention_mask,
                                            position_ids=position_ids, use_cache=True, **logits))
        finally:
            state.probe = None
            cache.read_policy = read_policy
            cache.restore(saved)
            state.token_mask = mask
        return _last_logits(output)


def _last_logits(output) -> torch.Tensor | None:
    """[B, vocab] fp32 next-token logits after a forward's last token; None when it returned none (a bare decoder's
    hidden states, a tuple)."""
    logits = getattr(output, "logits", None)
    return None if logits is None else logits[:, -1].float()


def _new_tokens(args, kwargs) -> int:
    tokens = kwargs.get("input_ids", args[0] if args else None)
    return (tokens if tokens is not None else kwargs["inputs_embeds"]).shape[1]


def _after_failure(forward: ForwardInFlight) -> None:
    """A forward that raised once it could change its cache: a prompt's leaves the cache empty again (a retry is
    a prompt again, never a continuation of half a prompt); any other that appended to some layer leaves the
    cache refused from then on. A probe puts the cache back itself."""
    cache = forward.cache
    if not isinstance(cache, KVPressCache) or cache.forward_state.probe is not None or \
            cache.append_marks() == forward.marks:
        return
    if forward.was_empty:
        cache.clear()
    else:
        cache.broken = ("a forward on this cache raised after some of its layers had appended that forward's "
                        "tokens, so its layers no longer agree")
