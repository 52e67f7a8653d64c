"""One prefill shared by every (policy, ratio) config, then a few batched greedy decodes.

Why sharing is exact: a kvpress prefill attends over the full prompt in every layer and only then lets the policy
evict from that layer, so the forward (and the first generated token) is the same for every policy and ratio.
`FanOut` is a kvpress Policy whose prefill hook hands each config its own copy of the layer and runs that
config's own selection on it; a scoring policy's scores do not depend on the budget, so they are computed once
per policy and cut at each ratio.

Decoding stacks configs as rows of one cache (KVPressCache.stack: `row_budget` per row; rectangular rows
left-padded with invalid slots, which the core masks out and evicts first; flat per-head runs concatenated):
prefill-only policies (none, SnapKV, KVzip, ...) in one batch per storage layout (rectangular rows read through
the model's attention, flat ones through the gather kernel), decode-time evictors (H2O, TOVA, StreamingLLM) in
another under `Rows`, which runs each row's own policy. Low-bit storage and custom hooks decode alone.

Only public pieces of kvpress are used: Policy hooks and declarations (needs, decode_change, roles),
ScorerPolicy.prefill_scores / cut_copy (one scoring, one cut per ratio) and score / protected for Rows,
evict_to_budget, KVPressCache.fork_with / stack, KVPressLayer.codes / is_flat. tests/test_evals_engine.py checks
every config against its own plain patched `generate`: same kept slots, same tokens."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import operator
import time
from dataclasses import dataclass, field
from typing import ClassVar

import torch

import kvpress
from kvpress import KVPressCache
from kvpress.integrations.hf import with_cache
from kvpress.policies import DecodeEviction, Policy, ScorerPolicy, Summarizer, resolve_policy
from kvpress.policies.base import Needs, evict_to_budget
from kvpress.policies.registry import get_policy_class


def parse_policy(spec: str) -> tuple[str, dict]:
    """A policy spec: a name (or composition "snapkv+kivi"), optionally with hyper-parameters after colons,
    e.g. "snapkv:budget_allocation=adaptive:window_size=16" -> ("snapkv", {...})."""
    name, *params = spec.split(":")
    out = {}
    for item in params:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"policy {spec!r}: {item!r} is not key=value; allowed form: name:key=value:key=value")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()  # a bare word, e.g. adaptive
    return name.strip(), out


def takes_ratio(policy: str) -> bool:
    """Whether a policy spec (or composition "snapkv+kivi") evicts to a budget; "none" and codecs do not."""
    name, _ = parse_policy(policy)
    return any(get_policy_class(part.strip()).needs_budget for part in name.split("+"))


@dataclass(frozen=True)
class Config:
    policy: str  # a policy spec (see parse_policy)
    ratio: float = 0.0  # fraction of the prompt removed; 0 for policies that take no budget

    def make(self) -> Policy:
        name, params = parse_policy(self.policy)
        if takes_ratio(self.policy):
            return resolve_policy(name, compression_ratio=self.ratio, **params)
        return resolve_policy(name, **params)


def configs_for(policies: list[str], ratios: list[float]) -> list[Config]:
    """Every evicting policy at every ratio; the others ("none", codecs) once, at ratio 0."""
    return [Config(p, r) for p in policies for r in (ratios if takes_ratio(p) else [0.0])]


@dataclass
class FanOut(Policy):
    """At prefill, gives every config its own compressed copy of each layer; never evicts from the layer itself."""

    name: ClassVar[str] = "fan_out"
    policies: dict = field(default_factory=dict)  # Config -> Policy

    def __post_init__(self):
        self.layers = {c: {} for c in self.policies}  # Config -> {layer_idx: KVPressLayer}
        self.score_s = {c: 0.0 for c in self.policies}  # time each config's selection took, all layers
        self.total_s = 0.0  # time spent in this hook, all configs
        groups: dict = {}
        for c, p in self.policies.items():
            groups.setdefault(_params_key(p), []).append(c)
        self.groups = list(groups.values())

    def needs(self) -> Needs:
        return functools.reduce(operator.or_, (p.needs() for p in self.policies.values()), Needs())

    def for_model(self, model) -> "FanOut":
        # configures its policies in place: this object also collects the per-config layers prefill() reads
        self.policies = {c: p.for_model(model) for c, p in self.policies.items()}
        return self

    def on_prefill(self, ctx) -> None:
        for group in self.groups:
            first = self.policies[group[0]]
            start = time.perf_counter()
            # A scorer that cuts each layer at prefill scores once for every ratio (prefill_scores), then each
            # ratio cuts its own copy (cut_copy); one that decides after the whole prompt runs its own hooks.
            shared = isinstance(first, ScorerPolicy) and not first.needs().model_pass
            if shared:
                scored = dataclasses.replace(ctx, layer=ctx.layer.fork())
                first.observe(scored)  # may add state (H2O's attention sums)
                scores = first.prefill_scores(scored)
            shared_s = time.perf_counter() - start
            for c in group:
                start = time.perf_counter()
                policy = self.policies[c]
                if shared:
                    layer = policy.cut_copy(scored, scores)
                else:
                    layer = ctx.layer.fork()
                    own = dataclasses.replace(ctx, layer=layer)
                    policy.observe(own)
                    policy.on_prefill(own)
                self.layers[c][ctx.layer_idx] = layer
                own_s = time.perf_counter() - start
                self.score_s[c] += shared_s + own_s
                self.total_s += own_s
            self.total_s += shared_s

    def after_prefill(self, run) -> None:
        """Model-level hooks (KVzip's replay and global selection) on each config's own layers. Configs that differ
        only in budget share one replay through run.memo; its time is charged to every config that uses it."""
        memo, shared_s = {}, {}
        for c, policy in self.policies.items():
            if not policy.needs().model_pass:
                continue
            own = run.cache.fork_with(self.layers[c])
            group = _params_key(policy)
            start = time.perf_counter()
            policy.after_prefill(dataclasses.replace(run, cache=own, memo=memo))
            elapsed = time.perf_counter() - start
            self.total_s += elapsed
            self.score_s[c] += elapsed + shared_s.get(group, 0.0)
            shared_s.setdefault(group, elapsed)
            self.layers[c] = {i: own.layers[i] for i in self.layers[c]}


@dataclass
class Prefill:
    logits: torch.Tensor  # [1, vocab] at the last prompt position (the same for every config)
    caches: dict  # Config -> KVPressCache holding that config's compressed prompt
    seconds: dict  # Config -> forward time + that config's own selection time
    n_tokens: int


@torch.no_grad()
def prefill(model, ids: torch.Tensor, configs: list[Config]) -> Prefill:
    fan = FanOut({c: c.make() for c in configs})
    cache = KVPressCache(model.config)
    with kvpress.patch_model(model, fan):
        start = time.perf_counter()
        out = model(**with_cache(model, cache, input_ids=ids, use_cache=True, logits_to_keep=1))
        total = time.perf_counter() - start
    forward_s = total - fan.total_s
    caches = {c: cache.fork_with(fan.layers[c]) for c in configs}
    return Prefill(out.logits[:, -1].float(), caches, {c: forward_s + fan.score_s[c] for c in configs}, ids.shape[1])


@torch.no_grad()
def greedy(model, cache: KVPressCache, logits: torch.Tensor, max_new: int, stop: set[int],
           policy: Policy) -> list[list[int]]:
    """Greedy tokens for each row, from the logits of the step before, decoding under `policy` (one row per
    config). A row stops at a stop token and leaves the batch: its cache rows (and, under Rows, its policy) are
    dropped, so rows that finish early cost nothing more."""
    tokens: list[list[int]] = [[] for _ in range(logits.shape[0])]
    active = list(range(logits.shape[0]))  # batch row -> config row
    with contextlib.ExitStack() as patched:
        patched.enter_context(kvpress.patch_model(model, policy))
        for step in range(max_new):
            nxt = logits.argmax(-1)
            for i, row in enumerate(active):
                tokens[row].append(int(nxt[i]))
            going = [i for i, row in enumerate(active) if tokens[row][-1] not in stop]
            if not going or step == max_new - 1:
                break
            if len(going) < len(active):
                index = torch.tensor(going, device=nxt.device)
                cache.batch_select_indices(index)
                nxt, active = nxt[index], [active[i] for i in going]
                if isinstance(policy, Rows):
                    patched.close()
                    patched.enter_context(kvpress.patch_model(model, Rows([policy.policies[r] for r in active])))
            logits = model(**with_cache(model, cache, input_ids=nxt[:, None], use_cache=True)).logits[:, -1].float()
    return tokens


def _params_key(policy: Policy):
    """Hyper-parameters other than the budget: configs that differ only in ratio share scores and hooks."""
    return type(policy), repr(sorted((f.name, getattr(policy, f.name)) for f in dataclasses.fields(policy)
                                     if f.name not in ("compression_ratio", "budget")))


def _passive(policy: Policy) -> bool:
    """Acts at prefill only (none, SnapKV, Knorm, Random): a decode step of none of its parts changes the cache
    besides appending (no eviction while decoding, no read subset, no low-bit flush, no decode budget), and none
    rewrites keys."""
    return all(p.decode_change is None and not p.rewrites_keys for p in policy.parts())


def _rowwise(policy: Policy) -> bool:
    """Evicts while decoding through ScorerPolicy's own path (H2O, TOVA, StreamingLLM): Rows can run it (not LESS,
    whose reads add the summary of what it evicted)."""
    return (isinstance(policy, ScorerPolicy) and isinstance(policy, DecodeEviction) and policy.decode_budget is None
            and policy.slack == 0 and not policy.rewrites_keys and not isinstance(policy, Summarizer))


@dataclass
class Rows(Policy):
    """Decode-time hooks for a batch whose rows follow different evicting policies: each policy scores the
    batch, and each row keeps what its own policy picks under its own budget (ScorerPolicy.compress, with
    scores and protected slots taken row by row). One parameter set per policy class, as per-slot state
    (H2O's) is named by class."""

    name: ClassVar[str] = "rows"
    policies: list = field(default_factory=list)  # one per batch row

    def __post_init__(self):
        self.groups: dict = {}
        for row, policy in enumerate(self.policies):
            self.groups.setdefault(_params_key(policy), (policy, []))[1].append(row)
        assert len({key[0] for key in self.groups}) == len(self.groups), "one parameter set per policy class"

    def needs(self) -> Needs:
        return functools.reduce(operator.or_, (p.needs() for p, _ in self.groups.values()), Needs())

    def for_model(self, model) -> "Rows":
        return Rows([p.for_model(model) for p in self.policies])

    def observe(self, ctx) -> None:
        for policy, _ in self.groups.values():
            policy.observe(ctx)

    def on_extend(self, ctx) -> None:
        for policy, _ in self.groups.values():
            policy.on_extend(ctx)

    def on_decode(self, ctx) -> None:
        layer = ctx.layer
        scores = torch.zeros(layer.key_valid().shape, dtype=torch.float32, device=ctx.query.device)
        for policy, rows in self.groups.values():
            scores[rows] = policy.score(ctx)[rows].float()

        def kept_first(n_keep):  # each row's own policy's protected slots
            protected = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
            for policy, rows in self.groups.values():
                kept = policy.protected(ctx, n_keep)
                if kept is not None:
                    protected[rows] = kept[rows]
            return protected

        evict_to_budget(layer, scores, layer.row_budget, kept_first)


def decode_batches(pre: Prefill, configs: list[Config], separate: bool = False) -> list[tuple[list[Config], Policy]]:
    """How to decode: (configs stacked as rows, the policy to patch with). Prefill-only policies share one batch
    under "none" (their hooks are no-ops after prefill); decode-time evictors share one batch under Rows;
    anything else (low-bit storage, custom hooks) decodes alone under its own policy. `separate`: every config in
    a batch of its own (its decode time is then its own, comparable across configs)."""
    made = {c: c.make() for c in configs}
    if separate:
        return [([c], made[c]) for c in configs]
    passive, passive_flat, shared, extra, alone = [], [], [], {}, []
    shared_keys = {}  # policy class -> the parameter set that rides in the shared Rows batch
    for c in configs:
        key = _params_key(made[c])
        layers = [layer for _, layer in pre.caches[c].kvpress_layers()]
        if any(layer.codes for layer in layers):
            alone.append(c)  # low-bit codes: no row stacking
        elif _passive(made[c]) and any(layer.is_flat for layer in layers):
            passive_flat.append(c)
        elif any(layer.is_flat for layer in layers):
            alone.append(c)
        elif _passive(made[c]):
            passive.append(c)
        elif _rowwise(made[c]) and shared_keys.setdefault(key[0], key) == key:
            shared.append(c)
        elif _rowwise(made[c]):
            extra.setdefault(key, []).append(c)
        else:
            alone.append(c)
    out = [(batch, resolve_policy("none")) for batch in (passive, passive_flat) if batch]
    out += [(b, Rows([made[c] for c in b])) for b in [shared, *extra.values()] if b]
    return out + [([c], made[c]) for c in alone]


@torch.no_grad()
def answer(model, pre: Prefill, batch: list[Config], policy: Policy, question_ids: torch.Tensor | None,
           max_new: int, stop: set[int]) -> tuple[list[list[int]], float]:
    """Greedy answers for a batch of configs (one row each), patched with `policy` so decode-time eviction runs.
    query-aware: question_ids is None (the prompt held the question; decoding starts from the prefill's logits).
    query-agnostic: the question first extends each row's compressed context."""
    cache = KVPressCache.stack([pre.caches[c] for c in batch])
    start = time.perf_counter()
    if question_ids is None:
        logits = pre.logits.expand(len(batch), -1)
    else:
        with kvpress.patch_model(model, policy):
            ids = question_ids.expand(len(batch), -1)
            logits = model(**with_cache(model, cache, input_ids=ids, use_cache=True, logits_to_keep=1)).logits[:, -1]
    tokens = greedy(model, cache, logits.float(), max_new, stop, policy)
    return tokens, time.perf_counter() - start
