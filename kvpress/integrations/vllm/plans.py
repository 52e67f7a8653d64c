"""What kvpress does with one request, the same answer in the scheduler, its page manager and the workers.

A request's plan follows from the engine's settings, the request's own (settings.py), its prompt length and the page
size, so the processes never exchange a message about it:
- `end`: where its prompt is compressed. The declared context's end, rounded down to whole pages (so the compacted
  context fills whole pages that can be shared; the context's last `< P` tokens are computed with the question), or
  the prompt's end. The scheduler never lets a step run past `end` before it is computed, so every token after it
  is computed over the compacted context.
- `evicted`: the leading tokens every layer drops there (the policy's budget raised to whole pages; 0: nothing
  moves, and the request is stock vLLM's, its pages named as stock pages are).
- `shared`: a declared context. Its compacted pages `[evicted, end)` get names of their own, the prefix cache's
  chained hashes salted with the kvpress settings and every context token (`salt`): a later request with the same
  context and settings is handed those pages instead of computing the context; a stock request, or one with
  other settings or another context, can never match them. A prompt compressed at its own end is never shared.
- `cut`, `held`: decode-time eviction (Policy.paged_decode_cuts; 0: decoding keeps every token). Once a layer would
  hold `held + cut` tokens, the step that computes that token cuts every layer back to `held`, and the request's
  oldest `cut / P` pages go back to the pool: its leading evicted tokens grow by `cut` (`evicted_at`). Steps end
  at each such point (`next_stop`), so a recomputed request (after preemption) cuts where it cut the first time.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

from ...policies import Policy
from ..prompts import evicted_tokens
from .settings import EngineSettings, RequestSettings, request_policy


@dataclass(frozen=True)
class Plan:
    policy: Policy
    policy_text: str  # the policy's settings as JSON (the worker fits one policy per text)
    end: int
    evicted: int
    shared: bool
    cut: int = 0
    held: int = 0

    @property
    def compresses(self) -> bool:
        return self.evicted > 0 or self.cut > 0

    def evicted_at(self, computed: int) -> int:
        """Leading logical tokens whose pages hold nothing needed once `computed` tokens are computed."""
        if computed < self.end:
            return 0
        if not self.cut:
            return self.evicted
        return self.evicted + self.cut * max(0, (computed - self.evicted - self.held) // self.cut)

    def next_stop(self, computed: int) -> int | None:
        """Where a step from `computed` tokens must end (the context's end, or the next decode-time cut); None:
        anywhere."""
        if computed < self.end:
            return self.end
        if not self.cut:
            return None
        return self.evicted_at(computed) + self.held + self.cut

    def salt(self, prompt_token_ids, user_salt: str | None) -> str:
        """The name that sets this request's pages apart from stock pages and from other contexts' (a request's
        own `cache_salt`, when it has one, stays part of it)."""
        digest = hashlib.sha256(self.policy_text.encode())
        digest.update(str(self.end).encode())
        digest.update(b"".join(int(t).to_bytes(4, "little") for t in prompt_token_ids[:self.end]))
        return f"kvpress:{digest.hexdigest()}" + (f":{user_salt}" if user_salt else "")


@functools.lru_cache(maxsize=64)
def _engine(text: str) -> EngineSettings:
    return EngineSettings.parse(text)


@functools.lru_cache(maxsize=4096)
def _plan(engine_text: str, request: RequestSettings | None, prompt_length: int, page_size: int) -> Plan:
    if request is not None and request.policy_text is not None:
        policy, text = request_policy(request.policy_text), request.policy_text
    else:
        engine = _engine(engine_text)
        policy, text = engine.policy, engine.text
    context = None if request is None else request.context_tokens
    end = context_end(context, prompt_length, page_size)
    evicted = evicted_tokens(policy, end, page_size) if end > 0 else 0
    # (a request's settings were checked when it came: settings.check_decode_cuts raised there, not here)
    cut, held = policy.paged_decode_cuts(end, page_size) if end > 0 and context is None else (0, 0)
    return Plan(policy, text, end, evicted, shared=context is not None and evicted > 0, cut=cut, held=held)


def context_end(context_tokens: int | None, prompt_length: int, page_size: int) -> int:
    """Where a prompt is compressed: its declared context's end rounded down to whole pages (the question keeps at
    least one token), or the prompt's end when it declares none."""
    if context_tokens is None:
        return prompt_length
    return min(context_tokens, prompt_length - 1) // page_size * page_size


def plan_of(engine_text: str, extra_args, prompt_length: int, page_size: int) -> Plan:
    """The plan of a request whose settings were checked when it arrived (settings.RequestSettings)."""
    return _plan(engine_text, RequestSettings.of(extra_args), prompt_length, page_size)


def plan_of_request(engine_text: str, request, page_size: int) -> Plan:
    """The plan of a scheduler's Request."""
    params = request.sampling_params
    return plan_of(engine_text, None if params is None else params.extra_args, request.num_prompt_tokens, page_size)
