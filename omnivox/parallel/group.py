"""A tensor-parallel group: this process's rank among `size`, and the two collectives the sharded
layers call (a sum for row-parallel outputs, a gather for vocab-parallel logits).

NOTE: every rank must issue the same collectives in the same order; a rank that stops issuing them
blocks the others until `timeout_s` (then the collective raises on the waiting ranks).
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class TPGroup:
    rank: int
    size: int
    group: object = None  # a torch.distributed ProcessGroup (None: the default group)
    backend: str = "gloo"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks (x's shape, dtype and device). x itself may be overwritten: the
        callers pass a fresh partial product."""
        y = self._staged(x)
        dist.all_reduce(y, group=self.group)
        return y.to(x.device)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x concatenated in rank order along `dim`: [..., n, ...] -> [..., size * n, ...]."""
        y = self._staged(x)
        parts = [torch.empty_like(y) for _ in range(self.size)]
        dist.all_gather(parts, y, group=self.group)
        return torch.cat(parts, dim=dim).to(x.device)

    def _staged(self, x: torch.Tensor) -> torch.Tensor:
        """x as the backend takes it: contiguous, and on the host for gloo (a device tensor is copied)."""
        x = x.contiguous()
        return x.cpu() if self.backend == "gloo" and x.device.type != "cpu" else x

    def close(self) -> None:
        dist.destroy_process_group(self.group)


def init_group(rank: int, size: int, init_method: str, backend: str = "gloo", timeout_s: float = 60) -> TPGroup:
    """Join the default process group as `rank` of `size` (init_method e.g. "tcp://127.0.0.1:29500");
    gloo for CPU tensors (device tensors are staged through the host), nccl for CUDA ones (the caller
    selects this rank's CUDA device first)."""
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    return TPGroup(rank, size, None, backend)
