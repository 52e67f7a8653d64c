"""A KVPressCache as plain tensors and JSON-able metadata, and back: what a file format (kvpress/compressed.py
writes safetensors) stores, so that loading executes no code.

Every stored tensor gets a name, `layers.<i>.<part>`; the metadata says, per layer, its kind, its counters and which
named tensors make each segment. Payloads are dataclasses (FullPrecision, LowBitCodes): their tensor fields are
saved by name and their scalar fields (bits, group size) go into the metadata, so a new payload field needs no
change here. A full-precision tail is saved without its spare room (its filled slots only).
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from ..formats.lowbit import LowBitCodes
from .cache import KVPressCache
from .layer import KVPressLayer
from .payloads import FullPrecision
from .segments import Segment

FORMAT = 1  # bumped when a file of the previous layout would be read wrong
PAYLOADS = {"full_precision": FullPrecision, "low_bit": LowBitCodes}
_PAYLOAD_NAMES = {cls: name for name, cls in PAYLOADS.items()}
_COUNTERS = ("seen", "appended", "decode_start", "rollback_floor", "last_q_len", "explicit_positions", "sorted")


def to_tensors(cache: KVPressCache) -> tuple[dict[str, torch.Tensor], dict]:
    """(named tensors, metadata) of every layer. Shared or strided tensors are stored as contiguous copies."""
    if cache.forward_state.observers:
        raise ValueError("cache: a forward is running on it (observation tokens held); save it after the forward")
    kinds = {type(s.data) for _, layer in cache.kvpress_layers() if layer.is_initialized for s in layer.segments}
    if kinds - set(_PAYLOAD_NAMES):  # (ShadowKV's file tier and rotary are not tensors a safetensors file holds)
        names = sorted(k.__name__ for k in kinds - set(_PAYLOAD_NAMES))
        raise ValueError(f"cache: its layers hold {names} storage, which is not saved; allowed: a cache of "
                         f"{sorted(PAYLOADS)} storage")
    tensors: dict[str, torch.Tensor] = {}

    def put(name: str, tensor: torch.Tensor) -> str:
        tensors[name] = tensor.detach().to("cpu").contiguous().clone()
        return name

    layers = []
    for i, layer in enumerate(cache.layers):
        prefix = f"layers.{i}"
        if isinstance(layer, KVPressLayer):
            layers.append(_kvpress_layer(layer, prefix, put))
        elif isinstance(layer, DynamicSlidingWindowLayer):
            entry = dict(kind="sliding", sliding_window=layer.sliding_window, initialized=layer.is_initialized)
            if layer.is_initialized:
                entry.update(cumulative_length=int(layer.cumulative_length),
                             keys=put(f"{prefix}.keys", layer.keys), values=put(f"{prefix}.values", layer.values))
            layers.append(entry)
        else:
            raise ValueError(f"cache layer {i} is a {type(layer).__name__}; allowed: KVPressLayer or transformers' "
                             f"DynamicSlidingWindowLayer (what a KVPressCache holds)")
    meta = dict(format=FORMAT, layers=layers, prefill_nbytes=cache.prefill_nbytes,
                prefill_kv_nbytes=cache.prefill_kv_nbytes)
    return tensors, meta


def _kvpress_layer(layer: KVPressLayer, prefix: str, put) -> dict:
    if not layer.is_initialized:
        return dict(kind="kvpress", initialized=False)
    entry = dict(kind="kvpress", initialized=True, dtype=str(layer.dtype).removeprefix("torch."),
                 counters={name: getattr(layer, name) for name in _COUNTERS})
    for name in ("padding", "row_budget"):
        value = getattr(layer, name)
        entry[name] = None if value is None else put(f"{prefix}.{name}", value)
    entry["policy_stats"] = {n: put(f"{prefix}.policy_stats.{n}", t) for n, t in layer.policy_stats.items()}
    segments = []
    for j, segment in enumerate(layer.segments):
        where = f"{prefix}.segments.{j}"
        data = segment.data
        payload = dict(kind=_PAYLOAD_NAMES[type(data)], scalars={}, tensors={})
        for f in dataclasses.fields(data):
            value = getattr(data, f.name)
            if f.name == "room" or value is None:
                continue  # spare room of a tail is not state
            if isinstance(value, torch.Tensor):
                payload["tensors"][f.name] = put(f"{where}.data.{f.name}", value)
            else:
                payload["scalars"][f.name] = value
        segments.append(dict(
            payload=payload,
            **{n: None if getattr(segment, n) is None else put(f"{where}.{n}", getattr(segment, n))
               for n in ("positions", "valid", "lengths")},
            state={n: put(f"{where}.state.{n}", t) for n, t in segment.state.items()}))
    entry["segments"] = segments
    return entry


def from_tensors(tensors: dict[str, torch.Tensor], meta: dict, config, device=None) -> KVPressCache:
    """The cache `to_tensors` described, for a model of `config` (its layer kinds must match the file's)."""
    if meta.get("format") != FORMAT:
        raise ValueError(f"cache layout format {meta.get('format')!r}; this kvpress reads format {FORMAT}")
    cache = KVPressCache(config)
    if cache.layer_class_to_replicate is not None:  # a config without layer kinds: every layer is a kvpress layer
        cache.layers = [KVPressLayer() for _ in meta["layers"]]
    if len(cache.layers) != len(meta["layers"]):
        raise ValueError(f"the file holds {len(meta['layers'])} layers; the model has {len(cache.layers)}")

    def get(name):
        if name is None:
            return None
        if name not in tensors:
            raise ValueError(f"tensor {name!r} is missing")
        return tensors[name] if device is None else tensors[name].to(device)

    for i, (layer, entry) in enumerate(zip(cache.layers, meta["layers"])):
        mine = "kvpress" if isinstance(layer, KVPressLayer) else "sliding"
        if entry["kind"] != mine:
            raise ValueError(f"layer {i} was saved as a {entry['kind']} layer; the model's layer {i} is {mine}")
        if not entry["initialized"]:
            continue
        if mine == "sliding":
            keys, values = get(entry["keys"]), get(entry["values"])
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
            layer.cumulative_length = entry["cumulative_length"]
            continue
        segments = []
        for s in entry["segments"]:
            payload = s["payload"]
            cls = PAYLOADS[payload["kind"]]
            data = cls(**payload["scalars"], **{n: get(t) for n, t in payload["tensors"].items()})
            segments.append(Segment(data, get(s["positions"]), get(s["valid"]),
                                    {n: get(t) for n, t in s["state"].items()}, get(s["lengths"])))
        tail = segments[-1].data
        layer.lazy_initialization(tail.keys, tail.values)
        layer.segments = segments
        for name, value in entry["counters"].items():
            if name not in _COUNTERS:
                raise ValueError(f"layer {i}: unknown counter {name!r}")
            setattr(layer, name, value)
        layer.padding, layer.row_budget = get(entry["padding"]), get(entry["row_budget"])
        layer.policy_stats = {n: get(t) for n, t in entry["policy_stats"].items()}
    cache.prefill_nbytes, cache.prefill_kv_nbytes = meta["prefill_nbytes"], meta["prefill_kv_nbytes"]
    return cache
