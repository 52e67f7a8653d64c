"""Checks of command-line arguments that kvpress's commands share (`kvpress calibrate`, `kvpress-eval`). Each raises
ValueError naming the flag and the allowed values, so a command refuses bad input before any work (a model loaded,
a calibration run, samples evaluated) and reports it without a traceback."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from . import models


def at_least(flag: str, value, low: int, why: str = "") -> int:
    """`value` as an int >= `low`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{flag}={value}; allowed values: an int >= {low}{why}")
    return value


def model_folder(flag: str, model: str) -> Path:
    """The checkpoint folder of a kvpress model name (prepared) or of a local path (with config.json); never a hub id:
    nothing is downloaded."""
    if model in models.MODELS:
        path = models.model_path(model)
        if not models.is_available(model):
            raise ValueError(f"{flag}={model!r} is not prepared at {path}; run `make models` first")
        return path
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(f"{flag}={model!r}: not a folder with config.json, nor a kvpress model name; allowed "
                         f"values: an HF checkpoint folder or one of {sorted(models.MODELS)}")
    return path


def writable_folder(flag: str, path) -> Path:
    """`path` as a folder this process can write into once it creates it (if missing)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag}={str(path)!r} is a file; allowed values: a folder (existing or new) you can write to")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag}={str(path)!r}: {str(existing)!r} is not a folder you can write to; allowed values: "
                         f"a folder (existing or new) you can write to")
    return path


def writable_file(flag: str, path) -> Path:
    """`path` as a file this process can (over)write, in a folder it can write to or create."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag}={str(path)!r} is a folder; allowed values: a file path you can write to")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{flag}={str(path)!r} cannot be overwritten; allowed values: a file path you can write to")
    writable_folder(flag, path.parent)
    return path


def device(flag: str, name: str) -> str:
    """A device this torch has: 'auto', 'cpu', or an accelerator (cuda, cuda:N, ...) that is present."""
    if name == "auto":
        return name
    try:
        chosen = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"{flag}={name!r}: {e}; allowed values: auto, cpu, cuda, cuda:N") from None
    if chosen.type == "cpu":
        return name
    backend = getattr(torch, chosen.type, None)
    available = getattr(backend, "is_available", lambda: False)()
    count = backend.device_count() if available and hasattr(backend, "device_count") else 0
    if count == 0:
        raise ValueError(f"{flag}={name!r}: torch {torch.__version__} has no {chosen.type} device here; allowed "
                         f"values: auto, cpu")
    if chosen.index is not None and chosen.index >= count:
        raise ValueError(f"{flag}={name!r}: there are {count} {chosen.type} devices; allowed values: auto, cpu, "
                         f"{chosen.type}:0 to {chosen.type}:{count - 1}")
    return name
