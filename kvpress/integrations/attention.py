"""The one attention function kvpress registers (kvpress_attention), and the model's own attention it runs inside
(BaseAttention). patch.py registers it and binds each attention module (registry.py); nothing happens at import.

Per call it reads the module's binding, the cache this thread's forward handed the module (Patch.live), builds the
policy's Context, lets the layer attend (the full, uncompressed view at prefill: prefill is exact), then runs the
policy's hook for the phase, which may evict.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..cache import KVPressCache, KVPressLayer
from ..cache.read import UNMASKED, Read
from ..heads import SINGLE, HeadShards
from ..kernels.online_softmax import Queries
from ..kernels.sparse_attention import Selection
from ..policies import Context, Policy, ReadView
from .hf import config_heads
from .registry import binding_of


def kvpress_attention(module, query, key, value, attention_mask, **kwargs):
    binding = binding_of(module)
    if binding is None:
        raise RuntimeError(f"{type(module).__name__} runs kvpress attention but is not patched by kvpress")
    patch = binding.patch
    if not patch.serves_this_thread():  # a kvpress call's own patch, outside its scope: the model's own attention
        return patch.attention.plain(module, query, key, value, attention_mask, **kwargs)
    cache, hidden_states = patch.live.calls.get(module, (None, None))
    if cache is None and patch.live.entered and isinstance(patch.live.entered[-1], KVPressCache):
        # the model's forward was given a KVPressCache but this module was not (a transformers release that passes
        # it under another name): running it would read and keep nothing compressed
        raise RuntimeError(f"kvpress: {type(module).__name__} (layer {module.layer_idx}) ran without the KVPressCache "
                           f"its model's forward was given; transformers passed it under a name kvpress does not "
                           f"read (kvpress reads `cache` and `past_key_values`)")
    layer = cache.layers[module.layer_idx] if isinstance(cache, KVPressCache) else None
    if not isinstance(layer, KVPressLayer):  # no cache, a stock cache, or a stock (sliding) layer
        return patch.attention.plain(module, query, key, value, attention_mask, **kwargs)
    if layer.prefix is not None and (cache.read_policy is not None or patch.policy.reads_whole_cache):
        layer.unshare()  # a step over a shared context that reads or changes the whole view: each row its own copy

    # Every chunk of a chunked prefill is a prefill step: the policy compresses after each one. A probe (extra
    # tokens a model-level hook runs over the cache) reads everything and changes nothing.
    state = cache.forward_state
    prompt_tokens, prompt_length = state.chunked_prompt or (None, None)
    if layer.captured:  # a traced step on a prepared room: a decode or extend step (its counters are on the device)
        phase = "decode" if query.shape[2] == 1 else "extend"
    elif state.probe is not None:
        phase = "probe"
    elif state.recompute is not None:  # stored tokens computed again: their slots rewritten, nothing appended
        phase = "recompute"
    elif layer.seen == layer.last_q_len or prompt_tokens is not None:  # nothing before this forward's tokens
        phase = "prefill"
    else:
        phase = "decode" if layer.last_q_len == 1 else "extend"
    ctx = Context(
        module=module, layer_idx=module.layer_idx, layer=layer, phase=phase, query=query,
        scaling=kwargs.get("scaling", getattr(module, "scaling", query.shape[-1] ** -0.5)),
        softcap=kwargs.get("softcap"), sliding_window=kwargs.get("sliding_window"),
        prompt_tokens=prompt_tokens, prompt_length=prompt_length, observers=state.observers, shared=state.shared,
        budget_layer=binding.budget_layer,
        rope_positions=kwargs.get("position_ids"), rotary=binding.rotary, hidden_states=hidden_states,
        shards=HeadShards.of(query.shape[1], config_heads(module.config)[0]) if patch.needs.all_heads else SINGLE,
    )
    policy = patch.policy
    # A read view: the cache's draft view during self-speculation, else a read policy after prefill.
    view = cache.read_policy
    if view is None and isinstance(policy, ReadView) and phase not in ("prefill", "probe", "recompute"):
        view = policy
    positions = state.recompute.to(query.device) if phase == "recompute" else ctx.query_positions()
    read = Read(
        Queries(query, positions, ctx.scaling, ctx.softcap, ctx.sliding_window),
        keys=policy.key_view(ctx) if policy.rewrites_keys else None,
        select=(lambda: Selection(*_selection(view, ctx))) if isinstance(view, ReadView) else None,
        precision=None if view is None else view.read_precision,
        probabilities=phase == "decode" and patch.needs.probabilities,
        prior=policy.prior_state(ctx),
    )

    def base(q, keys, values, mask):
        if mask is None:
            return patch.attention.plain(module, q, keys, values, attention_mask, **kwargs)[0]
        return patch.attention.masked(module, q, keys, values, None if mask is UNMASKED else mask, **kwargs)[0]

    output, ctx.probs = layer.attend(read, base)
    # Attention above used the full, uncompressed view (prefill is exact); now the policy may evict. What it keeps
    # (scores, statistics, codes) must hold no autograd history, whether or not the caller runs under no_grad.
    with torch.no_grad():
        if phase == "recompute":
            pass  # the tokens' slots were rewritten (cache.update); the policy's hooks see nothing new
        elif phase == "probe":
            state.probe(ctx)
        elif layer.captured:
            # what a policy observes runs in the graph (in place); its decode hook, which may restructure the layer
            # (a codec's flush, an evictor's cut every slack + 1 steps), runs on the host after it (forwards.py)
            policy.observe(ctx)
            layer.room.context = ctx
        else:
            _policy_step(policy, ctx)
    return output, None


def _policy_step(policy: Policy, ctx: Context) -> None:
    policy.observe(ctx)
    if ctx.phase == "prefill":
        policy.on_prefill(ctx)
    else:
        after_step(policy, ctx)


def after_step(policy: Policy, ctx: Context) -> None:
    """The policy's hook after a decode or extend step has attended (on the host, after a captured step's graph)."""
    with torch.no_grad():
        if ctx.phase == "decode":
            policy.on_decode(ctx)
        else:
            policy.on_extend(ctx)


def _selection(view, ctx: Context):
    indices, valid = view.select(ctx)
    return indices, valid & ctx.layer.key_valid().gather(-1, indices)


# ---------------------------------------------------------------------------- the model's own attention
# cuDNN's fused attention builds a new execution plan for every key length it meets, and a decode step's key length
# grows by one each step: on an H100 (torch 2.11, cuDNN 9) each such call spent 28 ms on the host against 20 us
# on the GPU. kvpress's reads of a CUDA cache go to torch's other sdpa backends (flash, memory-efficient, math).
# The choice is torch's process-wide flag set for the duration of the call; a thread that enters and leaves it
# while another reads may let that read take cuDNN again, which costs time only.
_NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa_backends(query: torch.Tensor):
    return sdpa_kernel(_NOT_CUDNN) if query.is_cuda else contextlib.nullcontext()


def eager_function(attention_module):
    """The model's own eager attention (transformers keeps it in the modeling file, not in the registry)."""
    fn = getattr(sys.modules[type(attention_module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise ValueError(
            f"attn_implementation='eager': {type(attention_module).__name__}'s module has no eager_attention_forward; "
            f"load the model with attn_implementation='sdpa'"
        )
    return fn


class BaseAttention:
    """The attention implementation a patched model was loaded with (sdpa / eager / flash), which kvpress's attention
    runs over what each layer lets it read."""

    def __init__(self, base: str, attention_module):
        self.base = base
        self.function = eager_function(attention_module) if base == "eager" else ALL_ATTENTION_FUNCTIONS[base]

    def plain(self, module, query, key, value, attention_mask, **kwargs):
        """The base implementation with the model's own mask."""
        if _packs(self.base, query, key, attention_mask, kwargs):
            return _grouped_sdpa(query, key, value, attention_mask, kwargs)
        with _sdpa_backends(query):
            return self.function(module, query, key, value, attention_mask, **kwargs)

    def masked(self, module, query, key, value, allowed, **kwargs):
        """Base attention with kvpress's own boolean mask [B, Hq, q, T] (a compacted layer), or none (None: every
        query reads every slot)."""
        if self.base == "eager":
            mask = None
            if allowed is not None:
                mask = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
                mask = mask.masked_fill(~allowed, torch.finfo(query.dtype).min)
            return self.function(module, query, key, value, mask, **kwargs)
        # sdpa takes the boolean mask as is; flash kernels cannot take an arbitrary mask, so sdpa serves them.
        if _packs(self.base, query, key, allowed, kwargs):
            return _grouped_sdpa(query, key, value, allowed, kwargs)
        with _sdpa_backends(query):
            return sdpa_attention_forward(module, query, key, value, allowed, **kwargs)


# A few query rows with a mask over a long grouped-query cache (a speculative verification, a question extending a
# compressed context): transformers' sdpa copies every key and value once per query head of the group when a mask is
# given (its GQA path takes no mask), which at 16K slots on CPU cost 0.5 s of a 0.8 s forward. Each KV head's group
# of query rows read as one head instead (rows x group against that head's keys, the mask repeated per group) is the
# same attention without the copy. CPU only: on CUDA a masked call may fall to another kernel (not measured yet).
PACKED_ROWS = 64


def _packs(base: str, query, key, mask, kwargs) -> bool:
    groups = query.shape[1] // key.shape[1]
    return (base == "sdpa" and query.device.type == "cpu" and groups > 1 and 1 < query.shape[2] <= PACKED_ROWS
            and mask is not None and mask.dim() == 4 and kwargs.get("softcap") is None
            and kwargs.get("position_bias") is None and not kwargs.get("output_attentions"))


def _grouped_sdpa(query, key, value, mask, kwargs):
    """sdpa of query [B, Hq, q, D] over key/value [B, Hkv, T, D] with mask [B, 1 or Hq, q, T], as Hkv heads of
    group x q rows; returns transformers' layout ([B, q, Hq, D], None)."""
    batch, hq, rows, dim = query.shape
    hkv, slots = key.shape[1], key.shape[2]
    group = hq // hkv
    packed = query.reshape(batch, hkv, group * rows, dim)
    mask = mask.expand(batch, mask.shape[1], rows, slots)
    mask = mask.repeat(1, 1, group, 1) if mask.shape[1] == 1 else mask.reshape(batch, hkv, group * rows, slots)
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask,
                                                           dropout_p=kwargs.get("dropout", 0.0),
                                                           scale=kwargs.get("scaling"))
    return out.reshape(batch, hq, rows, value.shape[-1]).transpose(1, 2).contiguous(), None
