from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from omnivox.layers.collectives import Collectives
from omnivox.layers.merged import MergedLinear, keep_checkpoint_names



class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); checkpoint names gate_proj / up_proj / down_proj, with
    gate and up loaded into one `gate_up_proj` (one matmul).

    Tensor parallel (`parallel/shard.py`): a rank holds I/N rows of gate and of up and the
    matching I/N columns of down, so its output is a partial sum; `tp` adds the ranks' partials.
    NOTE: a sharded shared expert keeps `tp` None: its MoE sums it with the routed experts, once.
    """

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, {"gate_proj": intermediate, "up_proj": intermediate})
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        keep_checkpoint_names(self)
        self.tp: Collectives | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        out = self.down_proj(F.silu(gate) * up)
        return out if self.tp is None else self.tp.all_reduce(out)
