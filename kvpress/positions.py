"""Positions and RoPE, in one place: the rotary embedding of a layer at any positions, rotation and
un-rotation of queries/keys (half-split RoPE, as Llama-family models apply it, partial rotary included), and
re-rotation of stored post-RoPE keys by a position delta (cache-local positions).

The rotation is taken from the model's own rotary embedding module (its cos/sin at the positions asked), so
scaled variants (llama3, yarn, per-layer-type rope of hybrid models) are followed exactly. `Rotary` is built
once per attention module at patch time, only for policies that declare they need it.
"""

from __future__ import annotations

import importlib
import inspect

import torch
from transformers.models.auto.configuration_auto import model_type_to_module_name


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [B, H, n, D] with cos/sin [B, n, rot] (rot <= D: the leading dims rotate, the rest pass)."""
    rot = cos.shape[-1]
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    x_rot = x[..., :rot]
    out = x_rot * cos + rotate_half(x_rot) * sin
    return torch.cat([out, x[..., rot:]], -1) if rot < x.shape[-1] else out


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The pre-RoPE vector of a post-RoPE x [B, H, n, D] (fp32). cos/sin may carry the rotary's attention scaling
    s (cos = s cos(theta)): dividing by cos^2 + sin^2 = s^2 undoes it too."""
    rot = cos.shape[-1]
    cos, sin = cos[:, None].float(), sin[:, None].float()
    x = x.float()
    x_rot = x[..., :rot]
    out = (x_rot * cos - rotate_half(x_rot) * sin) / (cos * cos + sin * sin)
    return torch.cat([out, x[..., rot:]], -1) if rot < x.shape[-1] else out


def rotate_keys(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate post-RoPE keys [B, H, T, D] by `delta` [B, H, T] positions (half-split RoPE). Rotations compose
    additively, so this re-indexes a key from position p to p + delta. Partial rotary (inv_freq shorter than
    D/2) rotates only the leading dims."""
    rot = 2 * inv_freq.numel()
    angles = delta[..., None].float() * inv_freq.to(keys.device).float()  # [B, H, T, rot/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x = keys[..., :rot].float()
    out = (x * cos + rotate_half(x) * sin).to(keys.dtype)
    return torch.cat([out, keys[..., rot:]], -1) if rot < keys.shape[-1] else out


class Rotary:
    """The RoPE of one attention module: cos/sin at any positions, from the model's rotary embedding."""

    def __init__(self, embedding: torch.nn.Module, layer_type: str | None):
        self.embedding = embedding
        self.layer_type = layer_type
        self._takes_layer_type = "layer_type" in inspect.signature(embedding.forward).parameters

    @classmethod
    def of(cls, model, module) -> "Rotary":
        """The rotary of `module` in `model`; a clear error when the model has no single rotary embedding."""
        embeddings = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
        if len(embeddings) != 1:
            raise ValueError(f"model: {type(model).__name__} has {len(embeddings)} rotary embedding modules; "
                             f"policies that need RoPE (re-rotation, pre-RoPE queries) need exactly one")
        return cls(embeddings[0], getattr(module, "layer_type", None))

    @classmethod
    def from_config(cls, config, layer_type: str | None = None) -> "Rotary":
        """The RoPE that a transformers model built from `config` runs, without the model: for a serving engine,
        whose own rotary implementation kvpress does not read. transformers' rotary class of that architecture is
        built from the config, so the cos/sin are the ones the transformers path computes."""
        config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        name = config.model_type
        folder = model_type_to_module_name(name)  # e.g. gemma3_text -> gemma3
        try:
            module = importlib.import_module(f"transformers.models.{folder}.modeling_{folder}")
        except ImportError:
            module = None
        classes = [c for n, c in vars(module or object).items() if n.endswith("RotaryEmbedding") and isinstance(c, type)]
        if len(classes) != 1:
            raise ValueError(f"model_type={name!r}: transformers has {len(classes)} rotary embedding classes for it; "
                             f"policies that need RoPE (pre-RoPE queries, re-rotation) need exactly one")
        return cls(classes[0](config=config), layer_type)

    def cos_sin(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, n, rot] at RoPE positions [B, n] (fp32 for fp32 `like`, else its dtype)."""
        args = (like, positions)
        if self._takes_layer_type:
            return self.embedding(*args, layer_type=self.layer_type)
        return self.embedding(*args)

    def inv_freq(self) -> torch.Tensor:
        """The frequencies of standard RoPE (no attention scaling), for re-rotating stored keys by a delta."""
        inv_freq = getattr(self.embedding, "inv_freq", None)
        scaling = getattr(self.embedding, "attention_scaling", None)
        if self.layer_type is not None and hasattr(self.embedding, f"{self.layer_type}_inv_freq"):
            inv_freq = getattr(self.embedding, f"{self.layer_type}_inv_freq")
            scaling = getattr(self.embedding, f"{self.layer_type}_attention_scaling", scaling)
        if not isinstance(inv_freq, torch.Tensor) or scaling not in (None, 1.0):
            raise ValueError("re-rotating keys needs one standard rotary embedding (no attention scaling) in the "
                             "model")
        return inv_freq
