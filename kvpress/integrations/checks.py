"""What a patched model's forwards and generate calls may be given. The model-level forward pre-hook (patch.py) calls
check_forward for every forward, whoever calls it, before the forward changes anything, and the generate wrapper
calls check_generate before generate starts: compression never switches itself off without a word, and a refused
call leaves its cache exactly as it was."""

from __future__ import annotations

import torch

from ..cache import KVPressCache
from .hf import given_cache
from .registry import patch_of


def check_forward(patch, decoder, args, kwargs) -> None:
    """Raise (ValueError for the caller's input, RuntimeError for a patch changed under the call) unless `patch` can
    serve this forward of `decoder` as asked."""
    if patch_of(patch.model) is not patch:  # unpatch() ran on another thread just as this forward started
        raise RuntimeError("kvpress: this model was unpatched (by another thread) as this forward started; "
                           "run the call again")
    if decoder.config._attn_implementation != patch.attn_implementation:
        raise RuntimeError(
            f"attn_implementation was changed to {decoder.config._attn_implementation!r} while kvpress patched "
            f"this model (it must stay {patch.attn_implementation!r}); unpatch() first, change it, then patch again")
    cache = given_cache(kwargs)
    if cache is not None and not isinstance(cache, KVPressCache):
        raise ValueError(
            f"{'cache' if kwargs.get('cache') is not None else 'past_key_values'}={type(cache).__name__}: a "
            f"kvpress-patched model compresses only a KVPressCache; "
            f"allowed values: kvpress.KVPressCache(model.config), or None (generate then makes one)")
    if not isinstance(cache, KVPressCache):
        return  # no cache: the model's own attention runs (attention weights included)
    asked = kwargs.get("output_attentions")
    if asked or (asked is None and getattr(decoder.config, "output_attentions", False)):
        raise ValueError(f"output_attentions=True: kvpress's attention ({patch.policy.describe()}) reads the "
                         f"KVPressCache's own storage and returns no attention weights; allowed: "
                         f"output_attentions=False, or the weights of the unpatched model (patch.unpatch())")
    if cache.question_ids is not None and patch.prefill_chunk_size is None:
        raise ValueError("KVPressCache(question_ids=...) gives the question to a chunked prefill, but this patch "
                         "prefills in one shot; allowed: patch_model(..., prefill_chunk_size=<int>), or a cache "
                         "without question_ids (a one-shot prefill judges the prompt with its own last tokens)")
    if cache.layer_kinds is None and "sliding_attention" in patch.layer_kinds[0]:
        raise ValueError("cache: a KVPressCache() built without the model's config would hold this model's "
                         "sliding-window layers as compressed layers, which kvpress (and its calibrations) leave to "
                         "transformers; allowed values: KVPressCache(model.config)")
    if cache.layer_kinds is not None and cache.layer_kinds != patch.layer_kinds:
        (kinds, window), (own, own_window) = cache.layer_kinds, patch.layer_kinds
        raise ValueError(f"cache: a KVPressCache built for another model's layers ({_describe(kinds, window)}); "
                         f"this model has {_describe(own, own_window)}; allowed values: KVPressCache(model.config)")
    prompt = cache.forward_state.probe is None and cache.get_seq_length() == 0
    if prompt and patch.needs.prompt_ids and kwargs.get("input_ids") is None and not args:
        raise ValueError(f"inputs_embeds: {patch.policy.describe()} reads the prompt's token ids after the prompt "
                         f"(KVzip replays them), which embeddings do not give back; allowed: input_ids")
    if cache.broken is not None:
        raise ValueError(f"cache: {cache.broken}; allowed values: a new kvpress.KVPressCache(model.config)")
    refusal = patch.policy.capture_refusal if cache.capture_reserve is not None else None
    if refusal:
        raise ValueError(f"KVPressCache(capture_reserve={cache.capture_reserve}): {patch.policy.describe()} {refusal}, "
                         f"which a decode step of fixed shapes cannot do yet; allowed: capture_reserve=None, or "
                         f"policies whose decode steps only append, store low-bit codes or evict with slack >= 1: "
                         f"none, snapkv / keydiff / kvzap (budget_allocation='uniform' or 'pyramid') at prefill, kivi, "
                         f"gear, zipcache, h2o / tova / streaming_llm with slack, compositions of a prefill evictor "
                         f"with a codec, quest")


def _describe(kinds: tuple, window: int | None) -> str:
    sliding = sum(kind == "sliding_attention" for kind in kinds)
    return f"{len(kinds)} layers, {sliding} of them sliding windows" + (f" of {window} tokens" if sliding else "")


# generate arguments that make transformers draft tokens, verify them in one forward and crop the rejected ones
_ASSISTED = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")


CONTINUOUS_BATCHING = ("continuous batching (generate_batch, init_continuous_batching, "
                       "generate(cache_implementation='paged'), transformers serve) runs transformers' own paged cache "
                       "and paged attention, which kvpress does not compress (it would hold every token); allowed: "
                       "model.generate(...) on the patched model (batches of prompts, left-padded), kvpress.ask for "
                       "many questions over one document, kvpress's vLLM plugin for serving (`kvpress serve`), or "
                       "unpatch() first (a kvpress call's own patch, e.g. kvpress.ask's, lasts while the call runs)")


def check_generate(patch, model, args, kwargs) -> None:
    """Raise ValueError, before generate starts, for a transformers decoding strategy the patch cannot serve, or
    input ids that do not extend what the given cache has seen."""
    cache, ids = given_cache(kwargs), kwargs.get("input_ids", args[0] if args else None)
    seen = cache.get_seq_length() if isinstance(cache, KVPressCache) else 0
    if seen and isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] <= seen:
        # transformers would feed ids[:, seen:] (nothing) and fail deep inside with "cannot reshape a tensor of 0
        # elements"; the usual cause is passing only the question after a compressed document
        raise ValueError(
            f"input_ids has {ids.shape[1]} tokens per row, but the cache given has already seen {seen}: generate takes "
            f"the whole sequence, the {seen} tokens the cache holds then the new ones (e.g. the document's ids + the "
            f"question's); allowed: input_ids longer than {seen} tokens (and a cache.fork() per question), or "
            f"kvpress.compress(...).ask(...), which does this for you")
    config = kwargs.get("generation_config") or model.generation_config
    given, configured = kwargs.get("cache_implementation"), getattr(config, "cache_implementation", None)
    if (given or configured) == "paged":
        raise ValueError(CONTINUOUS_BATCHING)
    for name, implementation in (("cache_implementation", given), ("generation_config.cache_implementation",
                                                                   configured)):
        if implementation not in (None, "dynamic"):  # (a KVPressCache grows as a dynamic cache does)
            raise ValueError(f"{name}={implementation!r}: a patched model's generate keeps its tokens in a KVPressCache "
                             f"(the compressed cache), which transformers' {implementation!r} cache would replace; "
                             f"allowed values: None or 'dynamic' (or unpatch() first)")
    asked = [name for name in _ASSISTED if (kwargs[name] if name in kwargs else getattr(config, name, None)) is not None]
    policy = patch.policy
    if asked and policy.name != "none":
        # the first verification forward is the prompt plus the first drafts: a prompt compressed with unverified
        # drafts in it, which the crop of the rejected ones cannot take out (nor a decode step's eviction or flush)
        change = f", and {policy.decode_change}" if policy.decode_change else ""
        raise ValueError(
            f"{asked[0]}: transformers' assisted / prompt-lookup decoding runs the prompt and its first drafts in one "
            f"forward and crops the rejected drafts from the cache; {policy.describe()} compresses that forward with "
            f"the unverified drafts in it{change}, which a crop cannot undo (the output would differ from plain "
            f"decoding); allowed: kvpress.speculative_generate (self-speculation over the compressed cache, exact), "
            f"or policy='none'")
