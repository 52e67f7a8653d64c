"""kvpress settings, checked once: the engine's (`additional_config`) and each request's (`extra_args`).

    LLM(model, additional_config={"kvpress": {"policy": "snapkv", "compression_ratio": 0.75}})
    SamplingParams(extra_args={"kvpress": {"context_tokens": 3072}})            # the engine's policy, a context
    SamplingParams(extra_args={"kvpress": {"policy": "knorm", "compression_ratio": 0.5}})   # this request's own
    OpenAI server: "vllm_xargs": {"kvpress": "{\"context_tokens\": 3072}"}     (vllm_xargs holds flat values: JSON)

A setting names a policy and its hyper-parameters exactly as `patch_model` takes them. The engine serves what
decides from one prompt, layer by layer, where the prompt (or its declared context) ends
(integrations/prompts.py: check_servable); kvzap, whose default budget is one top-k over every layer, runs with its
served_defaults (budget_allocation="uniform") unless told otherwise (and is refused with another allocation).

A request's settings either name a policy (with its parameters), replacing the engine's for that request, or give
only `context_tokens`, the count of the prompt's leading tokens that are a context (a document, a system prompt):
the context is compressed where it ends, without the question, and the compressed context is shared by later
requests with the same context and settings (plans.py). Parameters without a policy name are refused: they
would mean different things under different engine policies.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from ...policies import Policy, get_policy_class, resolve_policy
from ..prompts import check_servable

KEY = "kvpress"  # the key of `additional_config` and of a request's `extra_args` kvpress reads
CONTEXT = "context_tokens"
_EXAMPLE = '{"policy": "snapkv", "compression_ratio": 0.75}'


def _served_defaults(spec: str) -> dict:
    """What an engine runs the policy `spec` names with unless the settings say otherwise (Policy.served_defaults);
    nothing for a name the registry does not know (resolve_policy then says so)."""
    try:
        return dict(get_policy_class(spec).served_defaults)
    except ValueError:
        return {}


def _as_object(raw, where: str) -> dict:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}={raw!r} is not JSON ({e}); allowed: an object such as {_EXAMPLE}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}={raw!r}; allowed: an object such as {_EXAMPLE}")
    return raw


def _policy(raw: dict, where: str) -> Policy:
    """The policy a settings object names, checked as servable; ValueError naming what is wrong."""
    if not isinstance(raw.get("policy"), str):
        raise ValueError(f"{where}={raw!r}; allowed: an object with a 'policy' name and its parameters, such as "
                         f"{_EXAMPLE}")
    name = raw["policy"]
    params = {k: v for k, v in raw.items() if k not in ("policy", CONTEXT)}
    policy = resolve_policy(name, **{**_served_defaults(name), **params})
    check_servable(policy)
    return policy


@dataclass(frozen=True)
class EngineSettings:
    policy: Policy
    text: str  # the settings as given, as JSON (what the page manager receives)

    @classmethod
    def parse(cls, raw) -> "EngineSettings":
        """Settings from the value of additional_config['kvpress']; ValueError naming what is wrong."""
        where = f"additional_config['{KEY}']"
        raw = _as_object(raw, where)
        if CONTEXT in raw:
            raise ValueError(f"{where}: {CONTEXT} is a request's setting (each prompt has its own context); "
                             f"allowed here: a policy and its parameters; per request: SamplingParams(extra_args="
                             f'{{"{KEY}": {{"{CONTEXT}": N}}}})')
        return cls(_policy(raw, where), json.dumps(raw, sort_keys=True))

    @classmethod
    def of(cls, vllm_config) -> "EngineSettings | None":
        """The settings of an engine's config; None when it names no kvpress policy (the plugin then does nothing)."""
        extra = vllm_config.additional_config
        if not isinstance(extra, dict) or KEY not in extra:
            return None
        return cls.parse(extra[KEY])


@functools.lru_cache(maxsize=256)
def request_policy(text: str) -> Policy:
    """The servable policy a request's settings name (RequestSettings.policy_text), resolved once per text: every
    process reads a request's settings again at each step it plans."""
    return _policy(json.loads(text), f"extra_args['{KEY}']")


@dataclass(frozen=True)
class RequestSettings:
    """What one request asks of kvpress (SamplingParams.extra_args['kvpress'])."""

    policy_text: str | None  # {"policy": ..., parameters} as sorted JSON; None: the engine's policy
    context_tokens: int | None  # the prompt's leading tokens that are a context; None: the whole prompt, as a prompt

    @classmethod
    def of(cls, extra_args) -> "RequestSettings | None":
        """A request's settings, checked (ValueError naming what is wrong); None when it gives none."""
        extra_args = extra_args or {}
        stray = sorted(k for k in extra_args if isinstance(k, str) and k.startswith(KEY) and k != KEY)
        if stray:
            raise ValueError(f"extra_args {stray}: kvpress reads one key, '{KEY}'; allowed: extra_args={{'{KEY}': "
                             f"{{'{CONTEXT}': N, 'policy': ..., parameters}}}} (through the OpenAI server: "
                             f"vllm_xargs={{'{KEY}': '<that object as JSON>'}})")
        if KEY not in extra_args:
            return None
        where = f"extra_args['{KEY}']"
        raw = _as_object(extra_args[KEY], where)
        context = raw.get(CONTEXT)
        if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 1):
            raise ValueError(f"{where}: {CONTEXT}={context!r}; allowed: a positive int, the count of the prompt's "
                             f"leading tokens that are the context")
        params = {k: v for k, v in raw.items() if k != CONTEXT}
        if params and "policy" not in params:
            raise ValueError(f"{where}: parameters {sorted(params)} without a 'policy'; allowed: {CONTEXT} alone (the "
                             f"engine's policy), or a policy with its parameters, such as {_EXAMPLE}")
        policy_text = None
        if params:
            policy_text = json.dumps(params, sort_keys=True)
            request_policy(policy_text)  # checked here, in the process that answers the client
        return cls(policy_text, context)

    def check_prompt(self, prompt_length: int) -> None:
        """The context must leave the question at least one token of the prompt."""
        if self.context_tokens is not None and self.context_tokens >= prompt_length:
            raise ValueError(f"extra_args['{KEY}']: {CONTEXT}={self.context_tokens} for a prompt of {prompt_length} "
                             f"tokens; allowed: 1 to {prompt_length - 1} (the context, then at least one token of "
                             f"question)")


def check_decode_cuts(policy: Policy, page_size: int, context_tokens: int | None, where: str) -> None:
    """Raise ValueError unless an engine of `page_size`-token pages serves `policy`'s decode-time eviction (whole
    pages per cut: Policy.paged_decode_cuts), which it does not yet after a declared context."""
    try:
        cut, _ = policy.paged_decode_cuts(2 * page_size, page_size)  # (what is checked does not depend on length)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if cut and context_tokens is not None:
        raise ValueError(f"{where}: {CONTEXT} with decode-time eviction ({policy.describe()}) is not served yet (the "
                         f"question's tokens would be cut as generated ones); allowed: {CONTEXT} with a policy that "
                         f"cuts the prompt only, or no {CONTEXT}")
