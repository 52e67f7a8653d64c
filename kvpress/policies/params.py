"""Hyper-parameters: how a policy's dataclass fields are checked, the one validation system of every policy.

Two layers, always run together and always in this order, at construction and at every later assignment:
  kinds    a field annotated int / float / str / bool (or `X | None`) must hold that kind (check_kinds, here):
           generic, from the annotation, so a policy never checks a type itself
  ranges   the policy's own `validate()`: values, ranges and relations between fields, with the allowed values
A bad value is refused with a ValueError naming the parameter and what is allowed; an assignment that fails leaves
the old value. Parameter NAMES are checked before a constructor runs (check_params), so a misspelt one names the
allowed ones instead of raising a TypeError.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

# annotation -> whether a value is of that kind (bools are not numbers here, strings are not numbers)
KINDS = {
    "int": lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
}
KIND_WORDS = {"int": "an int", "float": "a number", "str": "a string", "bool": "True or False", "None": "None"}
# field metadata: a count of tokens (or slots) that may not exceed the model's context
WITHIN_CONTEXT = "within_context"


def tokens(default: int):
    """A hyper-parameter counting tokens whose value sizes an allocation or a loop (a reserve, a page, a run of
    pseudo tokens): at most the model's context (check_context), where a larger one could only exhaust memory or
    time for nothing."""
    return dataclasses.field(default=default, metadata={WITHIN_CONTEXT: True})


def check_context(policy, context: int | None) -> None:
    """ValueError naming the first hyper-parameter declared with tokens() that exceeds `context`, the model's
    max_position_embeddings (None: the model declares none, nothing is bounded)."""
    if context is None:
        return
    for part in policy.parts():
        for f in dataclasses.fields(part):
            value = getattr(part, f.name)
            if f.metadata.get(WITHIN_CONTEXT) and value is not None and value > context:
                raise ValueError(f"{part.name}: {f.name}={value} is more tokens than the model reads "
                                 f"(max_position_embeddings={context}); allowed values: at most {context}")


def check_params(cls: type, params: dict) -> None:
    """ValueError naming every parameter `cls` (a policy class) does not take (before a constructor's TypeError
    could)."""
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"{cls.name}: unknown parameter(s) {unknown}; allowed parameters: {allowed}")


class HyperParameters:
    """The checking half of a policy: its dataclass fields are hyper-parameters, checked by kind (annotations) then
    by `validate()` at construction and at every assignment, and frozen while a patch uses them (claim).
    A subclass is a dataclass with a `name`, `describe()` and `parts()` (Policy)."""

    def validate(self) -> None:
        """Raise ValueError naming the parameter and its allowed values; called before any patching."""

    def __post_init__(self):
        self.check_kinds()
        self.validate()
        object.__setattr__(self, "_checked", True)

    def claim(self, delta: int) -> None:
        """Count a patch that starts (+1) or stops (-1) using this policy and its parts. While one does, their
        hyper-parameters cannot change: the patch checked them against its model (for_model) and set up what they
        need (rotary embeddings, hooks for hidden states), which a change would silently bypass."""
        for part in {id(p): p for p in (self, *self.parts())}.values():
            object.__setattr__(part, "_patches", part.__dict__.get("_patches", 0) + delta)

    def __getstate__(self):  # a copy (copy, deepcopy, pickle) is used by no patch
        return {k: v for k, v in self.__dict__.items() if k != "_patches"}

    def __setattr__(self, name, value):
        """A hyper-parameter changed after construction is checked like one given to the constructor; a bad value
        is refused and the old one stays. One a patch uses cannot change (see claim)."""
        if name in self.__dataclass_fields__ and self.__dict__.get("_patches"):
            raise ValueError(
                f"{self.name}: {name}={value!r} while a patch uses this policy ({self.describe()}): the patch checked "
                f"its parameters against the model and set up what they need; allowed: patch.unpatch(), then "
                f"kvpress.patch_model(model, policy, {name}=...) (or a copy: dataclasses.replace(policy, {name}=...))")
        if name not in self.__dataclass_fields__ or not self.__dict__.get("_checked"):
            object.__setattr__(self, name, value)
            return
        previous = getattr(self, name)
        object.__setattr__(self, name, value)
        try:
            self.check_kinds()
            self.validate()
        except ValueError:
            object.__setattr__(self, name, previous)
            raise

    def check_kinds(self) -> None:
        """Hyper-parameters annotated int / float / str / bool (or `X | None`) must be of that kind: numpy and
        other Integral/Real numbers are converted, bools are not numbers here, strings are not numbers."""
        for f in dataclasses.fields(self):
            text = f.type.__name__ if isinstance(f.type, type) else str(f.type)  # a type, or "int | None"
            kinds = [k.strip() for k in text.split("|")]
            if not all(k in KINDS or k == "None" for k in kinds):
                continue  # not a plain hyper-parameter (tensors, tokenizers, nested policies)
            value = getattr(self, f.name)
            if value is None and "None" in kinds:
                continue
            if kinds != ["str"] and isinstance(value, numbers.Real) and not math.isfinite(value):
                # nan compares False with every bound, so range checks alone would let it through
                raise ValueError(f"{self.name}: {f.name}={value!r}; allowed values: a finite number")
            for kind in kinds:
                if kind != "None" and KINDS[kind](value):
                    converted = int(value) if kind == "int" else float(value) if kind == "float" else value
                    object.__setattr__(self, f.name, converted)
                    break
            else:
                raise ValueError(f"{self.name}: {f.name}={value!r}; allowed values: "
                                 f"{' or '.join(KIND_WORDS[k] for k in kinds)}")
