"""Mixture-of-experts feed-forward: softmax router, top-k, optional renormalisation,
experts stored fused ([E, 2I, H] gate||up and [E, H, I] down, filled at load time)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnivox.layers.mlp import SwiGLU


class FusedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """x [N, H]; top_idx/top_w [N, k] -> [N, H]. Loops over the experts that were hit."""
        out = torch.zeros_like(x)
        flat = top_idx.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        k = top_idx.shape[1]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start:start + n]
            start += n
            tok, slot = sel // k, sel % k
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * top_w[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden: int, top_k: int, renormalize: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)
        top_w, top_idx = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_idx, top_w.to(x.dtype)


class SparseMoE(nn.Module):
    """Routed experts, plus (talker) a sigmoid-gated shared SwiGLU expert."""

    def __init__(self, hidden: int, num_experts: int, intermediate: int, top_k: int,
                 renormalize: bool, shared_intermediate: int = 0):
        super().__init__()
        self.gate = Router(num_experts, hidden, top_k, renormalize)
        self.experts = FusedExperts(num_experts, hidden, intermediate)
        if shared_intermediate:
            self.shared_expert = SwiGLU(hidden, shared_intermediate)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, H]
        top_idx, top_w = self.gate(flat)
        out = self.experts(flat, top_idx, top_w)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.reshape(shape)
