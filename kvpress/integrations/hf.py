"""The one attention integration: the attention function kvpress registers, what it reads per attention module
(bindings, the live cache of each call), and the helpers the patch and its callers share. patch.py installs it on a
model (patching.py checks everything first); nothing happens at import.

Inside every supported HF attention module the order is projections -> RoPE -> cache.update -> attention
function. So the attention function sees the post-RoPE query and the layer's stored keys/values; it runs
the model's own base implementation (sdpa / eager / flash), then lets the policy compact the layer.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..cache import KVPressCache, KVPressLayer
from ..cache.layer import UNMASKED, Read
from ..kernels.online_softmax import Queries
from ..kernels.sparse_attention import Selection
from ..formats.calibration import model_identity
from ..policies import Context, Policy, ReadView
from ..policies.base import ModelInfo
from ..heads import SINGLE, HeadShards
from ..positions import Rotary

if TYPE_CHECKING:  # annotations only
    from .patch import Patch

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
        self.forwards = []  # decoder forwards in flight (patch.py's _Forward), innermost last


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
    if view is None and isinstance(policy, ReadView) and phase not in ("prefill", "probe"):
        view = policy
    read = Read(
        Queries(query, ctx.query_positions(), ctx.scaling, ctx.softcap, ctx.sliding_window),
        keys=policy.key_view(ctx) if policy.rewrites_keys else None,
        select=(lambda: Selection(*_selection(view, ctx))) if isinstance(view, ReadView) else None,
        precision=None if view is None else view.read_precision,
        probabilities=phase == "decode" and patch.needs.probabilities,
    )

    def base(q, keys, values, mask):
        if mask is None:
            return patch.base_attention(module, q, keys, values, attention_mask, **kwargs)[0]
        return patch.masked_attention(module, q, keys, values, None if mask is UNMASKED else mask, **kwargs)[0]

    output, ctx.probs = layer.attend(read, base)
    # Attention above used the full, uncompressed view (prefill is exact); now the policy may evict. What it keeps
    # (scores, statistics, codes) must hold no autograd history, whether or not the caller runs under no_grad.
    with torch.no_grad():
        if phase == "probe":
            cache.probe(ctx)
        else:
            _policy_step(policy, ctx)
    return output, None


def _policy_step(policy: Policy, ctx: Context) -> None:
    policy.observe(ctx)
    if ctx.phase == "prefill":
        policy.on_prefill(ctx)
    elif ctx.phase == "decode":
        policy.on_decode(ctx)
    else:
        policy.on_extend(ctx)


def _selection(view, ctx: Context):
    indices, valid = view.select(ctx)
    return indices, valid & ctx.layer.key_valid().gather(-1, indices)




# cuDNN's fused attention builds a new execution plan for every key length it meets, and a decode step's key length
# grows by one each step: on an H100 (torch 2.11, cuDNN 9) each such call spent 28 ms on the host against 20 us
# on the GPU. kvpress's reads of a CUDA cache go to torch's other sdpa backends (flash, memory-efficient, math).
# The choice is torch's process-wide flag set for the duration of the call; a thread that enters and leaves it
# while another reads may let that read take cuDNN again, which costs time only.
_NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa_backends(query: torch.Tensor):
    return sdpa_kernel(_NOT_CUDNN) if query.is_cuda else contextlib.nullcontext()


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


# ---------------------------------------------------------------------------- discovery
def model_info(model, modules, head_dim: int) -> ModelInfo:
    """What policies see of a transformers model before it is patched (Policy.for_model)."""
    by_index = {m.layer_idx: m for m in modules}
    source = getattr(model.config, "_name_or_path", "")  # the folder it was loaded from, a hub name, or nothing
    folder = Path(source) if source and Path(source).is_dir() else None
    return ModelInfo(config=model.config.get_text_config(decoder=True), layers=list(by_index), head_dim=head_dim,
                     identity=lambda: model_identity(model), folder=folder,
                     rotary=lambda i: Rotary.of(model, by_index[i]), model=model, modules=modules)


def attention_modules_of(model) -> list[torch.nn.Module]:
    """Attention modules that follow transformers' attention-interface pattern: a causal self-attention module with
    a layer index (Llama-style GQA modules, and GPT-2 / GPT-NeoX / OPT, which have no KV-head groups)."""
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "is_causal")]


def decoder_of(model) -> torch.nn.Module:
    """The module that runs `model`'s attention layers and takes its cache: `model.model` of a causal LM (what
    NVIDIA kvpress's pipeline and many scripts call directly), the model itself for a base model. Every forward of
    the model goes through it, so the patch's hooks sit there."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    modules = attention_modules_of(model)
    if isinstance(decoder, torch.nn.Module) and modules and all(
            any(m is n for n in decoder.modules()) for m in modules[:1] + modules[-1:]):
        return decoder
    return model


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
