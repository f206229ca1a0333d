import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm with the reference's fp32 island: normalise in fp32 (even for fp64 inputs),
    cast back to the input dtype, and only then scale by `weight`."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)
