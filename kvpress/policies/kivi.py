from dataclasses import dataclass
from typing import ClassVar

from ..cache.codecs import encode_kivi
from ..cache.rollback import appends_before_flush
from .context import Context
from .roles import Codec
from .registry import register


@register
@dataclass
class KIVI(Codec):
    """KIVI (Liu et al. 2024) storage: asymmetric `bits`-bit codes, keys per channel over groups of
    `group_size` slots, values per token over groups of `group_size` channels, fp16 scale/min per group.
    The newest `residual_length` tokens (at least) stay in full precision; once `group_size` more have
    accumulated, the oldest group is quantized. Prefill attention is exact; quantization happens after it.
    Composes with an eviction policy: "snapkv+kivi" evicts first, then stores the kept tokens low-bit.
    (KIVI flushes keys in residual-sized blocks and slides values one token at a time; here keys and values
    share one boundary and flush a group at a time, so both keep >= residual_length recent tokens exact.)"""

    name = "kivi"
    allowed_bits: ClassVar[tuple] = (2, 4, 8)
    bits: int = 2
    group_size: int = 32
    residual_length: int = 128

    def validate(self) -> None:
        if self.bits not in self.allowed_bits:
            raise ValueError(f"{self.name}: bits={self.bits!r}; allowed values: {list(self.allowed_bits)}")
        if self.group_size < 1:
            raise ValueError(f"{self.name}: group_size={self.group_size!r}; allowed values: an int >= 1")
        if self.residual_length < 0:
            raise ValueError(f"{self.name}: residual_length={self.residual_length!r}; allowed values: an int >= 0")

    @property
    def upper_bits_draftable(self) -> bool:
        return self.bits == 8  # its codes' upper 4 bits are a 4-bit code of the same group (QuantSpec)

    def for_model(self, model):
        check_layout(self.name, model.head_dim, self.group_size, self.bits)
        return self

    def appends_before_change(self, layer) -> int:
        return appends_before_flush(layer, self.residual_length, self.group_size)

    def encode(self, keys, values, valid, positions):  # (positions: unused, keys are stored post-RoPE)
        return encode_kivi(keys, values, valid, self.bits, self.group_size)

    def store(self, layer, layer_idx: int) -> None:
        """Move what the residual window no longer covers into low-bit codes."""
        layer.flush_low_bit(self.residual_length, self.group_size, self.encode)

    def on_prefill(self, ctx: Context) -> None:
        self.store(ctx.layer, ctx.layer_idx)

    def on_decode(self, ctx: Context) -> None:
        self.store(ctx.layer, ctx.layer_idx)

    def on_extend(self, ctx: Context) -> None:
        self.store(ctx.layer, ctx.layer_idx)  # only tokens older than the residual window are ever quantized


def check_layout(name: str, head_dim: int, group_size: int, bits: int) -> None:
    """Raise ValueError unless KIVI's layout fits the model's heads: values are quantized in groups of
    `group_size` channels, and a row of `bits`-bit codes fills whole bytes."""
    if head_dim % group_size or (head_dim * bits) % 8:
        divisors = [g for g in (8, 16, 32, 64, 128) if head_dim % g == 0]
        raise ValueError(
            f"{name}: group_size={group_size} does not divide the model's head_dim={head_dim} "
            f"(values are quantized in groups of channels); allowed values: {divisors}"
        )
