"""Checks of command-line arguments that kvpress's commands share (`kvpress calibrate`, `kvpress-eval`). Each raises
ValueError naming the flag and the allowed values, so a command refuses bad input before any work (a model loaded,
a calibration run, samples evaluated) and reports it without a traceback."""

from __future__ import annotations

import json
import os
import tempfile
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


def within_context(flag: str, value: int, folder: Path, why: str = "") -> int:
    """`value` tokens at most the context of the model in `folder` (its config.json's max_position_embeddings)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    context = config.get("text_config", config).get("max_position_embeddings")
    if context is not None and value > context:
        raise ValueError(f"{flag}={value}: more tokens than the model reads (max_position_embeddings={context}); "
                         f"allowed values: at most {context}{why}")
    return value


def writable_folder(flag: str, path) -> Path:
    """`path` as a folder this process can write into once it creates it (if missing): a file is made and removed
    in its nearest existing folder (permission bits say too little: root, read-only mounts, /proc)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag}={str(path)!r} is a file; allowed values: a folder (existing or new) you can write to")
    existing = next(p for p in (path, *path.parents) if p.exists())
    why = "not a folder" if not existing.is_dir() else _cannot_create_in(existing)
    if why:
        raise ValueError(f"{flag}={str(path)!r}: {str(existing)!r} is not a folder you can write to ({why}); allowed "
                         f"values: a folder (existing or new) you can write to")
    return path


def _cannot_create_in(folder: Path) -> str | None:
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvpress-probe-", dir=folder)
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    os.unlink(probe)
    return None


def writable_file(flag: str, path) -> Path:
    """`path` as a file this process can (over)write, in a folder it can write to or create."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag}={str(path)!r} is a folder; allowed values: a file path you can write to")
    if path.exists():
        try:
            open(path, "ab").close()  # (append mode: the content stays)
        except OSError as e:
            raise ValueError(f"{flag}={str(path)!r} cannot be overwritten ({e.strerror or e}); allowed values: a file "
                             f"path you can write to") from None
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
        if chosen.index is not None:
            raise ValueError(f"{flag}={name!r}: torch has one CPU device; allowed values: auto, cpu")
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
