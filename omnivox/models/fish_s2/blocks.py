"""The Fish decoder block shared by the slow and fast AR, and the interleaved bf16 RoPE.

RoPE convention (spec 7.2): pairs (x[2j], x[2j+1]) rotate by p * base^(-2j/head_dim); the
cos/sin tables are computed in fp32 and rounded to bf16 (as S2 was trained), then the rotation
runs in fp32 (fp64 when the activations are fp64, so float64 invariant tests stay exact).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnivox.layers.attention import causal_attention
from omnivox.layers.norm import RMSNorm


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for low-precision activations, the activation dtype itself for fp32/fp64."""
    return torch.promote_types(dtype, torch.float32)


class FishRMSNorm(RMSNorm):
    """Normalise in fp32 (fp64 stays fp64), cast back, then scale by the weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(compute_dtype(x.dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_freqs(head_dim: int, base: float, device=None) -> torch.Tensor:
    """[head_dim/2] fp32 base^(-2j/head_dim)."""
    j = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)[: head_dim // 2]
    return 1.0 / (base ** (j / head_dim))


def rope_tables(positions: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [..., S] -> bf16-rounded (cos, sin) [..., S, head_dim/2], returned as bf16."""
    angles = positions.to(torch.float32)[..., None] * freqs.to(positions.device)  # [..., S, D/2]
    return angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair rotation. x [B, H, S, D]; cos/sin [B, S, D/2] (or [S, D/2])."""
    cd = compute_dtype(x.dtype)
    xp = x.to(cd).unflatten(-1, (-1, 2))  # [B, H, S, D/2, 2]
    c, s = cos.to(cd).unsqueeze(-3), sin.to(cd).unsqueeze(-3)  # broadcast over heads
    x0, x1 = xp[..., 0], xp[..., 1]
    out = torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1)
    return out.flatten(-2).to(x.dtype)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Attention(nn.Module):
    """Fused q||k||v projection, optional per-head QK RMSNorm before RoPE, GQA (head i -> kv i // g)."""

    def __init__(self, dim: int, n_head: int, n_kv: int, head_dim: int, qk_norm: bool, eps: float):
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = n_head, n_kv, head_dim
        self.wqkv = nn.Linear(dim, (n_head + 2 * n_kv) * head_dim, bias=False)
        self.wo = nn.Linear(n_head * head_dim, dim, bias=False)
        if qk_norm:
            self.q_norm = FishRMSNorm(head_dim, eps)
            self.k_norm = FishRMSNorm(head_dim, eps)
        self.qk_norm = qk_norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, layer: int) -> torch.Tensor:
        """x [B, S, dim] -> [B, S, dim]; `cache.attend(layer, q, k, v)` owns storage and masking."""
        b, s, _ = x.shape
        hd = self.head_dim
        q, k, v = self.wqkv(x).split((self.n_head * hd, self.n_kv * hd, self.n_kv * hd), dim=-1)
        q, k, v = q.view(b, s, -1, hd), k.view(b, s, -1, hd), v.view(b, s, -1, hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, S, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = causal_attention(q, k, v) if cache is None else cache.attend(layer, q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    """Pre-norm decoder block: x += attn(norm(x)); x += ffn(norm(x))."""

    def __init__(self, dim: int, n_head: int, n_kv: int, head_dim: int, hidden: int, qk_norm: bool, eps: float):
        super().__init__()
        self.attention = Attention(dim, n_head, n_kv, head_dim, qk_norm, eps)
        self.feed_forward = FeedForward(dim, hidden)
        self.attention_norm = FishRMSNorm(dim, eps)
        self.ffn_norm = FishRMSNorm(dim, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, layer: int) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, cache, layer)
        return x + self.feed_forward(self.ffn_norm(x))
