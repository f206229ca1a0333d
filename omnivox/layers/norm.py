import torch
import torch.nn.functional as F
from torch import nn

from omnivox.layers.merged import row_parts


class RMSNorm(nn.Module):
    """RMSNorm with the reference's fp32 island: normalise in fp32 (even for fp64 inputs),
    cast back to the input dtype, and only then scale by `weight`.

    With `heads` (e.g. {"q_norm": H, "k_norm": Hkv}) one call normalises several per-head
    norms at once: x [..., sum(heads), dim], weight [sum(heads), dim] whose rows are filled
    from each checkpoint weight [dim] (see `omnivox.layers.merged`).
    """

    def __init__(self, dim: int, eps: float = 1e-6, heads: dict[str, int] | None = None):
        super().__init__()
        rows = () if heads is None else (sum(heads.values()),)
        self.weight = nn.Parameter(torch.ones(*rows, dim))
        self.eps = eps
        if heads is not None:
            self.parts = row_parts(heads, (dim,), broadcast=True)

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: F.rms_norm without a weight is h * rsqrt(mean(h^2) + eps) op for op on CPU (bit
        # for bit the reference); on CUDA it is one fused kernel. The weight comes after the cast.
        h = F.rms_norm(x.to(self.compute_dtype(x.dtype)), x.shape[-1:], eps=self.eps)
        return self.weight * h.to(x.dtype)
