"""A KVPressCache as plain tensors and JSON-able metadata, and back: what a file format (kvpress/compressed.py
writes safetensors) stores, so that loading executes no code.

Every stored tensor gets a name, `layers.<i>.<part>`; the metadata says, per layer, its kind, its counters and which
named tensors make each segment. Payloads are dataclasses (FullPrecision, LowBitCodes): their tensor fields are
saved by name and their scalar fields (bits, group size) go into the metadata, so a new payload field needs no
change here. A full-precision tail is saved without its spare room (its filled slots only).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from ..formats import checked
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
    if any(layer.prefix is not None for _, layer in cache.kvpress_layers()):
        raise ValueError("cache: its rows share a context (share_context); allowed: the context's own cache, saved "
                         "before its rows are made (CompressedContext.save)")
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


@dataclass(frozen=True)
class Expected:
    """What the model a cache is loaded for stores: every saved tensor is checked against it."""

    dtype: torch.dtype
    kv_heads: int
    head_dim: int
    seen: int  # tokens every layer has seen (a compressed context: its context tokens)


def expected_of(config, dtype: torch.dtype, seen: int) -> Expected:
    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return Expected(dtype, kv_heads, head_dim, seen)


def from_tensors(tensors: dict[str, torch.Tensor], meta: dict, config, expected: Expected,
                 device=None) -> KVPressCache:
    """The cache `to_tensors` described, for a model of `config` storing what `expected` says. Nothing in the file
    is trusted: every field, tensor name, shape, dtype, value range and cross-reference is checked before the cache
    is built (a ValueError naming the field otherwise), and every tensor must belong to the cache."""
    if not isinstance(meta, dict):
        raise ValueError(f"cache: a {type(meta).__name__} where an object was expected")
    checked.only_keys(meta, ("format", "layers", "prefill_nbytes", "prefill_kv_nbytes"), "cache")
    if checked.entry(meta, "format", "cache") != FORMAT:
        raise ValueError(f"cache.format={meta['format']!r}; this kvpress reads cache layout format {FORMAT}")
    entries = checked.array(checked.entry(meta, "layers", "cache"), "cache.layers")
    cache = KVPressCache(config)
    if cache.layer_class_to_replicate is not None:  # a config without layer kinds: every layer is a kvpress layer
        cache.layers = [KVPressLayer() for _ in entries]
    if len(cache.layers) != len(entries):
        raise ValueError(f"cache.layers: {len(entries)} layers; the model has {len(cache.layers)}")
    used: set[str] = set()

    def get(name, expect_name: str) -> torch.Tensor | None:
        """The tensor a field names, which must be the one the writer names there (no layer reads another's)."""
        if name is None:
            return None
        if name != expect_name:
            raise ValueError(f"{expect_name}: names tensor {name!r:.80}; allowed: {expect_name!r}")
        if name not in tensors:
            raise ValueError(f"tensor {name!r} is missing")
        used.add(name)
        return tensors[name]

    built = [_sliding_layer(layer, entry, f"cache.layers[{i}]", f"layers.{i}", get, expected)
             if isinstance(layer, DynamicSlidingWindowLayer) else
             _read_kvpress_layer(entry, f"cache.layers[{i}]", f"layers.{i}", get, expected)
             for i, (layer, entry) in enumerate(zip(cache.layers, entries))]
    stray = sorted(set(tensors) - used - {"context_ids"})
    if stray:
        raise ValueError(f"tensor(s) {stray[:4]} belong to no field of the cache; allowed: the tensors its layers name")
    cache.layers = [layer if device is None else _moved(layer, device) for layer in built]
    cache.prefill_nbytes = checked.optional_integer(checked.entry(meta, "prefill_nbytes", "cache"),
                                                   "cache.prefill_nbytes", 0)
    cache.prefill_kv_nbytes = checked.optional_integer(checked.entry(meta, "prefill_kv_nbytes", "cache"),
                                                      "cache.prefill_kv_nbytes", 0)
    return cache


def _moved(layer, device):
    if isinstance(layer, KVPressLayer):
        if layer.is_initialized:
            layer.segments = [s.to(device) for s in layer.segments]
            layer.device = device
            for name in ("padding", "row_budget"):
                if getattr(layer, name) is not None:
                    setattr(layer, name, getattr(layer, name).to(device))
            layer.policy_stats = {n: t.to(device) for n, t in layer.policy_stats.items()}
    elif layer.is_initialized:
        layer.keys, layer.values = layer.keys.to(device), layer.values.to(device)
    return layer


def _sliding_layer(layer: DynamicSlidingWindowLayer, entry, where: str, prefix: str, get, expected: Expected):
    checked.string(checked.entry(entry, "kind", where), f"{where}.kind", {"sliding"})
    window = checked.integer(checked.entry(entry, "sliding_window", where), f"{where}.sliding_window")
    if window != layer.sliding_window:
        raise ValueError(f"{where}.sliding_window={window}; the model's layer has a window of {layer.sliding_window}")
    if not checked.boolean(checked.entry(entry, "initialized", where), f"{where}.initialized"):
        checked.only_keys(entry, ("kind", "sliding_window", "initialized"), where)
        return layer
    checked.only_keys(entry, ("kind", "sliding_window", "initialized", "cumulative_length", "keys", "values"), where)
    seen = checked.integer(checked.entry(entry, "cumulative_length", where), f"{where}.cumulative_length")
    if seen != expected.seen:
        raise ValueError(f"{where}.cumulative_length={seen}; allowed: {expected.seen} (the tokens of the context)")
    shape = (None, expected.kv_heads, min(seen, window - 1), expected.head_dim)
    keys = checked.tensor(get(entry["keys"], f"{prefix}.keys"), f"{prefix}.keys", expected.dtype, shape, finite=True)
    values = checked.tensor(get(entry["values"], f"{prefix}.values"), f"{prefix}.values", expected.dtype,
                           tuple(keys.shape), finite=True)
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values, layer.cumulative_length = keys, values, seen
    return layer


_LAYER_KEYS = ("kind", "initialized", "dtype", "counters", "padding", "row_budget", "policy_stats", "segments")
_SEGMENT_KEYS = ("payload", "positions", "valid", "lengths", "state")


def _read_kvpress_layer(entry, where: str, prefix: str, get, expected: Expected) -> KVPressLayer:
    layer = KVPressLayer()
    checked.string(checked.entry(entry, "kind", where), f"{where}.kind", {"kvpress"})
    if not checked.boolean(checked.entry(entry, "initialized", where), f"{where}.initialized"):
        checked.only_keys(entry, ("kind", "initialized"), where)
        if expected.seen:
            raise ValueError(f"{where}.initialized=false; allowed: true (every layer has seen the context)")
        return layer
    checked.only_keys(entry, _LAYER_KEYS, where)
    dtype = str(expected.dtype).removeprefix("torch.")
    checked.string(checked.entry(entry, "dtype", where), f"{where}.dtype", {dtype})
    counters = _counters(checked.entry(entry, "counters", where), f"{where}.counters", expected.seen)
    specs = checked.array(checked.entry(entry, "segments", where), f"{where}.segments")
    if not specs:
        raise ValueError(f"{where}.segments: empty; allowed: at least the tail")
    segments = [_segment(spec, f"{where}.segments[{j}]", f"{prefix}.segments.{j}", get, expected)
                for j, spec in enumerate(specs)]
    batch = segments[-1].data_shape()[0] if not segments[-1].flat else segments[-1].lengths.shape[0]
    for j, segment in enumerate(segments):
        rows = segment.lengths.shape[0] if segment.flat else segment.data_shape()[0]
        if rows != batch:
            raise ValueError(f"{where}.segments[{j}]: {rows} rows; allowed: {batch}, as the layer's other segments")
        if segment.low_bit and any(not s.low_bit for s in segments[:j]):
            raise ValueError(f"{where}.segments[{j}]: low-bit codes after full-precision slots; allowed: codes first")
    if segments[-1].low_bit or not isinstance(segments[-1].data, FullPrecision):
        raise ValueError(f"{where}.segments[{len(segments) - 1}]: the tail is not full precision; allowed: "
                         f"full_precision")
    tail = segments[-1].data
    layer.lazy_initialization(tail.keys, tail.values)
    layer.segments = segments
    for name, value in counters.items():
        setattr(layer, name, value)
    for name in ("padding", "row_budget"):
        t = get(checked.entry(entry, name, where), f"{prefix}.{name}")
        if t is not None:
            checked.tensor(t, f"{prefix}.{name}", torch.int64, (batch,))
            checked.within(t, f"{prefix}.{name}", 0, expected.seen + 1)
        setattr(layer, name, t)
    stats = checked.entry(entry, "policy_stats", where)
    if not isinstance(stats, dict):
        raise ValueError(f"{where}.policy_stats: a {type(stats).__name__} where an object was expected")
    layer.policy_stats = {}
    for n, t in stats.items():
        stat = get(t, f"{prefix}.policy_stats.{n}")
        if stat.dim() < 1 or stat.shape[0] != batch:
            raise ValueError(f"{prefix}.policy_stats.{n}: shape {list(stat.shape)}; allowed: [{batch}, ...]")
        layer.policy_stats[n] = checked.tensor(stat, f"{prefix}.policy_stats.{n}", _STAT_DTYPES, finite=True)
    _check_slots(layer, where, expected)
    return layer


_STAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool)


def _counters(counters, where: str, seen_expected: int) -> dict:
    if not isinstance(counters, dict):
        raise ValueError(f"{where}: a {type(counters).__name__} where an object was expected")
    checked.only_keys(counters, _COUNTERS, where)
    seen = checked.integer(checked.entry(counters, "seen", where), f"{where}.seen")
    if seen != seen_expected:
        raise ValueError(f"{where}.seen={seen}; allowed: {seen_expected} (the tokens of the context)")
    out = dict(seen=seen, appended=checked.integer(checked.entry(counters, "appended", where), f"{where}.appended",
                                                  seen))
    for name in ("decode_start", "rollback_floor", "last_q_len"):
        out[name] = checked.integer(checked.entry(counters, name, where), f"{where}.{name}", 0, seen)
    for name in ("explicit_positions", "sorted"):
        out[name] = checked.boolean(checked.entry(counters, name, where), f"{where}.{name}")
    return out


def _segment(spec, where: str, prefix: str, get, expected: Expected) -> Segment:
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: a {type(spec).__name__} where an object was expected")
    checked.only_keys(spec, _SEGMENT_KEYS, where)
    payload = checked.entry(spec, "payload", where)
    kind = checked.string(checked.entry(payload, "kind", f"{where}.payload"), f"{where}.payload.kind", set(PAYLOADS))
    checked.only_keys(payload, ("kind", "scalars", "tensors"), f"{where}.payload")
    cls = PAYLOADS[kind]
    scalar_fields = _scalar_fields(cls)
    tensor_fields = {f.name for f in dataclasses.fields(cls) if f.name != "room"} - scalar_fields
    scalars, named = checked.entry(payload, "scalars", f"{where}.payload"), checked.entry(payload, "tensors",
                                                                                       f"{where}.payload")
    if not isinstance(scalars, dict) or not isinstance(named, dict):
        raise ValueError(f"{where}.payload: scalars and tensors must be objects")
    checked.only_keys(scalars, scalar_fields, f"{where}.payload.scalars")
    checked.only_keys(named, tensor_fields, f"{where}.payload.tensors")
    try:
        data = cls(**scalars, **{n: get(t, f"{prefix}.data.{n}") for n, t in named.items()})
    except TypeError as e:  # a required field missing
        raise ValueError(f"{where}.payload: {e}") from None
    lengths = get(checked.entry(spec, "lengths", where), f"{prefix}.lengths")
    if lengths is not None:
        checked.tensor(lengths, f"{prefix}.lengths", torch.int64, (None, expected.kv_heads))
        checked.within(lengths, f"{prefix}.lengths", 0, 2 ** 62)
    batch, heads = (1, 1) if lengths is not None else (None, expected.kv_heads)
    if batch is None:
        first = next((t for t in (getattr(data, f) for f in sorted(named)) if isinstance(t, torch.Tensor)), None)
        batch = first.shape[0] if first is not None and first.dim() else 0
    data.check(f"{prefix}.data", batch, heads, expected.head_dim, expected.dtype)
    slots = data.num_slots
    if lengths is not None and int(lengths.sum()) != slots:
        raise ValueError(f"{prefix}.lengths: runs of {int(lengths.sum())} slots in all; the store holds {slots}")
    positions = get(checked.entry(spec, "positions", where), f"{prefix}.positions")
    if positions is not None:
        checked.tensor(positions, f"{prefix}.positions", torch.int32, (batch, heads, slots))
    elif lengths is not None:
        raise ValueError(f"{where}.positions: null; allowed: a tensor (flat runs record every slot's position)")
    valid = get(checked.entry(spec, "valid", where), f"{prefix}.valid")
    if valid is not None:
        if lengths is not None:
            raise ValueError(f"{where}.valid: a tensor; allowed: null (flat runs hold real tokens only)")
        checked.tensor(valid, f"{prefix}.valid", torch.bool, (batch, heads, slots))
    state = checked.entry(spec, "state", where)
    if not isinstance(state, dict):
        raise ValueError(f"{where}.state: a {type(state).__name__} where an object was expected")
    state = {n: checked.tensor(get(t, f"{prefix}.state.{n}"), f"{prefix}.state.{n}", torch.float32,
                              (batch, heads, slots), finite=True) for n, t in state.items()}
    return Segment(data, positions, valid, state, lengths)


def _scalar_fields(cls) -> set[str]:
    """A payload's fields that are numbers (bits, group size), saved in the metadata rather than as tensors."""
    return {f.name for f in dataclasses.fields(cls) if f.type in ("int", "float", "bool", int, float, bool)}


def _check_slots(layer: KVPressLayer, where: str, expected: Expected) -> None:
    """Every real slot holds a token the layer has seen, each token at most once per head, in position order when
    the layer says it is sorted; implicit positions only where slot j is position j of every token seen."""
    positions, valid = layer.key_positions().long(), layer.key_valid()
    checked.within(positions, f"{where}: slot positions", 0, expected.seen, valid)
    if layer.padding is not None:
        checked.within(layer.padding, f"{where}: padding", 0, expected.seen + 1)
    filled = torch.where(valid, positions, expected.seen)
    ordered = filled.sort(-1).values
    if bool((valid.sum(-1) > 0).any()) and bool(((ordered[..., 1:] == ordered[..., :-1])
                                                  & (ordered[..., 1:] < expected.seen)).any()):
        raise ValueError(f"{where}: a head holds the same position twice; allowed: each token at most once")
    if layer.sorted:  # (position order holds within each segment: a mixed-width codec's widths interleave)
        for segment, offset in zip(layer.segments, layer.offsets()):
            mine, ok = positions[..., offset:offset + segment.width], valid[..., offset:offset + segment.width]
            running = torch.where(ok, mine, -1).cummax(-1).values
            before = torch.cat([running.new_full((*running.shape[:-1], 1), -1), running[..., :-1]], -1)
            if bool((ok & (mine <= before)).any()):
                raise ValueError(f"{where}.counters.sorted=true, but a head's slots are out of position order")
    if not layer.explicit_positions:
        implicit = all(not s.flat and s.positions is None for s in layer.segments)
        if not implicit or layer.view_width != expected.seen:
            raise ValueError(f"{where}.counters.explicit_positions=false, but its slots are not positions 0.."
                             f"{expected.seen - 1} in order; allowed: true")
