"""KVPressCache: a transformers Cache whose full-attention layers really shrink."""

from __future__ import annotations

import copy

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from . import room as rooms
from .forward import ForwardState
from .held import storage_nbytes
from .layer import KVPressLayer
from .overwrite import overwrite
from .rollback import crop_refusal
from .rows import stack_rows


def _layer_types(config) -> list[str] | None:
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return getattr(text_config, "layer_types", None)


def layout(config, n_layers: int | None = None) -> tuple:
    """(each layer's kind, the sliding window of the sliding ones or None) of a model's config; a config without
    layer kinds has `n_layers` full-attention layers."""
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kinds = tuple(getattr(text_config, "layer_types", None) or ["full_attention"] * (n_layers or 0))
    return kinds, text_config.sliding_window if "sliding_attention" in kinds else None


class KVPressCache(Cache):
    """A `Cache` of `KVPressLayer`s.

    With a `config`, sliding-window layers of hybrid models (e.g. Gemma-3) get transformers' own sliding
    layer and keep their stock behaviour; every full-attention layer is a `KVPressLayer`. Without a config,
    layers are created lazily as `KVPressLayer`s.

    The cache itself holds no policy: the attention function of a patched model reads and compacts it.
    """

    def __init__(self, config=None, question_ids: torch.Tensor | None = None, capture_reserve: int | None = None):
        if capture_reserve is not None and (isinstance(capture_reserve, bool) or not isinstance(capture_reserve, int)
                                            or capture_reserve < 1):
            raise ValueError(f"capture_reserve={capture_reserve!r}; allowed values: None, or an int >= 1 (slots each "
                             f"layer reserves ahead so that decode steps keep their shapes)")
        if config is not None and not isinstance(config, PretrainedConfig):
            raise ValueError(f"config={config!r}; allowed values: None, or the model's config (model.config, a "
                             f"transformers PretrainedConfig)")
        if question_ids is not None and (not isinstance(question_ids, torch.Tensor) or question_ids.dim() != 2
                                         or question_ids.shape[1] < 1 or question_ids.is_floating_point()):
            raise ValueError(f"question_ids={question_ids!r}; allowed values: None or token ids [batch or 1, n >= 1]")
        longest = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None) if config else None
        if capture_reserve is not None and capture_reserve > (longest or 1 << 20):
            raise ValueError(f"capture_reserve={capture_reserve}: more slots than the model reads "
                             f"({'max_position_embeddings=' + str(longest) if longest else 'at most 2**20 without a config'}"
                             f"), each reserved in every layer; allowed values: None, or 1 to {longest or 1 << 20}")
        layer_types = _layer_types(config) if config is not None else None
        if capture_reserve is not None and layer_types is not None and "sliding_attention" in layer_types:
            raise ValueError(f"capture_reserve={capture_reserve}: this model's sliding-window layers are transformers' "
                             f"own (DynamicSlidingWindowLayer), whose decode steps change shape every step; allowed "
                             f"values: None for a model with sliding-window layers")
        # the layers this cache was built for (None: any, created as they come): a patched model whose own differ
        # refuses it (a Gemma-3 cache on a Llama made its layer 0 a sliding window)
        self.layer_kinds = layout(config) if layer_types is not None else None
        if layer_types is None:
            super().__init__(layer_class_to_replicate=KVPressLayer)
        else:
            text_config = config.get_text_config(decoder=True)
            layers = [
                DynamicSlidingWindowLayer(sliding_window=text_config.sliding_window)
                if kind == "sliding_attention"
                else KVPressLayer()
                for kind in layer_types
            ]
            super().__init__(layers=layers)
        # what the patched model tells the cache about the forward running on it (set by kvpress/integrations/)
        self.forward_state = ForwardState()
        # A read policy whose selection every kvpress layer reads instead of all its slots (the draft view
        # of self-speculative decoding); None: read everything.
        self.read_policy = None
        # A question known while a long prompt is prefilled in chunks (token ids [B or 1, n]): each chunk is judged
        # with it appended as observation queries, then they are forgotten (integrations/chunked.py)
        self.question_ids = question_ids
        self.prefill_nbytes: int | None = None  # bytes held right after the prompt (recorded by the patch)
        self.prefill_kv_nbytes: int | None = None
        self.patched_forwards = 0  # forwards of a kvpress-patched model running on this cache (set by the patch)
        # why this cache can no longer be run (a forward raised after some layers appended its tokens); None: it can
        self.broken: str | None = None
        # slots each kvpress layer reserves ahead of its decode steps, so that a step keeps its shapes and a
        # torch.compile'd (CUDA-graph) decode step replays until the reserve is used up (room.py); None: no reserve
        self.capture_reserve = capture_reserve

    def prepare_step(self, q_len: int) -> None:
        """Before a decode (or extend) forward of q_len tokens: every kvpress layer's room (room.py)."""
        masked = self.forward_state.token_mask is not None
        for _, layer in self.kvpress_layers():
            if layer.is_initialized:
                rooms.prepare(layer, q_len, self.capture_reserve, masked)

    def settle_step(self) -> list[KVPressLayer]:
        """After it: the host's count of what a captured step appended. Returns the layers a traced step appended
        to (their policy's storage work is still to run)."""
        traced = []
        for _, layer in self.kvpress_layers():
            if layer.room is not None and layer.room.ready and layer.room.pending:
                traced.append(layer)
            rooms.settle(layer)
        return traced

    def set_attention_mask(self, attention_mask: torch.Tensor | None) -> None:
        """Record the 2-D padding mask [B, seen + q_len] of the forward about to run (set by the patch's
        model pre-hook), so each layer learns which new tokens are padding."""
        if attention_mask is not None and attention_mask.dim() != 2:
            attention_mask = None  # a custom 4-D mask carries no per-token padding we can read
        self.forward_state.token_mask = attention_mask

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        # Stored without autograd history: a prompt run with gradients on (the compress-once recipe without
        # torch.no_grad) would otherwise keep the forward's whole graph alive as long as the cache lives
        key_states, value_states = key_states.detach(), value_states.detach()
        if self.layer_class_to_replicate is not None:
            while len(self.layers) <= layer_idx:
                self.layers.append(self.layer_class_to_replicate())
        layer = self.layers[layer_idx]
        if isinstance(layer, KVPressLayer) and self.forward_state.recompute is not None:
            overwrite(layer, self.forward_state.recompute, key_states, value_states)  # (nothing is appended)
            return key_states, value_states
        if isinstance(layer, KVPressLayer):
            if not self.patched_forwards and not layer.stock_readable:
                # the model's own attention would read these slots as positions 0..n-1 of plain keys: wrong tokens
                raise RuntimeError(
                    f"KVPressCache layer {layer_idx} holds compressed slots (evicted or low-bit), but the model running "
                    f"it is not patched by kvpress (never patched, or unpatched since); run it under "
                    f"kvpress.patch_model(...)")
            q_len = key_states.shape[-2]
            new_valid = None
            token_mask = self.forward_state.token_mask
            if token_mask is not None and token_mask.shape[-1] >= q_len:
                new_valid = token_mask[:, -q_len:]
            return layer.update(key_states, value_states, new_valid=new_valid)
        return layer.update(key_states, value_states, *args, **kwargs)

    def append_marks(self) -> tuple:
        """Counters that move whenever a layer appends: equal before and after a forward that appended nothing."""
        return (len(self.layers), *(layer.appended if isinstance(layer, KVPressLayer) else layer.get_seq_length()
                                    for layer in self.layers))

    def clear(self) -> None:
        """Empty every layer (same kinds, nothing stored, nothing seen), as a new cache of the same config."""
        if self.layer_class_to_replicate is not None:
            self.layers = []
        else:
            self.layers = [KVPressLayer() if isinstance(layer, KVPressLayer) else _empty_like(layer)
                           for layer in self.layers]
        self.forward_state = ForwardState()
        self.prefill_nbytes = self.prefill_kv_nbytes = None
        self.broken = None

    def crop(self, tokens_to_remove: int) -> None:
        """Roll every layer back (KVPressLayer.crop), or none: a layer that cannot do it exactly refuses before any
        layer changes."""
        for i, layer in self.kvpress_layers():
            refusal = crop_refusal(layer, tokens_to_remove)
            if refusal is not None:
                raise ValueError(f"layer {i}: {refusal}")
        super().crop(tokens_to_remove)

    # ------------------------------------------------------------------ observation tokens
    def observe_next(self, n: int) -> None:
        """The next forward's last `n` tokens are observation queries: policies keep them through their eviction
        (chunk_share), and forget_observers() drops them after the forward. Stock sliding layers record their past
        meanwhile, so they can give those tokens back."""
        state = self.forward_state
        state.observers = n
        state.recording = [layer for layer in self.layers
                           if isinstance(layer, DynamicSlidingWindowLayer) and not layer.record_past]
        for layer in state.recording:
            layer.record_past = True

    def forget_observers(self) -> None:
        """Drop the observation tokens of the forward that just ran from every layer (seen steps back)."""
        state = self.forward_state
        n, state.observers = state.observers, 0
        for layer in self.layers:
            if isinstance(layer, KVPressLayer):
                layer.forget_newest(n)
            elif getattr(layer, "is_initialized", False):
                layer.crop(-n)
        for layer in state.recording:  # only the layers observe_next switched on (speculation may hold others)
            layer.record_past = False
        state.recording = []
        if state.token_mask is not None:
            state.token_mask = state.token_mask[:, :-n]

    # ------------------------------------------------------------------ copies and rows
    def share_context(self) -> None:
        """Make what every kvpress layer holds a context its rows share (prefix.py): batch_repeat_interleave then
        repeats only the rows' own slots, and reads compute the context's attention once for all rows (Hydragen).
        Stock sliding-window layers hold a window, not a context: they are repeated as usual."""
        if self.forward_state.observers or self.capture_reserve is not None:
            raise ValueError("cache: a cache with a capture reserve, or a forward running on it, cannot share its "
                             "context; allowed: a cache that holds a context and runs nothing (kvpress.compress's)")
        for _, layer in self.kvpress_layers():
            if layer.is_initialized and not (layer.prefix is not None and layer.view_width == 0):
                layer.share_prefix()  # (a layer that already holds only its shared context stays as it is)

    def fork(self) -> "KVPressCache":
        """A copy that shares every stored tensor, in O(layers): later updates of either copy never show in the
        other. Compress a context once, then answer several questions on forks of it."""
        out = copy.copy(self)
        out.layers = [layer.fork() if isinstance(layer, KVPressLayer) else copy.copy(layer) for layer in self.layers]
        out.forward_state = ForwardState()  # no forward runs on the copy yet
        out.read_policy = None
        out.patched_forwards = 0
        return out

    def checkpoint(self, room: int = 0) -> list:
        """Every layer's state, to put back with restore (in place: the layer objects stay the same), after
        reserving `room` slots in kvpress layers so that many appended tokens are written in place (no copy of
        the cache). Tensors are shared, not copied: stock layers replace theirs on update."""
        out = []
        for layer in self.layers:
            if isinstance(layer, KVPressLayer):
                layer.reserve(room)
                out.append(layer.checkpoint())
            else:
                out.append(dict(layer.__dict__))
        return out

    def restore(self, checkpoint: list) -> None:
        """Put every layer back as `checkpoint` (from checkpoint()) holds it, in place."""
        for layer, state in zip(self.layers, checkpoint):
            if isinstance(layer, KVPressLayer):
                layer.restore(state)
            else:
                layer.__dict__.clear()
                layer.__dict__.update(state)

    @classmethod
    def stack(cls, caches: list["KVPressCache"]) -> "KVPressCache":
        """One batch whose rows are single-row caches that have seen the same tokens (see rows.stack_rows);
        layers that kvpress does not compress (sliding windows) are identical across rows and repeated."""
        out = caches[0].fork()
        for i, layer in enumerate(out.layers):
            if isinstance(layer, KVPressLayer):
                out.layers[i] = stack_rows([c.layers[i] for c in caches])
            elif getattr(layer, "is_initialized", False):
                layer.batch_repeat_interleave(len(caches))
        return out

    # ------------------------------------------------------------------ reporting
    def kvpress_layers(self) -> list[tuple[int, KVPressLayer]]:
        return [(i, layer) for i, layer in enumerate(self.layers) if isinstance(layer, KVPressLayer)]

    def nbytes(self) -> int:
        """Bytes of the distinct allocations behind everything each layer holds (kvpress layers: storage, positions,
        validity, policy and read-side state, a capture room; stock layers: their keys and values, whole buffers)."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, KVPressLayer):
                total += layer.nbytes()
            elif getattr(layer, "is_initialized", False):
                total += storage_nbytes((layer.keys, layer.values))
        return total

    def trim_stock_layers(self) -> None:
        """Give back what transformers' sliding-window layers keep past their window: after a prompt each keeps a
        view of the whole prompt's keys and values (its window's slots of their concatenation), which holds the
        whole allocation until its next update. Their window, copied, is all they read."""
        for layer in self.layers:
            if isinstance(layer, DynamicSlidingWindowLayer) and layer.is_initialized:
                for name in ("keys", "values"):
                    t = getattr(layer, name)
                    if t.untyped_storage().nbytes() > t.numel() * t.element_size():
                        setattr(layer, name, t.clone())

    def shared_nbytes(self) -> int:
        """Bytes of model-level tables the cache's storage reads but does not own (CommVQ's codebooks and what is
        derived from them), counted once: every cache of the model shares them, so they are not in nbytes()."""
        return storage_nbytes([t for _, layer in self.kvpress_layers() for t in layer.shared_tensors()])

    def offloaded_nbytes(self) -> int:
        """Bytes of storage kept outside memory, not in nbytes(): ShadowKV's values in their file tier."""
        return sum(s.data.offloaded_nbytes() for _, layer in self.kvpress_layers() if layer.is_initialized
                   for s in layer.segments)

    def stats(self) -> list[dict]:
        """Per layer: tokens seen, slots stored, real tokens kept per KV head (min/max), bytes (a capture reserve's
        included: `reserved_slots` of its room are not used yet)."""
        rows = []
        for i, layer in enumerate(self.layers):
            if isinstance(layer, KVPressLayer):
                if not layer.is_initialized:
                    continue
                kept, prefix = layer.tokens_per_head(), layer.prefix
                shared = 0 if prefix is None else prefix.width
                if prefix is not None:  # the shared context's tokens count in every row
                    kept = kept + prefix.tokens_per_head()
                rows.append(
                    dict(layer=i, kind="kvpress", seen=layer.seen, stored=layer.view_width + shared,
                         kept_min=int(kept.min()), kept_max=int(kept.max()),
                         kv_bytes=layer.kv_nbytes() + (0 if prefix is None else prefix.kv_nbytes()),
                         bytes=layer.nbytes(),
                         reserved_slots=0 if layer.room is None else layer.room.capacity - layer.room.filled,
                         shared_slots=shared, copied_on_write=layer.copied_on_write)
                )
            elif getattr(layer, "is_initialized", False):
                kv = sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
                stored = layer.keys.shape[-2]
                rows.append(
                    dict(layer=i, kind=type(layer).__name__, seen=layer.get_seq_length(), stored=stored,
                         kept_min=stored, kept_max=stored, kv_bytes=kv, bytes=kv)
                )
        return rows

    def fork_with(self, layers: dict[int, KVPressLayer]) -> "KVPressCache":
        """A fork of this cache (see fork) whose layers at the given indices are `layers`: a cache for layers
        compressed apart from it (evals: one prefill, then each config's own compressed copy of every layer)."""
        out = self.fork()
        out.layers = [layers.get(i, layer) for i, layer in enumerate(out.layers)]
        return out


def _empty_like(layer: DynamicSlidingWindowLayer) -> DynamicSlidingWindowLayer:
    """An empty stock sliding-window layer like `layer` (its window, and whether it records its past)."""
    out = DynamicSlidingWindowLayer(sliding_window=layer.sliding_window)
    out.record_past = getattr(layer, "record_past", False)
    return out
