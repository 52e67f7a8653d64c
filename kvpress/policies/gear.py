from dataclasses import dataclass

from ..cache.codecs import encode_gear
from .kivi import KIVI
from .registry import register


@register
@dataclass
class GEAR(KIVI):
    """GEAR (Kang et al. 2024) storage: KIVI-style quantization of X - S, where S holds outliers kept exactly
    (per key channel and per value row: the outlier_ratio/2 largest and smallest entries, counts floored as
    in the reference), plus a rank-`rank` approximation (power iteration, `power_iters` steps, fp32) of the
    remaining error, computed for each group of slots as it is quantized. Reconstruction: deq(Q) + low-rank,
    outliers restored exactly. Key outliers are stored as sparse (slot, channel, value) entries that follow
    their token when an eviction policy drops slots. Defaults from the GEAR scripts: 2-bit, group 64, 2%
    outliers, 3 power iterations; rank 2 (their decode rank; their prefill rank is 4)."""

    name = "gear"
    bits: int = 2
    group_size: int = 64
    residual_length: int = 64
    rank: int = 2
    outlier_ratio: float = 0.02
    power_iters: int = 3

    def validate(self) -> None:
        super().validate()
        if not 1 <= self.rank <= self.group_size:
            # each group of group_size slots is approximated at this rank: a larger one cannot be, and flushes of
            # different sizes would then store factors of different widths
            raise ValueError(f"gear: rank={self.rank!r}; allowed values: an int in [1, group_size={self.group_size}]")
        if not 0.0 <= self.outlier_ratio < 0.5:
            raise ValueError(f"gear: outlier_ratio={self.outlier_ratio!r}; allowed values: a float in [0, 0.5)")
        if self.power_iters < 1:
            raise ValueError(f"gear: power_iters={self.power_iters!r}; allowed values: an int >= 1")

    def encode(self, keys, values, valid, positions):  # (positions: unused, keys are stored post-RoPE)
        return encode_gear(keys, values, valid, self.bits, self.group_size, self.rank, self.outlier_ratio,
                           self.power_iters)
