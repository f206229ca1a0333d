"""The Fish decoder block shared by the slow and fast AR, and the interleaved bf16 RoPE.

RoPE convention (spec 7.2): pairs (x[2j], x[2j+1]) rotate by p * base^(-2j/head_dim); the
cos/sin tables are computed in fp32 and rounded to bf16 (as S2 was trained), then the rotation
runs in fp32 (fp64 when the activations are fp64, so float64 invariant tests stay exact). A stack
builds the tables once per forward (`interleaved_rope`); each layer rotates q and k together.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnivox.layers.attention import KVCache, causal_attention
from omnivox.layers.merged import MergedLinear, keep_checkpoint_names
from omnivox.layers.norm import RMSNorm
from omnivox.layers.rotary import Rotary, pair_rotary


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for low-precision activations, the activation dtype itself for fp32/fp64
    (torch.promote_types(dtype, fp32) for float dtypes, without a dispatched op)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class FishRMSNorm(RMSNorm):
    """Normalise in fp32 (fp64 stays fp64), cast back, then scale by the weight."""

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return compute_dtype(dtype)


def rope_freqs(head_dim: int, base: float, device=None) -> torch.Tensor:
    """[head_dim/2] fp32 base^(-2j/head_dim)."""
    j = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)[: head_dim // 2]
    return 1.0 / (base ** (j / head_dim))


def rope_tables(positions: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [..., S] -> bf16-rounded (cos, sin) [..., S, head_dim/2], returned as bf16."""
    angles = positions.to(torch.float32)[..., None] * freqs.to(positions.device)  # [..., S, D/2]
    return angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)


def interleaved_rope(positions: torch.Tensor, freqs: torch.Tensor, dtype: torch.dtype, head_axis: int = -2) -> Rotary:
    """The RoPE of one forward for activations of `dtype`: bf16 tables, rotation in fp32 (fp64)."""
    cos, sin = rope_tables(positions, freqs)
    return pair_rotary(cos, sin, compute_dtype(dtype), head_axis)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair rotation. x [B, H, S, D]; cos/sin [B, S, D/2] (or [S, D/2])."""
    return pair_rotary(cos, sin, compute_dtype(x.dtype), head_axis=-3)(x)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); checkpoint w1 / w3 load into one `w13`."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w13 = MergedLinear(dim, {"w1": hidden, "w3": hidden})
        self.w2 = nn.Linear(hidden, dim, bias=False)
        keep_checkpoint_names(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Attention(nn.Module):
    """Fused q||k||v projection, optional per-head QK RMSNorm before RoPE, GQA (head i -> kv i // g).

    Checkpoint q_norm / k_norm load into one `qk_norm` over the H + Hkv heads of q and k."""

    def __init__(self, dim: int, n_head: int, n_kv: int, head_dim: int, qk_norm: bool, eps: float):
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = n_head, n_kv, head_dim
        self.wqkv = nn.Linear(dim, (n_head + 2 * n_kv) * head_dim, bias=False)
        self.wo = nn.Linear(n_head * head_dim, dim, bias=False)
        self.qk_norm = FishRMSNorm(head_dim, eps, heads={"q_norm": n_head, "k_norm": n_kv}) if qk_norm else None
        keep_checkpoint_names(self)

    def forward(self, x: torch.Tensor, rope: Rotary, cache: KVCache | None, layer: int) -> torch.Tensor:
        """x [..., S, dim] -> [..., S, dim]; `cache.attend(layer, q, k, v)` owns storage and masking."""
        qkv = self.wqkv(x).unflatten(-1, (-1, self.head_dim))  # [..., S, H+2Hkv, D]
        qk, v = qkv.split((self.n_head + self.n_kv, self.n_kv), dim=-2)
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        q, k = rope(qk).split((self.n_head, self.n_kv), dim=-2)  # [..., S, H, D], [..., S, Hkv, D]
        out = causal_attention(q, k, v) if cache is None else cache.attend(layer, q, k, v)
        return self.wo(out.flatten(-2))


class Block(nn.Module):
    """Pre-norm decoder block: x += attn(norm(x)); x += ffn(norm(x))."""

    def __init__(self, dim: int, n_head: int, n_kv: int, head_dim: int, hidden: int, qk_norm: bool, eps: float):
        super().__init__()
        self.attention = Attention(dim, n_head, n_kv, head_dim, qk_norm, eps)
        self.feed_forward = FeedForward(dim, hidden)
        self.attention_norm = FishRMSNorm(dim, eps)
        self.ffn_norm = FishRMSNorm(dim, eps)

    def forward(self, x: torch.Tensor, rope: Rotary, cache: KVCache | None, layer: int) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope, cache, layer)
        return x + self.feed_forward(self.ffn_norm(x))
