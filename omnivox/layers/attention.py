"""Decoder self-attention (q/k norm, RoPE, GQA) over an explicit KV cache.

The cache is a seam with one method, `attend(layer, q, k, v)`: `DenseKVCache` keeps one
contiguous tensor per layer (offline generation, the code predictor); the engine's
`PagedBatch` writes into a pool of pages and attends per sequence of a flattened batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from omnivox.layers.norm import RMSNorm
from omnivox.layers.rotary import apply_rotary


@dataclass
class DenseKVCache:
    """Per-layer K/V of shape [B, kv_heads, T, head_dim], grown by concatenation."""

    keys: list[torch.Tensor | None] = field(default_factory=list)
    values: list[torch.Tensor | None] = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if not self.keys or self.keys[0] is None else self.keys[0].shape[2]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append this step's k/v [B, Hkv, S, D] and attend causally over everything cached."""
        k, v = self.update(layer, k, v)
        return causal_attention(q, k, v)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self.keys) <= layer:
            self.keys.append(None)
            self.values.append(None)
        if self.keys[layer] is not None:
            k = torch.cat((self.keys[layer], k), dim=2)
            v = torch.cat((self.values[layer], v), dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [B, H, S, D] attends causally to k/v [B, Hkv, P+S, D] whose last S rows are q's own."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    s, total = q.shape[2], k.shape[2]
    if s == 1:
        return F.scaled_dot_product_attention(q, k, v)
    if s == total:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = torch.ones(s, total, dtype=torch.bool, device=q.device).tril(total - s)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class DecoderAttention(nn.Module):
    """q/k/v/o projections without bias, per-head RMSNorm on q and k before RoPE."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache, layer: int) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.heads, self.head_dim)).transpose(1, 2)  # [B, H, S, D]
        k = self.k_norm(self.k_proj(x).view(b, s, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # [B, H, S, D]; the cache (dense or the engine's pages) owns storage and masking
        out = causal_attention(q, k, v) if cache is None else cache.attend(layer, q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
