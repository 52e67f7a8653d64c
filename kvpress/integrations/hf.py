"""What kvpress reads of a transformers model and of the calls made to it: where a forward's cache is, which modules
are its attention layers and which its decoder, what policies see of the model (ModelInfo), and the summary of a
cache a generate call leaves. Nothing here changes a model (patch.py installs; attention.py is the attention
function).

Inside every supported HF attention module the order is projections -> RoPE -> cache.update -> attention
function. So the attention function sees the post-RoPE query and the layer's stored keys/values; it runs
the model's own base implementation (sdpa / eager / flash), then lets the policy compact the layer.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from ..cache import KVPressCache
from ..formats.calibration import model_identity
from ..policies import Policy
from ..policies.base import ModelInfo
from ..positions import Rotary

SUPPORTED_BASES = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
# a patched model's attn_implementation is this prefix + its base implementation (e.g. kvpress_sdpa)
ATTENTION_PREFIX = "kvpress_"


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


def renamed_for(model, kwargs: dict) -> dict | None:
    """`kwargs` with a cache given as `cache=` moved to `past_key_values=` when `model`'s forward predates the rename
    (its **kwargs would swallow `cache` and run uncached); None when nothing needs to change. So the current name
    works on every transformers kvpress allows."""
    if kwargs.get("cache") is None or cache_argument(model) == "cache":
        return None
    if kwargs.get("past_key_values") is not None:
        raise ValueError("cache= and past_key_values= both given; allowed: one of them (the same argument, renamed)")
    out = {k: v for k, v in kwargs.items() if k != "cache"}
    out["past_key_values"] = kwargs["cache"]
    return out


def with_cache(model, cache, **kwargs) -> dict:
    """Forward arguments `kwargs` plus `cache` under the name `model` takes it."""
    return {**kwargs, cache_argument(model): cache}


# ---------------------------------------------------------------------------- discovery
def config_heads(config) -> tuple[int, int]:
    """(query heads, KV heads) of the whole model, as its config states them (no GQA: as many KV as query heads)."""
    query = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None)  # GPT-2 / OPT configs have no KV-head count
    return query, kv or query


def model_info(model, modules, head_dim: int) -> ModelInfo:
    """What policies see of a transformers model before it is patched (Policy.for_model)."""
    by_index = {m.layer_idx: m for m in modules}
    source = getattr(model.config, "_name_or_path", "")  # the folder it was loaded from, a hub name, or nothing
    folder = Path(source) if source and Path(source).is_dir() else None
    config = model.config.get_text_config(decoder=True)
    kinds = getattr(config, "layer_types", None)
    # the layers kvpress compresses: a KVPressCache(config) holds sliding-window layers as transformers' own layers
    layers = [i for i in by_index if kinds is None or kinds[i] != "sliding_attention"]
    return ModelInfo(config=config, layers=layers, head_dim=head_dim,
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


# ---------------------------------------------------------------------------- reporting
def cache_summary(cache: KVPressCache, policy: Policy | None = None) -> dict:
    layers = cache.stats()
    return dict(
        policy=policy.describe() if policy is not None else None,
        seen=max((row["seen"] for row in layers), default=0),
        kv_bytes=sum(row["kv_bytes"] for row in layers),
        bytes=cache.nbytes(),
        shared_bytes=cache.shared_nbytes(),  # the model's tables the cache reads (CommVQ's codebooks), not its own
        prefill_kv_bytes=cache.prefill_kv_nbytes,
        prefill_bytes=cache.prefill_nbytes,
        layers=layers,
    )
