from dataclasses import dataclass

import torch

from .context import Context
from .scorer import ScorerPolicy
from .registry import register

# Significant bits a key norm is compared at: 1.5e-5 relative, about 250 times fp32's rounding and far below the
# spread of distinct keys' norms.
NORM_BITS = 16


@register
@dataclass
class Knorm(ScorerPolicy):
    """Keeps the keys of smallest L2 norm (low-norm keys draw the most attention), at prefill."""

    name = "knorm"

    def query_rows(self) -> int:
        return 0  # keys alone

    def score(self, ctx: Context):
        # The rotary embedding does not change a key's norm, so a token repeated in the prompt has keys of equal
        # norm at every position (layer 0 exactly). Computed from rotated keys those norms differ in the last bits,
        # and how depends on the CPU's vector width: rounded to NORM_BITS they tie exactly, and the generic
        # selection gives a tie to the earlier slot on every machine.
        mantissa, exponent = torch.frexp(ctx.keys.float().norm(dim=-1))
        return -torch.ldexp(torch.round(mantissa * 2**NORM_BITS) / 2**NORM_BITS, exponent)
