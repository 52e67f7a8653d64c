"""Rolling a KVPressLayer back (crop), exactly or not at all.

A layer changes in two ways: appending a forward's tokens, which a rollback undoes by cutting them off, and
everything else (an eviction, a low-bit flush, policy state of earlier slots), which it cannot: the evicted tokens,
the full-precision values and the old scores are gone. Every such change records the tokens seen at that moment
(`layer.rollback_floor`, set by `layer.mark_changed()`); a crop to fewer tokens than that is refused before
anything changes, so a crop either gives back the layer exactly as it was at that length, or raises.
`forget_newest` drops a forward's observation tokens wherever their slots are (not a rollback: seen steps back).
"""

from __future__ import annotations


def crop_refusal(layer, tokens_to_remove: int) -> str | None:
    """Why `layer.crop(tokens_to_remove)` cannot give back the layer as it was (None: it can)."""
    if tokens_to_remove == 0 or not layer.is_initialized:
        return None
    new_seen = layer.seen + tokens_to_remove if tokens_to_remove < 0 else tokens_to_remove
    if not 0 <= new_seen <= layer.seen:
        return f"crop(tokens_to_remove={tokens_to_remove}) is out of range for {layer.seen} seen tokens"
    if new_seen < layer.rollback_floor:
        back = layer.rollback_floor - layer.seen
        return (f"crop(tokens_to_remove={tokens_to_remove}): the layer changed its stored tokens after "
                f"{layer.rollback_floor} tokens (an eviction, a low-bit flush or a policy's per-slot state), which a "
                f"rollback cannot undo; allowed values: {back} <= tokens_to_remove <= 0 (back to "
                f"{layer.rollback_floor} tokens at most)")
    return None


def crop(layer, tokens_to_remove: int) -> None:
    """Forget the most recent tokens (see KVPressLayer.crop): ValueError, nothing changed, when it is not exact."""
    refusal = crop_refusal(layer, tokens_to_remove)
    if refusal is not None:
        raise ValueError(refusal)
    if tokens_to_remove == 0 or not layer.is_initialized:
        return
    new_seen = layer.seen + tokens_to_remove if tokens_to_remove < 0 else tokens_to_remove
    if new_seen == layer.seen:
        return
    # Nothing but appends since new_seen (else the floor would be past it), and appends go to the tail's end: the
    # rolled-back tokens are its last slots in every row and head (a left-padded row's padding included).
    n, tail = layer.seen - new_seen, layer.tail
    if tail.flat or tail.num_slots < n or not bool((layer.key_positions(layer.tail_start())[..., -n:] >= new_seen).all()):
        raise RuntimeError("crop: the tokens appended after the rollback floor are not the tail's last slots (a "
                           "change that did not call mark_changed); this is a kvpress bug")
    layer.segments[-1] = tail.truncate(tail.num_slots - n)
    for derived in layer.derived.values():
        derived.truncate(layer.view_width)
    if layer.padding is not None:  # padding precedes a row's tokens: what was rolled back of it is forgotten too
        layer.padding = layer.padding.clamp(max=new_seen)
    layer.seen = new_seen


def appends_before_flush(layer, residual: int, group: int) -> int:
    """Tokens `layer` can still append before a low-bit flush with these settings (KVPressLayer.flush_low_bit)
    would move any: the number of decode steps a speculation round may span without a flush inside it."""
    if not layer.is_initialized:
        return residual + group - 1
    if not layer.is_flat:  # a rectangle flushes once its full-precision slots reach residual + group
        return layer.quantized_len + residual + group - 1 - layer.view_width
    full_precision = sum(s.counts() for s in layer.segments if not s.low_bit)  # per head
    return int((residual + group - 1 - full_precision).min())


def forget_newest(layer, n: int) -> None:
    """Forget the `n` newest tokens seen, wherever their slots are (KVPressLayer.forget_newest)."""
    if n == 0 or not layer.is_initialized:
        return
    new_seen = layer.seen - n
    valid = layer.key_valid()
    kept = valid & (layer.key_positions() < new_seen)
    if bool((kept != valid).any()):
        width = int(kept.sum(-1).max())
        order = (~kept).long().argsort(dim=-1, stable=True)[..., :width]  # the other slots, in slot order
        layer.compact(order, kept.gather(-1, order))
    layer.seen = new_seen
    layer.decode_start = min(layer.decode_start, new_seen)
    layer.rollback_floor = min(layer.rollback_floor, new_seen)  # observers' evictions count as the chunk's
