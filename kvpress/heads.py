"""Heads held by this process. Under transformers' tensor parallelism (`from_pretrained(..., tp_plan="auto")`
under torchrun) every rank's attention modules hold a contiguous block of the query and KV heads, and each rank's
cache layers hold only those heads. Most policies decide per KV head and need nothing from other ranks. A policy
that decides from several heads at once (TOVA's mean over every query head, AdaKV's one top-k over a layer's
heads, KVzip's one top-k over the model) declares it (Needs.all_heads) and gets the other ranks' evidence through
`HeadShards`, with the smallest collective that makes the decision exact. On one process every method is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

COLLECTIVES = {"all_reduce": 0, "all_gather": 0}  # calls made (tests count them)


@dataclass(frozen=True)
class HeadShards:
    """This process's block of a layer's heads: block `rank` of `count` equal blocks (count 1: every head)."""

    rank: int = 0
    count: int = 1

    @classmethod
    def of(cls, local_heads: int, total_heads: int) -> "HeadShards":
        """From the heads a module or layer holds here and the model's head count."""
        if local_heads == total_heads:
            return SINGLE
        import torch.distributed as dist

        count = total_heads // local_heads
        if count * local_heads != total_heads or not dist.is_initialized() or dist.get_world_size() != count:
            raise RuntimeError(f"this process holds {local_heads} of {total_heads} heads, but no process group "
                               f"splits them evenly (world size {dist.get_world_size() if dist.is_initialized() else 1})"
                               f"; kvpress supports tensor parallelism over one group of ranks that split the heads")
        return cls(dist.get_rank(), count)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over every rank (x already summed over this rank's heads): one all-reduce of x's bytes."""
        if self.count == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous().clone()
        dist.all_reduce(x)
        COLLECTIVES["all_reduce"] += 1
        return x

    def gather(self, x: torch.Tensor | None, dim: int = 1) -> torch.Tensor | None:
        """Every rank's block of x, concatenated along the heads dimension `dim`: one all-gather."""
        if self.count == 1 or x is None:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.count)]
        dist.all_gather(parts, x.contiguous())
        COLLECTIVES["all_gather"] += 1
        return torch.cat(parts, dim)

    @classmethod
    def block_of(cls, x: torch.Tensor, local_heads: int) -> torch.Tensor:
        """This process's block of per-head values x [H] over the model's H heads, for a layer holding
        `local_heads` of them (a calibration's per-head flags, under tensor parallelism)."""
        return cls.of(local_heads, x.shape[0]).local(x, 0)

    def local(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's block of a tensor over every head."""
        if self.count == 1:
            return x
        size = x.shape[dim] // self.count
        return x.narrow(dim, self.rank * size, size)


SINGLE = HeadShards()
