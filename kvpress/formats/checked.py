"""Fields of data read from a file, checked as they are taken (checked.integer, checked.tensor, ...): a file is
data to validate, never to trust.

Each check names where the value sits (`cache.layers[3].counters.seen`) and what it may be, and raises ValueError,
so a damaged or crafted file is refused with one kind of error, before anything is built from it.
"""

from __future__ import annotations

import math

import torch


def entry(obj, key: str, where: str):
    """obj[key], where obj must be a JSON object holding key."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a {type(obj).__name__} where an object was expected")
    if key not in obj:
        raise ValueError(f"{where}.{key}: missing")
    return obj[key]


def only_keys(obj: dict, keys, where: str) -> None:
    """Refuse fields a writer never writes (a crafted file's extra state would be ignored silently)."""
    extra = sorted(set(obj) - set(keys))
    if extra:
        raise ValueError(f"{where}: unknown field(s) {extra}; allowed: {sorted(keys)}")


def integer(value, where: str, low: int | None = None, high: int | None = None) -> int:
    """An int (not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low) or (
            high is not None and value > high):
        bounds = " and ".join(b for b in (f">= {low}" if low is not None else "", f"<= {high}" if high is not None
                                          else "") if b)
        raise ValueError(f"{where}={value!r:.60}; allowed values: an int{' ' + bounds if bounds else ''}")
    return value


def optional_integer(value, where: str, low: int | None = None, high: int | None = None) -> int | None:
    return None if value is None else integer(value, where, low, high)


def number(value, where: str, low: float | None = None, optional: bool = False) -> float | None:
    """A finite int or float (>= low), or None when optional."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            low is not None and value < low):
        raise ValueError(f"{where}={value!r:.60}; allowed values: a finite number"
                         f"{f' >= {low}' if low is not None else ''}{' or null' if optional else ''}")
    return value


def boolean(value, where: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where}={value!r:.60}; allowed values: true or false")
    return value


def string(value, where: str, choices=None) -> str:
    if not isinstance(value, str) or (choices is not None and value not in choices):
        allowed = f"one of {sorted(choices)}" if choices is not None else "a string"
        raise ValueError(f"{where}={value!r:.60}; allowed values: {allowed}")
    return value


def array(value, where: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{where}: a {type(value).__name__} where a list was expected")
    return value


def tensor(t: torch.Tensor, where: str, dtype: torch.dtype | tuple, shape: tuple | None = None,
           finite: bool = False) -> torch.Tensor:
    """A tensor of `dtype` (or one of several), of `shape` (None entries: any size), with finite values if asked."""
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        raise ValueError(f"{where}: dtype {str(t.dtype).removeprefix('torch.')}; allowed: "
                         f"{' or '.join(str(d).removeprefix('torch.') for d in dtypes)}")
    if shape is not None and (t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape))):
        wanted = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{where}: shape {list(t.shape)}; allowed: {wanted}")
    if finite and t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{where}: holds NaN or infinite values; allowed: finite values")
    return t


def within(t: torch.Tensor, where: str, low: int, high: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Integer entries (those where mask, if given) in [low, high)."""
    values = t if mask is None else t[mask]
    if values.numel() and (int(values.min()) < low or int(values.max()) >= high):
        raise ValueError(f"{where}: values from {int(values.min())} to {int(values.max())}; allowed: "
                         f"{low} <= value < {high}")
    return t
