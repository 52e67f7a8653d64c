"""Policies by name."""

from __future__ import annotations

import dataclasses

from .base import Policy

_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    _REGISTRY[cls.name] = cls
    return cls


def list_policies() -> list[str]:
    return sorted(_REGISTRY)


def get_policy_class(name: str) -> type[Policy]:
    if name not in _REGISTRY:
        raise ValueError(f"policy={name!r} is unknown; allowed values: {list_policies()}")
    return _REGISTRY[name]


def resolve_policy(policy: str | Policy | None, **params) -> Policy:
    """A Policy instance from a name (+ hyper-parameters) or an instance (+ overrides)."""
    if policy is None:
        policy = "none"
    if isinstance(policy, str):
        cls = get_policy_class(policy)
        _check_params(cls, params)
        return cls(**params)
    if isinstance(policy, Policy):
        if params:
            _check_params(type(policy), params)
            return dataclasses.replace(policy, **params)
        policy.validate()
        return policy
    raise ValueError(f"policy={policy!r}; allowed values: a name in {list_policies()} or a kvpress Policy instance")


def _check_params(cls: type[Policy], params: dict) -> None:
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"{cls.name}: unknown parameter(s) {unknown}; allowed parameters: {allowed}")
