"""A compressed context in a file, and a file back as a context's parts: a saved file is data to validate, never to
trust.

The file is safetensors: tensors and two metadata strings, nothing executed on load. `kvpress` is the header (JSON):
a format name and version, the kvpress version, the model's identity (architecture shape and a digest of every
element of every weight and buffer), the cache's dtype, the policy (names and plain hyper-parameters), the question
format, the tokenizer's fingerprint and the cache's layout (saving.py). `kvpress_checksum` is a digest of the
header's exact text and of every tensor (name, dtype, shape, bytes): a changed byte anywhere is refused as damage.

A file whose checksum was recomputed after a change is refused where it is not a cache this model could have made:
the header is checked field by field (types, ranges, which tensors each layer names) and every tensor against the
model (shape, dtype, finite values, positions among the tokens seen) before anything is built. Every refusal is a
ValueError naming the field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open  # transformers' own dependency
from safetensors.torch import save_file

from .cache import KVPressCache, saving
from .formats import checked
from .formats.calibration import model_identity
from .policies.registry import get_policy_class, resolve_policy
from .questions import QuestionFormat
from .version import __version__

FILE_FORMAT = "kvpress compressed context"
FILE_VERSION = 2  # 2: the checksum covers the header (version 1 files checksummed their tensors only)
HEADER_KEY, CHECKSUM_KEY = "kvpress", "kvpress_checksum"
_HEADER_FIELDS = ("format", "version", "kvpress", "model", "dtype", "policy", "question_format", "tokenizer",
                  "compress_s", "cache")
_TOKENIZER_PROBE = "kvpress tokenizer probe: The quick brown fox, 0123456789.\n\u00e9\u4e2d"


# ---------------------------------------------------------------------------- what a file records
def policy_spec(policy) -> list[dict]:
    """A resolved policy as [{"name", "params"}] per part: every hyper-parameter a JSON file can hold. Refused when
    a part holds another object (other than a tokenizer, which is given again when the context is asked). Fields
    that take no part in a policy's equality (compare=False: what for_model resolves, CommVQ's codebooks) are
    resources, resolved again for the model that loads the file, not recorded."""
    spec = []
    for part in policy.parts():
        params = {}
        for f in dataclasses.fields(part):
            if not f.compare:
                continue
            value = getattr(part, f.name)
            if isinstance(value, (bool, int, float, str, type(None))):
                params[f.name] = value
            elif f.name != "tokenizer" and value != f.default:
                raise ValueError(f"policy {part.name!r}: {f.name}={type(value).__name__}(...) cannot be recorded; "
                                 f"allowed: hyper-parameters given as numbers or strings (a calibration as its path)")
        spec.append(dict(name=part.name, params=params))
    return spec


def policy_from_spec(spec: list[dict], tokenizer=None):
    """The policy a spec records (a fresh instance: a policy serves one patch at a time)."""
    parts = []
    for entry in spec:
        cls = get_policy_class(entry["name"])
        params = dict(entry["params"])
        if tokenizer is not None and "tokenizer" in {f.name for f in dataclasses.fields(cls)}:
            params["tokenizer"] = tokenizer
        parts.append(cls(**params))
    return resolve_policy(parts if len(parts) > 1 else parts[0])


def weights_fingerprint(model) -> str:
    """A digest of every parameter and buffer: names, dtypes, shapes and every element's bytes (any fine-tune, any
    other RoPE table changes it). Tensors are hashed on several threads (hashlib releases the GIL): about a second
    for SmolLM2 in fp32 on 2 cores, next to a prefill of several seconds."""
    named = [*model.named_parameters(), *model.named_buffers()]

    def digest(item) -> bytes:
        name, t = item
        t = t.detach()
        if hasattr(t, "full_tensor"):  # a DTensor (tensor parallelism): every rank hashes the whole tensor
            t = t.full_tensor()
        data = t.to("cpu").contiguous().reshape(-1)
        h = hashlib.sha256(f"{name}{t.dtype}{tuple(t.shape)}".encode())
        h.update(data.view(torch.uint8).numpy() if data.numel() else b"")
        return h.digest()

    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        parts = list(pool.map(digest, named))
    return hashlib.sha256(b"".join(parts)).hexdigest()[:32]


def tokenizer_fingerprint(tokenizer) -> str:
    text = json.dumps([list(tokenizer.encode(_TOKENIZER_PROBE, add_special_tokens=True)),
                       getattr(tokenizer, "chat_template", None) or ""])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def identity(model) -> dict:
    return dict(model_identity(model), parameters=weights_fingerprint(model))


def model_dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


def model_device(model) -> torch.device:
    return next(model.parameters()).device


# ---------------------------------------------------------------------------- writing
def write(path, model, cache: KVPressCache, context_ids: torch.Tensor, policy: list[dict],
          question_format: QuestionFormat, tokenizer_id: str, compress_s: float | None) -> Path:
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"path={str(path)!r} is a folder; allowed: a file path (e.g. {str(path / 'doc.kvpress')!r})")
    if not path.parent.is_dir():
        raise ValueError(f"path={str(path)!r}: its folder {str(path.parent)!r} does not exist; allowed: a file path "
                         f"in an existing folder")
    tensors, cache_meta = saving.to_tensors(cache)
    tensors["context_ids"] = context_ids.to("cpu").contiguous().clone()
    header = dict(format=FILE_FORMAT, version=FILE_VERSION, kvpress=__version__, model=identity(model),
                  dtype=str(model_dtype(model)).removeprefix("torch."), policy=policy,
                  question_format=question_format.to_dict(), tokenizer=tokenizer_id, compress_s=compress_s,
                  cache=cache_meta)
    text = json.dumps(header, sort_keys=True)
    try:
        save_file(tensors, str(path), metadata={HEADER_KEY: text, CHECKSUM_KEY: checksum(text, tensors)})
    except OSError as e:
        raise ValueError(f"path={str(path)!r} cannot be written ({e.strerror or e}); allowed: a writable file "
                         f"path") from None
    return path


# ---------------------------------------------------------------------------- reading
@dataclass
class Saved:
    """The parts of a context a file holds, every one checked against the model it is loaded for."""

    cache: KVPressCache
    context_ids: torch.Tensor
    policy: list[dict]
    question_format: QuestionFormat
    tokenizer_id: str
    compress_s: float | None


def read(path, model) -> Saved:
    """The context `write` put in `path`, for `model`: refused (ValueError, saying why) when the file is not a
    kvpress context, is damaged, was made by another model or in another dtype, or holds what no cache of this
    model holds."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path={path!r:.60}; allowed values: a file path (str or pathlib.Path)")
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model={type(model).__name__}; allowed values: the transformers model the context was "
                         f"compressed with")
    return opened(path).for_model(model)


@dataclass(frozen=True)
class OpenedFile:
    """A kvpress context file checked as a file (readable, this format and version, its checksum), before any model:
    what `kvpress ask` checks before it loads one. `for_model` checks the rest against the model."""

    path: Path
    header: dict
    tensors: dict

    def for_model(self, model) -> Saved:
        try:
            return _validated(self.header, self.tensors, model)
        except ValueError as e:
            raise ValueError(f"{self.path}: {e}") from None


def opened(path) -> OpenedFile:
    """`path` read and checked as a kvpress context file (read checks the path's type first)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path={str(path)!r}: no such file")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            text, written = metadata[HEADER_KEY], metadata.get(CHECKSUM_KEY)
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors' header errors, a missing key, bad bytes: one refusal
        raise ValueError(f"{path}: not a readable kvpress context file ({type(e).__name__}: {e})") from None
    try:
        header = json.loads(text)
    except (TypeError, ValueError):
        raise ValueError(f"{path}: damaged (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: damaged (its header is not a JSON object)")
    if header.get("format") != FILE_FORMAT or header.get("version") != FILE_VERSION:
        raise ValueError(f"{path}: format {header.get('format')!r:.60} version {header.get('version')!r:.20}; this "
                         f"kvpress reads {FILE_FORMAT!r} version {FILE_VERSION} (compress the context again)")
    if written != checksum(text, tensors):
        raise ValueError(f"{path}: damaged (its header's or tensors' bytes do not match the checksum written with "
                         f"them)")
    return OpenedFile(path, header, tensors)


def _validated(header: dict, tensors: dict, model) -> Saved:
    checked.only_keys(header, _HEADER_FIELDS, "header")
    dtype = str(model_dtype(model)).removeprefix("torch.")
    saved_dtype = checked.entry(header, "dtype", "header")
    if saved_dtype != dtype:
        raise ValueError(f"holds a {saved_dtype!s:.20} cache; the model runs in {dtype}; allowed: the model in "
                         f"{saved_dtype!s:.20} (model.to(torch.{saved_dtype!s:.20}))")
    saved = checked.entry(header, "model", "header")
    mine = identity(model)
    if not isinstance(saved, dict):
        raise ValueError("header.model: not an object")
    differ = [f"{k}: file {saved.get(k)!r}, model {v!r}" for k, v in mine.items() if saved.get(k) != v]
    if differ or set(saved) != set(mine):
        raise ValueError(f"compressed with another model ({'; '.join(differ) or 'other identity fields'}); allowed: "
                         f"the model it was made with")
    checked.string(checked.entry(header, "kvpress", "header"), "header.kvpress")
    policy = _policy(checked.entry(header, "policy", "header"))
    question_format = _question_format(checked.entry(header, "question_format", "header"))
    tokenizer_id = checked.string(checked.entry(header, "tokenizer", "header"), "header.tokenizer")
    compress_s = checked.number(checked.entry(header, "compress_s", "header"), "header.compress_s", 0, optional=True)
    if "context_ids" not in tensors:
        raise ValueError("tensor 'context_ids' is missing")
    vocab = model.get_input_embeddings().weight.shape[0]
    context_ids = checked.tensor(tensors["context_ids"], "context_ids", torch.int64, (1, None))
    if context_ids.shape[1] < 1:
        raise ValueError("context_ids: no token; allowed: the context's token ids [1, n >= 1]")
    checked.within(context_ids, "context_ids", 0, vocab)
    expected = saving.expected_of(model.config, model_dtype(model), context_ids.shape[1])
    cache = saving.from_tensors(tensors, checked.entry(header, "cache", "header"), model.config, expected,
                                device=model_device(model))
    if any(layer.key_valid().shape[0] != 1 for _, layer in cache.kvpress_layers() if layer.is_initialized):
        raise ValueError("cache: more than one row; allowed: the one row of a compressed context")
    return Saved(cache, context_ids, policy, question_format, tokenizer_id, compress_s)


def _policy(spec) -> list[dict]:
    """The recorded policy, rebuilt once to prove it names registered policies and their own valid parameters."""
    checked.array(spec, "header.policy")
    if not spec:
        raise ValueError("header.policy: empty; allowed: one entry per part of the policy")
    for i, entry in enumerate(spec):
        where = f"header.policy[{i}]"
        checked.only_keys(entry if isinstance(entry, dict) else {}, ("name", "params"), where)
        checked.string(checked.entry(entry, "name", where), f"{where}.name")
        params = checked.entry(entry, "params", where)
        if not isinstance(params, dict) or not all(isinstance(v, (bool, int, float, str, type(None)))
                                                   for v in params.values()):
            raise ValueError(f"{where}.params: allowed: an object of numbers, strings, booleans and nulls")
    try:
        policy_from_spec(spec)
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"header.policy: {e}") from None
    return spec


def _question_format(value) -> QuestionFormat:
    checked.only_keys(value if isinstance(value, dict) else {}, ("before", "after", "chat_template"),
                     "header.question_format")
    return QuestionFormat(
        checked.string(checked.entry(value, "before", "header.question_format"), "header.question_format.before"),
        checked.string(checked.entry(value, "after", "header.question_format"), "header.question_format.after"),
        checked.boolean(checked.entry(value, "chat_template", "header.question_format"),
                       "header.question_format.chat_template"))


def checksum(text: str, tensors: dict) -> str:
    """A digest of the header's exact text and of every tensor's name, dtype, shape and bytes."""
    digest = hashlib.sha256(text.encode() if isinstance(text, str) else b"\0")
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(f"{name}{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()
