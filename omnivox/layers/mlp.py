import torch
import torch.nn.functional as F
from torch import nn

from omnivox.layers.merged import MergedLinear, keep_checkpoint_names


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); checkpoint names gate_proj / up_proj / down_proj, with
    gate and up loaded into one `gate_up_proj` (one matmul)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, {"gate_proj": intermediate, "up_proj": intermediate})
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        keep_checkpoint_names(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
