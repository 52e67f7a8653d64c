"""Policies by name."""

from __future__ import annotations

import dataclasses

from .compose import Composed
from .params import check_params
from .protocol import Policy
from .roles import Codec, ReadView, StorageTier

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


def resolve_policy(policy, **params) -> Policy:
    """A Policy from a name (+ hyper-parameters), an instance (+ overrides), or a composition: "snapkv+kivi"
    or [SnapKV(...), KIVI(...)] (one eviction policy and at most one codec; each parameter goes to the part
    that declares it)."""
    if policy is None:
        policy = "none"
    if isinstance(policy, str) and "+" in policy:
        parts = [part.strip() for part in policy.split("+")]
        if not all(parts):
            raise ValueError(f"policy={policy!r} has an empty part; allowed values: names from {list_policies()} "
                             f"joined by '+', e.g. 'snapkv+kivi'")
        policy = parts
    if isinstance(policy, (list, tuple)):
        return _compose(policy, params)
    if isinstance(policy, str):
        cls = get_policy_class(policy)
        check_params(cls, params)
        return cls(**params)
    if isinstance(policy, Policy):
        if params:
            check_params(type(policy), params)
            return dataclasses.replace(policy, **params)
        policy.validate()
        return policy
    raise ValueError(f"policy={policy!r}; allowed values: a name in {list_policies()} or a kvpress Policy instance")


def _compose(parts, params: dict) -> Policy:
    if not parts:
        raise ValueError("policy=[]; allowed values: a name, a Policy, or a list of one eviction policy and one codec")
    classes = [get_policy_class(p) if isinstance(p, str) else type(p) for p in parts]
    for p in parts:
        if not isinstance(p, (str, Policy)):
            raise ValueError(f"policy part {p!r}; allowed values: a name in {list_policies()} or a Policy instance")
    allowed = {name for cls in classes for name in (f.name for f in dataclasses.fields(cls))}
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ValueError(f"{'+'.join(c.name for c in classes)}: unknown parameter(s) {unknown}; "
                         f"allowed parameters: {sorted(allowed)}")
    built = []
    for part, cls in zip(parts, classes):
        own = {k: v for k, v in params.items() if k in {f.name for f in dataclasses.fields(cls)}}
        built.append(resolve_policy(part, **own))
    readers = [p for p in built if isinstance(p, ReadView)]
    if readers:
        raise ValueError(f"policy: {readers[0].name!r} is a read policy (it picks the slots each decode step reads and "
                         f"evicts nothing), which composes with no eviction policy or codec; allowed: "
                         f"{readers[0].name!r} alone, or as a speculative draft")
    tiers = [p for p in built if isinstance(p, StorageTier)]
    if tiers:
        raise ValueError(f"policy: {tiers[0].name!r} is a storage tier (it stores the whole prompt in a layout of its "
                         f"own and evicts nothing), which composes with no eviction policy or codec; allowed: "
                         f"{tiers[0].name!r} alone")
    codecs = [p for p in built if isinstance(p, Codec)]
    evictors = [p for p in built if not isinstance(p, Codec)]
    if len(codecs) > 1:
        raise ValueError(f"policy: {[c.name for c in codecs]} are two storage codecs; allowed: at most one codec "
                         f"({[n for n in list_policies() if issubclass(get_policy_class(n), Codec)]})")
    if len(evictors) > 1:
        raise ValueError(f"policy: {[e.name for e in evictors]} are two eviction policies; allowed: one eviction "
                         f"policy plus at most one codec")
    if not codecs:
        return evictors[0]
    return Composed(evictor=evictors[0] if evictors else get_policy_class("none")(), codec=codecs[0])
