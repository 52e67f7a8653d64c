"""Chunked prefill: a long prompt fed to an empty KVPressCache a chunk at a time, the policy compressing after each.

The chunk loop wraps a forward (the outer model's, whose output is logits, or the decoder's, whose output is hidden
states) at the instance level; the patch's hooks on the decoder see each chunk as one forward. The loop calls
`after_chunk` (the model-level hook, then the bytes held) after every chunk, once the chunk's observation tokens
are forgotten.
"""

from __future__ import annotations

import functools

import torch

from ..cache import KVPressCache

PER_TOKEN_INPUTS = ("input_ids", "inputs_embeds", "position_ids", "token_type_ids")


def wrap_forward(forward, chunk: int, question_tokens: int | None, output: str, after_chunk, running, serves):
    """An instance-level forward that feeds an empty KVPressCache's prompt `chunk` tokens at a time. `output`: the
    per-token field of the forward's output ("logits" or "last_hidden_state"). `running()`: a context manager that
    counts the call as running on the patched model (what unpatch waits for); `serves()`: whether the patch serves
    this thread (else the forward runs as given)."""
    keeps_logits = output == "logits"

    @functools.wraps(forward)  # keeps the forward's signature: what the cache argument's name is read from (hf.py)
    def chunked_prefill_forward(*args, **kwargs):
        if len(args) == 1 and "input_ids" not in kwargs:
            kwargs["input_ids"], args = args[0], ()
        cache = kwargs.get("cache")
        cache = kwargs.get("past_key_values") if cache is None else cache
        tokens = kwargs.get("input_ids")
        tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
        mask = kwargs.get("attention_mask")
        keep = kwargs.get("logits_to_keep", 0) if keeps_logits else 0
        if (not serves() or args or not isinstance(cache, KVPressCache)
                or cache.forward_state.chunked_prompt is not None  # a chunk
                or cache.get_seq_length() != 0 or tokens is None
                or (tokens.shape[1] <= chunk and cache.question_ids is None)  # one chunk, no question to add
                or (mask is not None and mask.dim() != 2)
                or not isinstance(keep, int)):
            return forward(*args, **kwargs)  # not a prompt we can split: one shot
        if kwargs.get("output_hidden_states"):
            raise ValueError("output_hidden_states=True with prefill_chunk_size: a chunked prompt's forward would "
                             "return them for its last chunk only; allowed: output_hidden_states=False, or "
                             "patch_model(..., prefill_chunk_size=None)")
        with running(cache):
            return chunked_prefill(forward, cache, chunk, question_tokens, kwargs, keep, output, after_chunk)

    return chunked_prefill_forward


def chunked_prefill(forward, cache: KVPressCache, chunk: int, question_tokens: int | None, kwargs: dict,
                    logits_to_keep: int, output: str, after_chunk):
    """Feed the prompt `chunk` tokens at a time (the first chunk takes the remainder); after each chunk every
    kvpress layer has run the policy's prefill hook, and `after_chunk(cache, kwargs)` runs once, so the cache holds
    at most budget + one chunk. Budgets follow the whole prompt's length (see chunk_share in policies/base.py).
    With a known question (question_tokens, or the cache's question_ids), chunks that do not already end with it
    get it appended as observation queries: the policy judges the chunk with them (they are never kept), then every
    layer forgets them. Returns the last forward's output, with `output` over every chunk the caller asked for
    (logits_to_keep: 0 = all)."""
    tokens = kwargs.get("input_ids")
    tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
    batch, length = tokens.shape[:2]
    mask = kwargs.get("attention_mask")
    real = mask.sum(-1) if mask is not None else torch.full((batch,), length)
    ids = kwargs.get("input_ids")
    device = tokens.device
    question, question_from = _question(cache, question_tokens, ids, length, batch)
    if question is not None:  # the question's RoPE positions: where it sits (or will sit) after the prompt
        n = question.shape[1]
        prompt_positions = kwargs.get("position_ids")
        if prompt_positions is None:
            prompt_positions = torch.arange(length, device=device)[None].expand(batch, -1)
        last = prompt_positions[..., -1:]
        question_positions = prompt_positions[..., length - n:] if question_from <= length else \
            last + torch.arange(1, n + 1, device=device)
    state = cache.forward_state
    state.chunked_prompt = (real.to(device), length)
    state.prefilling = False  # this loop runs the after-prompt step, after each chunk
    pieces = []
    try:
        # Chunks end at the prompt's end (the remainder goes first): every row of a left-padded batch ends
        # there too, so each row's chunks hold exactly the tokens they hold when the row runs alone.
        first = length - (length - 1) // chunk * chunk
        for start, end in zip([0, *range(first, length, chunk)], range(first, length + 1, chunk)):
            step = dict(kwargs)
            for name in PER_TOKEN_INPUTS:
                if kwargs.get(name) is not None:
                    step[name] = kwargs[name][..., start:end] if name == "position_ids" else kwargs[name][:, start:end]
            if kwargs.get("cache_position") is not None:
                step["cache_position"] = kwargs["cache_position"][start:end]
            if mask is not None:
                step["attention_mask"] = mask[:, :end]
            # positions this chunk must return: all (0), its tail that falls in the last `logits_to_keep`, or one
            # that is dropped
            wanted = end - start if logits_to_keep == 0 else min(end - start, logits_to_keep - (length - end))
            if "logits_to_keep" in kwargs or output == "logits":
                step["logits_to_keep"] = max(wanted, 1) if logits_to_keep != 0 else 0
            observers = question.shape[1] if question is not None and end <= question_from else 0
            run = _with_observers(step, question, question_positions, start, end) if observers else step
            if observers:
                if "logits_to_keep" in step:
                    run["logits_to_keep"] = 0 if logits_to_keep == 0 else step["logits_to_keep"] + observers
                cache.observe_next(observers)
            cache.set_attention_mask(run.get("attention_mask"))
            out = forward(**run)
            if observers:
                out[output] = out[output][:, :-observers]
                cache.forget_observers()
            after_chunk(cache, step, (), out)
            if wanted > 0:
                pieces.append(out[output])
    finally:
        cache.forward_state.chunked_prompt = None
        cache.forward_state.observers = 0
    out[output] = torch.cat(pieces, 1) if len(pieces) > 1 else pieces[0]
    return out


def _question(cache: KVPressCache, question_tokens: int | None, ids, length: int, batch: int):
    """(question ids [B, n] or None, the prompt position from which chunks already hold it)."""
    if cache.question_ids is None and question_tokens is None:
        return None, length + 1
    if ids is None:  # the question is appended to each chunk as token ids
        raise ValueError("a question for a chunked prefill (question_tokens, or KVPressCache(question_ids=...)) "
                         "needs the prompt as input_ids; allowed: input_ids, not inputs_embeds")
    if cache.question_ids is not None:
        question = cache.question_ids
        if question.shape[0] not in (1, batch):
            raise ValueError(f"question_ids of shape {tuple(question.shape)}; allowed: [1, n] or [batch={batch}, n]")
        return question.to(ids.device).expand(batch, -1), length + 1
    n = min(question_tokens, length)
    return ids[:, length - n:], length - n


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
