"""Self-speculative decoding on one compressed cache.

Each round: the model drafts gamma tokens while every kvpress layer reads only a cheap view of the cache
(sinks + window, retrieved chunks, Quest pages, top-k); the draft's own KV is then rolled back with crop
(the verifier must never attend to draft KV), and one forward over [last token, drafts] with the full view
verifies them. Greedy: accept while the draft equals the target's argmax. Sampling: the standard rule
(accept d with prob min(1, p(d)/q(d)), else sample the residual max(0, p - q)), lossless in distribution;
p and q are the final sampling distributions (temperature, then top-p). No second model, cache or prefill.

Batches: every row commits the same number of tokens per round, the smallest accepted prefix + 1; a row that
accepted more emits its next accepted draft as that last token, which is a valid sample, so each row stays
exactly lossless.
"""

from __future__ import annotations

import contextlib

import torch

from ..cache import KVPressCache
from ..integrations.hf import given_cache, with_cache
from ..integrations.scoped import ScopedPatch, patched_for_call
from ..integrations.registry import patch_of
from ..policies import KIVI, Codec, Quant4View, ReadPolicy
from ..policies.registry import check_params, get_policy_class, list_policies
from .sampling import accept, check_sampling, pick_token, sampling_distribution
from .layer_skip import LayerSkip, Skipper, check_skippable, decoder_layers
from .stats import SpeculativeStats, clock, record

# draft name -> its read view: every registered policy that drafts (Policy.draft_view), and "quant4", the precision
# view of 8-bit KIVI codes (QuantSpec), which is no policy of its own
DRAFTS = {**{name: view for name in list_policies() if (view := get_policy_class(name).draft_view()) is not None},
          "quant4": Quant4View}
def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(draft, gamma, max_new_tokens, do_sample, temperature, top_p, draft_budget, skip):
    if draft is None and skip is None:
        raise ValueError("draft=None reads the whole cache, which drafts only with layers skipped; allowed values: a "
                         f"draft in {sorted(DRAFTS)}, a ReadPolicy instance, or draft=None with skip_layers")
    if isinstance(draft, str) and draft not in DRAFTS:
        raise ValueError(f"draft={draft!r} is unknown; allowed values: {sorted(DRAFTS)} or a ReadPolicy instance")
    if draft is not None and not isinstance(draft, (str, ReadPolicy, Quant4View)):
        raise ValueError(f"draft={draft!r}; allowed values: {sorted(DRAFTS)} or a ReadPolicy instance")
    if gamma != "adaptive" and (not _whole(gamma) or gamma < 1):
        raise ValueError(f"gamma={gamma!r}; allowed values: an int >= 1, or 'adaptive'")
    if draft_budget is not None and (not _whole(draft_budget) or draft_budget < 1):
        raise ValueError(f"draft_budget={draft_budget!r}; allowed values: None (10% of the prompt, 64 to the prompt) or "
                         f"an int >= 1")
    if not _whole(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}; allowed values: an int >= 1")
    check_sampling(do_sample, temperature, top_p)


def _check_ids(input_ids, attention_mask) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 1 or \
            input_ids.is_floating_point() or input_ids.dtype == torch.bool:
        shape = f"{tuple(input_ids.shape)} {input_ids.dtype}" if isinstance(input_ids, torch.Tensor) else \
            type(input_ids).__name__
        raise ValueError(f"input_ids: {shape}; allowed values: integer token ids [batch, n], n >= 1")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or tuple(attention_mask.shape) != tuple(input_ids.shape)):
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask: {shape}; allowed values: None, or a mask of input_ids' shape "
                         f"{tuple(input_ids.shape)}")


def _check_past(cache, input_ids):
    if cache is None:
        return
    if not isinstance(cache, KVPressCache):
        raise ValueError(f"cache={type(cache).__name__}; allowed values: None, or a KVPressCache "
                         f"that holds a prefix of input_ids (drafts are rolled back with kvpress's exact crop)")
    seen, length = cache.get_seq_length(), input_ids.shape[1]
    if seen >= length:
        raise ValueError(f"cache holds {seen} tokens; allowed values: a KVPressCache holding fewer tokens "
                         f"than input_ids ({length}): at least the last prompt token must be run to predict the first "
                         f"new token")
    if cache.read_policy is not None:
        raise ValueError(f"cache has read_policy={cache.read_policy!r} set (a draft view left "
                         f"on it); allowed values: a KVPressCache with read_policy=None")


def _after_first(hit: torch.Tensor) -> torch.Tensor:
    """[B, n] bool: the positions after each row's first hit (where a row that produced EOS is padded)."""
    return (hit.long().cumsum(1) - hit.long()) > 0


ADAPTIVE = (4, 16)  # gamma="adaptive": the first round's drafts, and the most a round drafts


class Length:
    """Drafts per round: a fixed gamma, or "adaptive", following acceptance as transformers' assisted decoding does
    (its "heuristic" schedule): two more after a round whose drafts were all accepted, one fewer otherwise, between
    1 and ADAPTIVE[1]."""

    def __init__(self, gamma):
        self.adaptive = gamma == "adaptive"
        self.now = ADAPTIVE[0] if self.adaptive else gamma
        self.most = ADAPTIVE[1] if self.adaptive else gamma

    def update(self, drafted: int, accepted: int) -> None:
        if self.adaptive and drafted:
            self.now = min(self.most, self.now + 2) if accepted == drafted else max(1, self.now - 1)


def _draft_and_target(draft, draft_params: dict, draft_budget, gamma: int, existing, context: int):
    """(the draft's read view, the policy to patch an unpatched model with), every argument checked first."""
    changes = [p.decode_change for p in existing.policy.parts() if not isinstance(p, Codec)] if existing is not None else []
    if any(changes):  # a codec's flushes are kept out of every round instead (_loop)
        raise ValueError(f"model is patched with {existing.policy.describe()}, which {next(c for c in changes if c)}: "
                         f"a rejected draft could not be rolled back exactly; allowed: an unpatched model, or a policy "
                         f"that acts only at prefill (e.g. none, snapkv, kivi)")
    if draft == "quant4" or isinstance(draft, Quant4View):
        # QuantSpec: the target reads 8-bit codes (the reference it is lossless to), the draft their upper 4 bits
        codec = next((p for p in existing.policy.parts() if isinstance(p, Codec)), None) if existing is not None else None
        if existing is not None and not (codec is not None and codec.upper_bits_draftable):
            raise ValueError("draft='quant4' reads the upper half of 8-bit codes; allowed: an unpatched model, or one "
                             "patched with kivi bits=8")
        if existing is not None and draft_params:
            raise ValueError(f"draft='quant4' on a model patched with {existing.policy.describe()}: the patch's codec "
                             f"is used, so {sorted(draft_params)} would be ignored; allowed: no KIVI parameters here")
        if "bits" in draft_params:
            raise ValueError(f"bits={draft_params['bits']!r}: draft='quant4' stores 8-bit codes; allowed: KIVI's "
                             f"group_size and residual_length")
        check_params(KIVI, draft_params)
        target = KIVI(bits=8, **draft_params) if existing is None else codec
        if target.residual_length < gamma:
            raise ValueError(f"gamma={gamma} exceeds the full-precision residual, which must hold the drafts (with "
                             f"gamma='adaptive': its most, {gamma}); allowed values: gamma <= residual_length")
        return Quant4View(), target
    if draft is None:  # layers skipped, the whole cache read
        if draft_params:
            raise ValueError(f"draft=None reads the whole cache: {sorted(draft_params)} would be ignored")
        return None, "none"
    if not isinstance(draft, str):
        if draft_params:
            raise ValueError(f"draft={draft!r} is a ReadPolicy instance: {sorted(draft_params)} would be ignored; "
                             f"allowed: set them on the instance")
        return draft, "none"
    if "budget" in draft_params:
        raise ValueError(f"budget={draft_params['budget']!r}: the draft's budget is draft_budget; allowed: "
                         f"draft_budget=<int>")
    check_params(DRAFTS[draft], draft_params)
    # 10% of the shortest prompt, at least 64 tokens, at most the prompt itself (a short prompt is read whole)
    budget = draft_budget if draft_budget is not None else min(context, max(64, context // 10))
    if budget > context:
        raise ValueError(f"draft_budget={budget} is larger than the context ({context} tokens); allowed "
                         f"values: 1 <= draft_budget <= {context}")
    return DRAFTS[draft](budget=budget, **draft_params), "none"


@torch.no_grad()
def speculative_generate(model, input_ids, attention_mask=None, *, draft="sink_window", gamma: int | str = 4,
                         max_new_tokens: int = 64, do_sample: bool = False, temperature: float = 1.0,
                         top_p: float = 1.0, draft_budget: int | None = None, eos_token_id=None,
                         pad_token_id=None, generator=None, return_stats: bool = False, cache=None,
                         logits_processor=None, compare: bool = False, skip_layers=None, reselect_every: int = 1,
                         **draft_params):
    """Generate with the model drafting for itself from a cheap view of its own KVPressCache.

    draft: "sink_window" (sinks + window, MagicDec's StreamingLLM-style view), "retrieval" (TriForce chunks),
    "quest" (pages), "topk", or a
    ReadPolicy; draft_budget: tokens the draft reads (default 10% of the shortest prompt, at least 64, at most the
    prompt); draft_params: the draft's own parameters (e.g. page_size for quest).
    draft="quant4": the cache is stored as 8-bit KIVI codes (the target reads them whole, so outputs equal the
    8-bit-KV model's) and the draft reads their upper 4 bits; draft_params then configure KIVI.
    eos_token_id / pad_token_id: None takes the model's generation_config, as `generate` does (eos_token_id=[]
    generates through EOS). cache: None, or a KVPressCache already holding a prefix of input_ids
    (prefilled under the same patch), e.g. `prefilled.fork()` to decode many times from one prefill; only the rest
    of the prompt is run, and the cache is extended in place, as generate extends the cache it is given.
    logits_processor: None, or a callable (ids [B, n], logits [B, V]) -> logits, e.g. transformers'
    LogitsProcessorList (repetition penalty, n-gram bans, bad words, suppressed tokens, min_new_tokens): applied to
    the target's and the draft's logits at every position, given the ids before it, before temperature and top-p, so
    greedy picks and the sampling rule (lossless with respect to the processed distribution) follow it. It must be a
    function of its arguments: it also sees the positions of drafts that are rejected.
    gamma: drafts per round, or "adaptive": they follow acceptance (Length: 4 at first, +2 after a round all
    accepted, -1 otherwise, 1 to 16), for every draft kind.
    skip_layers: the draft also skips decoder layers (their weights are not read, the drafts get no KV there):
    None; an int M, the M layers CLaSp chooses again every `reselect_every` rounds from the verification's own hidden
    states (layer_skip.py); or a list of layer indices, always. With it, draft=None reads the whole cache.
    compare=True: then decode as many tokens plainly (one forward per token, over a copy of the same prefilled
    cache) and put that time in the stats (plain_decode_s, speedup, plain_matches): whether speculation paid.
    Returns the ids [B, prompt + new] like `generate`: it stops once every row has produced EOS, rows that finished
    earlier padded. return_stats=True returns (ids, SpeculativeStats): acceptance and the time split (prefill_s,
    draft_s, verify_s, total_s, decode_tokens_per_s); kvpress.speculative.last_stats(model) returns the same
    after any call, including through model.generate(custom_generate=...).

        out, stats = kvpress.speculative_generate(model, ids, draft="quest", gamma=4, return_stats=True)
        print(stats.acceptance_rate, stats.tokens_per_round, stats.decode_tokens_per_s)"""
    layers = decoder_layers(model)
    skip = LayerSkip.parse(skip_layers, len(layers), reselect_every)
    _check(draft, gamma, max_new_tokens, do_sample, temperature, top_p, draft_budget, skip)
    _check_ids(input_ids, attention_mask)
    if skip is not None:
        check_skippable(model, skip)
    if not isinstance(compare, bool):
        raise ValueError(f"compare={compare!r}; allowed values: True or False")
    if logits_processor is not None and not callable(logits_processor):
        raise ValueError(f"logits_processor={logits_processor!r:.60}; allowed values: None, or a callable (ids, logits) "
                         f"-> logits such as transformers' LogitsProcessorList")
    _check_past(cache, input_ids)
    config = model.generation_config
    eos_token_id = config.eos_token_id if eos_token_id is None else eos_token_id
    pad_token_id = config.pad_token_id if pad_token_id is None else pad_token_id
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    context = int(mask.sum(-1).min())
    existing = patch_of(model)
    caller_patch = None if existing is None or isinstance(existing, ScopedPatch) else existing
    length = Length(gamma)
    view, target_policy = _draft_and_target(draft, draft_params, draft_budget, length.most, caller_patch, context)
    # the caller's own patch, or one of this call's (shared with the calls on other threads that need the same)
    with contextlib.nullcontext(caller_patch) if caller_patch else patched_for_call(model, target_policy) as patch:
        view = view.for_model(patch.model_info()) if view is not None else None  # e.g. lserve's streaming heads
        return _loop(model, patch.policy, input_ids, mask, view, length, max_new_tokens, do_sample, temperature,
                     top_p, eos_token_id, pad_token_id, generator, return_stats, cache, logits_processor, compare,
                     Skipper(model, layers, skip) if skip is not None else None)


def _loop(model, policy, input_ids, prompt_mask, view, length, max_new_tokens, do_sample, temperature, top_p,
          eos_token_id, pad_token_id, generator, return_stats, given, processor, compare, skipper):
    device = input_ids.device
    start = clock(device)
    batch, prompt_len = input_ids.shape
    cache = KVPressCache(model.config) if given is None else given
    # hybrid models' sliding-window layers (transformers' own) then keep past states until each crop, so a
    # rejected draft can be rolled back there too; kvpress layers always can
    cache.activate_past_recording()
    eos = torch.tensor([] if eos_token_id is None else
                       (eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]),
                       dtype=torch.long, device=input_ids.device)  # isin needs both on one device
    pad = pad_token_id if pad_token_id is not None else (int(eos[0]) if len(eos) else 0)

    def forward(tokens, on=None, hidden=False):
        """The model's output for `tokens` over the cache `on` (this call's by default); hidden: with every layer's
        input hidden states and the last layer's output (for CLaSp's choice)."""
        on = cache if on is None else on
        q = tokens.shape[1]
        grown = on.get_seq_length() + q - prompt_len
        mask = torch.cat([prompt_mask, prompt_mask.new_ones(batch, grown)], 1)
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)[:, -q:]
        return model(tokens, **with_cache(model, on, attention_mask=mask, position_ids=positions,
                                          output_hidden_states=hidden))

    def processed(logits, before):
        """logits [B, V] of the token after the ids `before` [B, n], as the caller's processor leaves them."""
        return logits if processor is None else processor(before, logits.float().clone())

    def pick(logits, before):
        return pick_token(processed(logits, before), do_sample, temperature, top_p, generator)

    stats = SpeculativeStats()
    if skipper is not None and not skipper.plan.chooses:
        stats.skipped_layers.append(skipper.skipped)
    # (CLaSp's first choice comes from the first verification: the prompt's hidden states would be all of its
    # tokens', and a chunked prefill returns none)
    token, _ = pick(forward(input_ids[:, cache.get_seq_length():]).logits[:, -1], input_ids)
    stats.prefill_s = clock(device) - start
    baseline = cache.fork() if compare else None  # the prefilled cache, for the plain decoding compared with
    out = [token[:, None]]
    finished = torch.isin(token, eos)
    produced = 1
    while produced < max_new_tokens and not bool(finished.all()):
        g = min(length.now, max_new_tokens - produced - 1)
        # A codec flushes old tokens to low-bit codes after the step that fills its window: a round (g drafts, then
        # g + 1 verified) stays short of that step, so nothing is flushed inside it (a rollback could not undo it)
        # and the flush comes at the very step plain decoding takes it. A round of 0 drafts is a plain step.
        room = min((n for _, layer in cache.kvpress_layers()
                    if (n := policy.appends_before_change(layer)) is not None), default=None)
        if room is not None:
            g = max(0, min(g, room - 1))
        last = out[-1][:, -1:]
        so_far = torch.cat([input_ids, *out], 1) if processor is not None else None  # what the processor reads
        drafts, q_probs = [], []
        t_draft = clock(device)
        seen = cache.get_seq_length()
        cache.read_policy = view
        try:
            with skipper.skipping() if skipper is not None else contextlib.nullcontext():
                current = last
                for _ in range(g):
                    before = None if so_far is None else torch.cat([so_far, *(t[:, None] for t in drafts)], 1)
                    d, q = pick(forward(current).logits[:, -1], before)
                    drafts.append(d)
                    q_probs.append(q)
                    current = d[:, None]
        finally:
            cache.read_policy = None
        if g:  # the draft's KV of `last`, d_1..d_{g-1} (in the layers it ran): the verifier recomputes it exactly
            # with layers skipped, each layer back to the length before the drafts (they all had it; check_skippable
            # refuses models with sliding layers, whose length is not the tokens seen); else g from every layer
            cache.crop(seen if skipper is not None else -g)
        t_verify = clock(device)
        stats.draft_s += t_verify - t_draft
        d = torch.stack(drafts, 1) if g else last.new_zeros(batch, 0)
        choosing = skipper is not None and skipper.due(stats.rounds + 1)
        verified = forward(torch.cat([last, d], 1), hidden=choosing)  # full view, every layer
        logits = verified.logits  # [B, g+1, V]
        if processor is not None:  # position j follows the ids so far and the first j drafts
            logits = torch.stack([processed(logits[:, j], torch.cat([so_far, d[:, :j]], 1)) for j in range(g + 1)], 1)
        if do_sample:
            n, nxt = accept(sampling_distribution(logits, temperature, top_p), torch.stack(q_probs, 1) if g else
                            logits.new_zeros(batch, 0, logits.shape[-1]), d, generator)
        else:
            n, nxt = accept(logits, None, d)
        k = int(n.min())
        length.update(g, k)
        tail = nxt if k == g else torch.where(n == k, nxt, d[:, k])
        emitted = torch.cat([d[:, :k], tail[:, None]], 1)  # k + 1 tokens for every row
        cache.crop(-(g - k))  # keep `last` and d_1..d_k, whose KV the verifier just wrote
        if choosing:  # CLaSp chooses again, from the hidden states of the last token kept
            skipper.choose([h[:, k] for h in verified.hidden_states], stats)
        stats.verify_s += clock(device) - t_verify
        # rows that already produced EOS emit padding, as generate does
        done_before = finished[:, None].expand_as(emitted).clone()
        hit = torch.isin(emitted, eos)
        emitted = emitted.masked_fill(done_before | _after_first(hit), pad)
        finished = finished | hit.any(1)
        out.append(emitted)
        produced += k + 1
        stats.rounds += 1
        stats.drafted += g * batch
        stats.accepted += int(n.sum())
        stats.per_round_accepted.append(n.tolist())
        stats.per_round_drafts.append(g)
    new = torch.cat(out, 1)[:, :max_new_tokens]
    hit = torch.isin(new, eos)
    if bool(hit.any(1).all()):  # generate stops at the step where the last row produces EOS
        new = new[:, :int(hit.long().argmax(1).max()) + 1]
    result = torch.cat([input_ids, new], 1)
    stats.emitted = new.shape[1]
    stats.total_s = clock(device) - start
    if baseline is not None:  # plain decoding of the same number of tokens, after the prefill's first one
        plain, tick = new[:, :1], clock(device)
        for _ in range(1, new.shape[1]):
            before = torch.cat([input_ids, plain], 1) if processor is not None else None
            plain = torch.cat([plain, pick(forward(plain[:, -1:], baseline).logits[:, -1], before)[0][:, None]], 1)
        stats.plain_decode_s = clock(device) - tick
        # padded as the speculative rows are, after each row's EOS among the tokens returned (`new` may be cut)
        after_eos = _after_first(torch.isin(new, eos))
        stats.plain_matches = None if do_sample else bool(torch.equal(plain.masked_fill(after_eos, pad), new))
    record(model, stats)
    return (result, stats) if return_stats else result


def custom_generate(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                    draft="sink_window", gamma=4, draft_budget=None, compare=False, skip_layers=None,
                    reselect_every=1, **model_kwargs):
    """`model.generate(..., custom_generate=kvpress.speculative.custom_generate, draft=..., gamma=...)`.
    Uses the generation config's max length, EOS and pad tokens, and the logits processors generate prepared from it
    (repetition penalty, n-gram bans, bad words, min_new_tokens, and when sampling temperature, top-k and top-p),
    applied at every position of the draft and of the verification; stopping criteria other than the max length and
    EOS are refused (a round could not stop inside itself). A KVPressCache given
    to generate (cache= or past_key_values=, by the caller or by a kvpress patch's generate) is speculative_generate's
    cache=.
    Returns ids only: kvpress.speculative.last_stats(model) has the call's SpeculativeStats."""
    config = generation_config
    stops = sorted({type(c).__name__ for c in (stopping_criteria or [])} - {"MaxLengthCriteria", "EosTokenCriteria"})
    if stops:
        raise ValueError(f"stopping criteria {stops} (stop_strings, max_time, ...): self-speculation stops at the max "
                         f"length and at EOS only; allowed: generate without them, or plain generate")
    past = given_cache(model_kwargs)
    if past is not None and not isinstance(past, KVPressCache):
        if past.get_seq_length():
            raise ValueError(f"cache={type(past).__name__} holding {past.get_seq_length()} tokens; "
                             f"allowed values: None, or a KVPressCache (self-speculation rolls drafts back with "
                             f"kvpress's exact crop)")
        past = None  # the empty cache transformers' generate makes for an unpatched model: speculation makes its own
    return speculative_generate(
        model, input_ids, model_kwargs.get("attention_mask"), draft=draft, gamma=gamma,
        max_new_tokens=config.max_length - input_ids.shape[1], do_sample=bool(config.do_sample),
        draft_budget=draft_budget, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, cache=past,
        # (the processors generate prepared hold its temperature, top-k and top-p warpers when it samples)
        logits_processor=logits_processor if logits_processor else None, compare=compare,
        skip_layers=skip_layers, reselect_every=reselect_every,
    )
