"""patch_model: every check of the model, the policy and the settings, before anything is installed (patch.py)."""

from __future__ import annotations

import numbers

from ..policies import Policy, resolve_policy
from ..policies.base import ModelInfo
from ..policies.params import check_context
from .hf import ATTENTION_PREFIX, SUPPORTED_BASES, attention_modules_of, model_info
from .patch import Patch
from .registry import PATCHING, is_patched, patch_of


def patch_model(model, policy: str | Policy | None = "none", prefill_chunk_size: int | None = None,
                question_tokens: int | None = None, **params) -> Patch:
    """Make `model.generate` (and forwards given a KVPressCache) keep a compressed KV cache.

    `policy` is a name from `kvpress.list_policies()` or a Policy instance; `params` are its
    hyper-parameters (e.g. compression_ratio=0.75, or budget=512). `prefill_chunk_size` feeds long prompts
    in chunks and compresses after each one, so the cache never holds more than budget + one chunk (see
    docs/design-notes.md for how this differs from one-shot prefill). `question_tokens=N` declares the prompt's
    last N tokens the question: each earlier chunk is then judged with the question appended as observation
    queries (CItruS-style; their K/V are dropped after the chunk). A question asked later can be given per cache
    instead: `KVPressCache(config, question_ids=ids)`. Returns a Patch: use it as a context manager or call
    `.unpatch()`. All checks run before the model is touched."""
    return install(Patch, model, policy, prefill_chunk_size, question_tokens, **params)


def install(kind: type, model, policy, prefill_chunk_size: int | None = None, question_tokens: int | None = None,
            **params) -> Patch:
    """patch_model, installing a Patch of `kind` (a ScopedPatch: a kvpress call's own, scoped.py)."""
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
    with PATCHING:  # the checks and the installation are one step for other threads patching the same model
        info, base = _check_model(model)
        check_context(policy, getattr(info.config, "max_position_embeddings", None))
        return kind(model, policy.for_model(info), base, info, prefill_chunk_size, question_tokens)


def _check_model(model) -> tuple[ModelInfo, str]:
    """(what policies see of `model`, its attention implementation), or ValueError when kvpress cannot patch it."""
    modules = attention_modules_of(model)
    if is_patched(model, modules):
        raise ValueError("model is already patched by kvpress (itself, the model it belongs to, or its decoder); "
                         "call .unpatch() on the existing patch first")
    backend_ok = getattr(type(model), "is_backend_compatible", lambda: False)()
    if not modules or not backend_ok:
        raise ValueError(
            f"model: {type(model).__name__} does not run its attention through transformers' AttentionInterface "
            f"(the attention function kvpress hooks); allowed: models whose attention modules call "
            f"ALL_ATTENTION_FUNCTIONS, e.g. Llama, Mistral, Qwen2, Qwen3, Gemma3, Phi3, GPT-2, GPT-NeoX, OPT"
        )
    not_causal = [type(m).__name__ for m in modules if getattr(m, "is_causal", False) is not True]
    if not_causal:
        raise ValueError(f"model: {type(model).__name__}'s attention ({not_causal[0]}) is not causal (an encoder, or "
                         f"cross-attention): a KV cache serves decoders; allowed: causal decoder models, e.g. Llama, "
                         f"Mistral, Qwen2, Qwen3, Gemma3, Phi3, GPT-2, GPT-NeoX, OPT")
    base = model.config._attn_implementation
    if base is not None and base.startswith(ATTENTION_PREFIX):
        raise ValueError("model is already patched by kvpress; call .unpatch() on the existing patch first")
    if base not in SUPPORTED_BASES:
        raise ValueError(f"attn_implementation={base!r} cannot be wrapped; allowed values: {list(SUPPORTED_BASES)}")
    text_config = model.config.get_text_config(decoder=True)
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    return model_info(model, modules, head_dim), base


def _check_chunk_size(chunk, policy: Policy) -> None:
    if chunk is None:
        return
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"prefill_chunk_size={chunk!r}; allowed values: None or an int >= 1")
    policy.check_chunking(chunk)


def unpatch(model) -> None:
    patch = patch_of(model)
    if patch is not None:
        patch.unpatch()
