"""The engine's kvpress settings: `additional_config={"kvpress": {"policy": ..., **parameters}}`, checked once.

The settings name a policy and its hyper-parameters exactly as `patch_model` takes them. The engine serves what
decides from one prompt, layer by layer, at the prompt's end (integrations/prompts.py: check_servable); kvzap, whose
default budget is one top-k over every layer, runs with its served_defaults (budget_allocation="uniform") unless told otherwise
(and is refused with another allocation). The settings travel as JSON to the scheduler's page manager
(pages.py), which frees the same pages the workers empty.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ...policies import Policy, get_policy_class, resolve_policy
from ..prompts import check_servable

KEY = "kvpress"  # the key of `additional_config` kvpress reads


def _served_defaults(spec: str) -> dict:
    """What an engine runs the policy `spec` names with unless the settings say otherwise (Policy.served_defaults);
    nothing for a name the registry does not know (resolve_policy then says so)."""
    try:
        return dict(get_policy_class(spec).served_defaults)
    except ValueError:
        return {}


@dataclass(frozen=True)
class EngineSettings:
    policy: Policy
    text: str  # the settings as given, as JSON (what the page manager receives)

    @classmethod
    def parse(cls, raw) -> "EngineSettings":
        """Settings from the value of additional_config['kvpress']; ValueError naming what is wrong."""
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"additional_config['{KEY}']={raw!r} is not JSON ({e}); allowed: an object such as "
                                 f'{{"policy": "snapkv", "compression_ratio": 0.75}}') from None
        if not isinstance(raw, dict) or not isinstance(raw.get("policy"), str):
            raise ValueError(f"additional_config['{KEY}']={raw!r}; allowed: an object with a 'policy' name and its "
                             f'parameters, such as {{"policy": "snapkv", "compression_ratio": 0.75}}')
        params = {k: v for k, v in raw.items() if k != "policy"}
        name = raw["policy"]
        policy = resolve_policy(name, **{**_served_defaults(name), **params})
        check_servable(policy)
        return cls(policy, json.dumps(raw, sort_keys=True))

    @classmethod
    def of(cls, vllm_config) -> "EngineSettings | None":
        """The settings of an engine's config; None when it names no kvpress policy (the plugin then does nothing)."""
        extra = vllm_config.additional_config
        if not isinstance(extra, dict) or KEY not in extra:
            return None
        return cls.parse(extra[KEY])
