"""What a tensor-parallel layer asks of its group (`omnivox.parallel.group.TPGroup` is the one
implementation): a layer whose weights hold one rank's piece sums or gathers its output through
it. A layer's `tp` is None when it is whole."""
from __future__ import annotations

from typing import Protocol

import torch


class Collectives(Protocol):
    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks (x's shape, dtype and device); x may be overwritten."""

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x concatenated in rank order along `dim`."""
