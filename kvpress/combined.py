"""Several contexts compressed apart, answered as one: `kvpress.combine([a, b, ...], method=...)`.

A RAG user compresses (and saves) each document once; `combine` joins any subset of them into one
CompressedContext, without prefilling their concatenation. The contexts must come from the same model, dtype,
tokenizer, question format and policy (as `load` requires). Their longest common prefix of token ids (the chat
template's header: what every document was encoded after) is the shared instruction, kept once, from the first
context.

  method="ape"         APE (Yang et al., ICLR 2025): the documents keep the positions they were encoded at (all
                       after the instruction: parallel encoding), and the questions come after the longest. A query's
                       attention over the documents is one softmax at `temperature`, weighted by `scale` against the
                       instruction and its own tokens (cache/prefix.py: ParallelPrefix). temperature=1, scale=1 is
                       plain attention over the separately encoded documents.
  method="cacheblend"  CacheBlend (Yao et al., EuroSys 2025): the documents one after another, keys re-rotated to
                       their new positions (positions.py); then every document token goes through the first layer
                       again over the joined context, the `recompute` fraction whose second-layer values move most
                       from that is selected (a first layer's keys and values depend on the token alone), and those
                       tokens are computed again through every layer, their keys and values rewritten in place
                       (cache/overwrite.py). recompute=1 is the concatenation's prefill.

Differences from the papers, named: CacheBlend selects its tokens once, at the second layer (the paper narrows the
selection layer by layer, "gradual filtering"); it recomputes full-precision contexts only (codes would have to be
re-encoded), and a recomputed token attends to the tokens the documents' policy kept, not to all of them. APE's
temperature and scale default to 1 (the paper tunes them per task).
"""

from __future__ import annotations

import dataclasses

import torch

from .cache import KVPressCache
from .cache.prefix import ParallelPrefix, start_own
from .cache.view import flat_full_precision
from .cache.segments import empty_tail
from .compressed import CompressedContext
from .context_file import identity
from .integrations.hf import attention_modules_of, with_cache
from .integrations.scoped import patched_for_call
from .positions import Rotary, rotate_keys

METHODS = ("ape", "cacheblend")


def combine(contexts, method: str = "ape", *, temperature: float = 1.0, scale: float = 1.0,
            recompute: float = 0.15) -> CompressedContext:
    """One CompressedContext over `contexts` (see the module docstring); every argument checked first."""
    _check(contexts, method, temperature, scale, recompute)
    first = contexts[0]
    shared = _common_prefix([c.context_ids[0] for c in contexts])
    if method == "ape":
        cache, ids = _parallel(contexts, shared, temperature, scale)
    else:
        cache, ids = _concatenated(contexts, shared)
    combined = CompressedContext(first.model, cache, ids, first.policy, first.question_format, first.tokenizer_id)
    if method == "cacheblend":
        _recompute(combined, shared, recompute)
    return combined


def _check(contexts, method, temperature, scale, recompute) -> None:
    if not isinstance(contexts, (list, tuple)) or len(contexts) < 2 or \
            not all(isinstance(c, CompressedContext) for c in contexts):
        raise ValueError(f"contexts={type(contexts).__name__}; allowed values: a list of two or more "
                         f"CompressedContext (kvpress.compress or kvpress.load)")
    if method not in METHODS:
        raise ValueError(f"method={method!r}; allowed values: {list(METHODS)}")
    for name, value in (("temperature", temperature), ("scale", scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"{name}={value!r}; allowed values: a finite number > 0")
    if isinstance(recompute, bool) or not isinstance(recompute, (int, float)) or not 0 < recompute <= 1:
        raise ValueError(f"recompute={recompute!r}; allowed values: a fraction in (0, 1] of the documents' tokens")
    first = contexts[0]
    for i, c in enumerate(contexts[1:], 1):
        for what, mine, theirs in (("tokenizer", c.tokenizer_id, first.tokenizer_id),
                                   ("question format", c.question_format, first.question_format),
                                   ("policy", c.policy, first.policy)):
            if mine != theirs:
                raise ValueError(f"contexts[{i}]: another {what} than contexts[0]'s; allowed: contexts compressed "
                                 f"with the same model, tokenizer and policy")
        if c.model is not first.model and identity(c.model) != identity(first.model):
            raise ValueError(f"contexts[{i}]: compressed with another model than contexts[0]; allowed: contexts of "
                             f"one model")
    if any(not layer.is_initialized for c in contexts for _, layer in c.cache.kvpress_layers()) or \
            any(len(c.cache.kvpress_layers()) != len(c.cache.layers) for c in contexts):
        raise ValueError("contexts: a model with sliding-window layers (transformers' own, e.g. Gemma-3) keeps a "
                         "window of each context, which cannot be joined; allowed: contexts of a model whose layers "
                         "kvpress compresses")
    policy = first.make_policy()
    if method == "ape" and policy.reads_whole_cache:
        raise ValueError(f"method='ape': {policy.describe()} reads the whole cache at its decode steps, which "
                         f"documents read by APE's tempered attention cannot give it; allowed: a policy whose decode "
                         f"steps only append or store codes (kvzap, snapkv, keydiff, kivi, ...), or "
                         f"method='cacheblend'")
    if method == "cacheblend" and any(layer.codes for c in contexts for _, layer in c.cache.kvpress_layers()):
        raise ValueError("method='cacheblend' re-rotates and recomputes stored keys, which low-bit codes would have "
                         "to be re-encoded for; allowed: contexts compressed without a codec, or method='ape'")


def _common_prefix(rows: list[torch.Tensor]) -> int:
    """Tokens at the start of every context that are the same (the instruction every document follows)."""
    n = min(len(r) for r in rows)
    same = torch.stack([r[:n] == rows[0][:n] for r in rows]).all(0)
    return int(same.long().cumprod(0).sum())


def _part(layer, keep):
    """A copy of a one-row layer holding only the slots where `keep(positions)` ([1, Hkv, T] bool); None if none."""
    part = layer.fork()
    positions, valid = part.key_positions(), part.key_valid()
    kept = valid & keep(positions)
    width = int(kept.sum(-1).max())
    if width == 0:
        return None
    order = (~kept).long().argsort(dim=-1, stable=True)[..., :width]  # the kept slots, in slot order
    part.compact(order, kept.gather(-1, order))
    return part


def _parallel(contexts, shared: int, temperature: float, scale: float):
    """APE: the instruction once (the first context's), each document where it was encoded."""
    cache = contexts[0].cache.fork()
    seen = max(c.context_tokens for c in contexts)
    for i, layer in cache.kvpress_layers():
        instruction = _part(layer, lambda p: p < shared)
        documents = tuple(d for d in (_part(c.cache.layers[i], lambda p: p >= shared) for c in contexts) if d)
        layer.seen = layer.appended = layer.decode_start = seen
        start_own(layer, ParallelPrefix(instruction, documents, shared, float(temperature), float(scale)))
    longest = max(contexts, key=lambda c: c.context_tokens)
    # (the questions follow the longest document: the context holds that many positions)
    return cache, longest.context_ids.clone()


def _concatenated(contexts, shared: int):
    """CacheBlend's join: the instruction once, then every document's tokens one after another, keys re-rotated."""
    model = contexts[0].model
    modules = {m.layer_idx: m for m in attention_modules_of(model)}
    cache = contexts[0].cache.fork()
    lengths = [c.context_tokens - shared for c in contexts]
    for i, layer in cache.kvpress_layers():
        inv_freq = Rotary.of(model, modules[i]).inv_freq()
        # (part, positions it moves by): the instruction, then each document after the ones before it
        parts = [(_part(layer, lambda p: p < shared), 0)]
        parts += [(_part(c.cache.layers[i], lambda p: p >= shared), sum(lengths[:k])) for k, c in enumerate(contexts)]
        runs = None
        for part, delta in parts:
            if part is None:
                continue
            flat = flat_full_precision(part)
            if delta:
                keys = rotate_keys(flat.data.keys, torch.full_like(flat.positions, delta), inv_freq)
                flat = dataclasses.replace(flat, data=dataclasses.replace(flat.data, keys=keys),
                                           positions=flat.positions + delta)
            runs = flat if runs is None else runs.cat_runs(flat)
        layer.segments = [runs, empty_tail(runs, layer.device)]
        layer.seen = layer.appended = layer.decode_start = layer.rollback_floor = shared + sum(lengths)
        layer.explicit_positions, layer.sorted, layer.derived, layer.room = True, True, {}, None
        if bool((runs.lengths == runs.lengths.flatten()[0]).all()):
            layer.to_rectangular()  # every head holds the same tokens: one rectangle (no filler), read by sdpa
    ids = torch.cat([contexts[0].context_ids[:, :shared], *(c.context_ids[:, shared:] for c in contexts)], 1)
    return cache, ids


def _recompute(combined: CompressedContext, shared: int, fraction: float) -> None:
    """CacheBlend's selective recompute, in place: every document token through the first layer, and its second
    layer's keys and values from that (the first place where the other documents reach a token: a first layer's
    keys and values depend on the token alone); then the `fraction` whose second-layer values moved most, through
    every layer."""
    model, cache = combined.model, combined.cache
    positions = sorted({int(p) for _, layer in cache.kvpress_layers()
                        for p in layer.key_positions()[layer.key_valid()].tolist() if p >= shared})
    layers = cache.kvpress_layers()
    if not positions or len(layers) < 2:
        return
    second = layers[1][1]
    before = _values_by_position(second, positions)
    module = {m.layer_idx: m for m in attention_modules_of(model)}[layers[1][0]]

    class _SecondLayerDone(Exception):
        pass

    def stop(module, args, output):
        raise _SecondLayerDone

    handle = module.register_forward_hook(stop)
    try:
        _forward(model, cache, combined.context_ids, positions, combined.make_policy())
    except _SecondLayerDone:
        pass
    finally:
        handle.remove()
    moved = (_values_by_position(second, positions) - before).norm(dim=-1).sum(0)  # [n] over KV heads
    count = max(1, round(fraction * len(positions)))
    chosen = sorted(positions[i] for i in moved.topk(count).indices.tolist())
    _forward(model, cache, combined.context_ids, chosen, combined.make_policy())


def _values_by_position(layer, positions: list[int]) -> torch.Tensor:
    """[Hkv, n, D] fp32 values of `layer`'s row 0 at `positions` (zeros where a head does not hold the token)."""
    where = torch.tensor(positions, device=layer.device)
    stored, valid = layer.key_positions()[0], layer.key_valid()[0]  # [Hkv, T]
    values = layer.values_view()[0].float()  # [Hkv, T, D]
    # each head's slot of each position (-1: not held), by a scatter: O(T), where comparing every position with
    # every slot was O(n T) (0.8 s a call for a 4K-token join)
    slot = torch.full((stored.shape[0], max(int(stored.max()), int(where.max())) + 1), -1, dtype=torch.long,
                      device=stored.device)
    heads, slots = valid.nonzero(as_tuple=True)
    slot[heads, stored[heads, slots]] = slots
    at = slot[:, where]  # [Hkv, n]
    picked = values.gather(1, at.clamp(min=0)[..., None].expand(-1, -1, values.shape[-1]))
    return torch.where((at >= 0)[..., None], picked, torch.zeros((), dtype=values.dtype, device=values.device))


@torch.no_grad()
def _forward(model, cache: KVPressCache, ids: torch.Tensor, positions: list[int], policy) -> None:
    """Compute the tokens at `positions` again over `cache`, rewriting their stored keys and values."""
    at = torch.tensor(positions, dtype=torch.long)
    device = next(model.parameters()).device
    cache.forward_state.recompute = at.to(device)
    try:
        with patched_for_call(model, policy):
            model(**with_cache(model, cache, input_ids=ids[:, at].to(device), position_ids=at[None].to(device),
                               use_cache=True, logits_to_keep=1))
    finally:
        cache.forward_state.recompute = None
