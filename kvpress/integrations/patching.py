"""patch_model: every check of the model, the policy and the settings, before anything is installed (patch.py)."""

from __future__ import annotations

import numbers

from ..policies import Policy, resolve_policy
from ..policies.base import ModelInfo
from .hf import _PATCHES, _PREFIX, SUPPORTED_BASES, attention_modules_of
from .patch import Patch


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
    info = ModelInfo(model, modules, head_dim)
    policy = policy.for_model(info)
    try:
        rotaries = [info.rotary(m) if policy.needs().rotary else None for m in modules]
    except ValueError as e:
        raise ValueError(f"policy {policy.describe()} needs the model's rotary embedding (RoPE): {e}") from None
    return Patch(model, policy, base, modules, rotaries, prefill_chunk_size, question_tokens)


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
