"""The blocks of Moshi's two transformers (the temporal one and the depformer), one token per
row per call, with module names equal to moshi's state-dict keys so weights load by identity.

Activations are token-major ([B, T, C], q/k/v [B, T, H, D]) and attention goes through
omnivox's `KVCache.attend` seam: the engine's paged KV (`models/moshi/stages/lm.py`), the
depformer's `FrameKVCache`. Numerics follow moshi op for op (RMSNorm's `x * (alpha * rsqrt)`,
RoPE angles `exp(-log(period) * 2j / D) * t` in fp32, the gating's `view(2, -1)` split), so fp32
outputs equal the reference's bit for bit on CPU.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from omnivox.layers.attention import KVCache
from omnivox.layers.rotary import Rotary
from omnivox.layers.window_attention import LayerScale
from omnivox.models.moshi.config import TransformerConfig

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": torch.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
               "leaky_relu": F.leaky_relu, "elu": F.elu, "mish": F.mish, "softsign": F.softsign,
               "identity": lambda x: x}


class AlphaRMSNorm(nn.Module):
    """moshi's RMSNorm: parameter `alpha` [1, 1, dim]; `fp32` computes in float32 (rms_norm_f32)."""

    def __init__(self, dim: int, eps: float, fp32: bool):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, 1, dim))
        self.eps, self.fp32 = eps, fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float() if self.fp32 else x
        var = self.eps + torch.mean(y ** 2, dim=-1, keepdim=True)
        return (y * (self.alpha.to(var) * torch.rsqrt(var))).to(x.dtype)


class LayerNormF32(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(),
                            self.eps).to(x.dtype)


def make_norm(kind: str, dim: int) -> nn.Module:
    if kind == "layer_norm":
        return nn.LayerNorm(dim, eps=1e-5)
    if kind == "layer_norm_f32":
        return LayerNormF32(dim, eps=1e-8)
    return AlphaRMSNorm(dim, eps=1e-5 if kind == "rms_norm" else 1e-8, fp32=kind == "rms_norm_f32")


class Gating(nn.Module):
    """act(first half of linear_in(x)) * second half -> linear_out (moshi's ActivationGating)."""

    def __init__(self, dim: int, hidden: int, activation: str):
        super().__init__()
        self.linear_in = nn.Linear(dim, 2 * hidden, bias=False)
        self.linear_out = nn.Linear(hidden, dim, bias=False)
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_in(x).unflatten(-1, (2, -1))  # [B, T, 2, hidden]
        return self.linear_out(self.act(h[..., 0, :]) * h[..., 1, :])


class Attention(nn.Module):
    """Fused q/k/v projection (`in_projs.{w}`: q heads, then k, then v), RoPE, attention through
    the cache, output projection (`out_projs.{w}`); one weight set per step in the depformer."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.dim = cfg.num_heads, cfg.kv_heads, cfg.head_dim, cfg.dim
        out = cfg.dim + 2 * cfg.kv_heads * cfg.head_dim
        self.in_projs = nn.ModuleList(nn.Linear(cfg.dim, out, bias=False) for _ in range(cfg.weight_sets))
        self.out_projs = nn.ModuleList(nn.Linear(cfg.dim, cfg.dim, bias=False) for _ in range(cfg.weight_sets))

    def forward(self, x: torch.Tensor, rope: Rotary | None, cache: KVCache, layer: int, w: int) -> torch.Tensor:
        proj = self.in_projs[w](x)  # [B, T, dim + 2 kv_dim]
        q = proj[..., :self.dim].unflatten(-1, (self.heads, self.head_dim))  # [B, T, H, D]
        k, v = proj[..., self.dim:].unflatten(-1, (2, self.kv_heads, self.head_dim)).unbind(-3)  # [B, T, Hkv, D]
        if rope is not None:
            q, k = rope(q), rope(k)
        out = cache.attend(layer, q, k, v)  # [B, T, H, D]
        return self.out_projs[w](out.flatten(-2))


class Layer(nn.Module):
    """Pre-norm block: x + ls1(attn(norm1 x)), then x + ls2(ff(norm2 x))."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.norm1, self.norm2 = make_norm(cfg.norm, cfg.dim), make_norm(cfg.norm, cfg.dim)
        if cfg.gating == "none":
            self.linear1 = nn.Linear(cfg.dim, cfg.dim_feedforward[0], bias=False)
            self.linear2 = nn.Linear(cfg.dim_feedforward[0], cfg.dim, bias=False)
        elif cfg.per_step:
            self.gating = nn.ModuleList(Gating(cfg.dim, cfg.gating_hidden(f), cfg.gating) for f in cfg.dim_feedforward)
        else:
            self.gating = Gating(cfg.dim, cfg.gating_hidden(cfg.dim_feedforward[0]), cfg.gating)
        scaled = cfg.layer_scale is not None
        self.layer_scale_1 = LayerScale(cfg.dim) if scaled else nn.Identity()
        self.layer_scale_2 = LayerScale(cfg.dim) if scaled else nn.Identity()

    def forward(self, x: torch.Tensor, rope: Rotary | None, cache: KVCache, layer: int, w: int) -> torch.Tensor:
        x = x + self.layer_scale_1(self.self_attn(self.norm1(x), rope, cache, layer, w))
        h = self.norm2(x)
        if hasattr(self, "linear1"):
            update = self.linear2(F.gelu(self.linear1(h)))
        else:
            update = (self.gating[w] if isinstance(self.gating, nn.ModuleList) else self.gating)(h)
        return x + self.layer_scale_2(update)


class Transformer(nn.Module):
    """A stack of `Layer`s over one new token per row at per-row positions (module `layers`)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, w: int = 0,
                rope: Rotary | None = None) -> torch.Tensor:
        """x [B, 1, C] at positions [B] -> [B, 1, C]; `w`: the weight set of this step;
        `rope`: this step's RoPE when the caller built it already (see `rope_at`)."""
        cfg = self.cfg
        if cfg.positional_embedding in ("sin", "sin_rope"):
            x = x + cfg.positional_scale * sin_embedding(positions[:, None, None], x.shape[-1], cfg.max_period, x.dtype)
        if rope is None and cfg.positional_embedding in ("rope", "sin_rope"):
            rope = interleaved_rope(positions, cfg.head_dim, cfg.max_period)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, cache, i, w)
        return x


def interleaved_rope(positions: torch.Tensor, head_dim: int, max_period: float) -> Rotary:
    """moshi's RoPE (pairs (x[2j], x[2j+1]) rotate by t * exp(-log(max_period) * 2j / D), fp32)
    for one token per row at positions [B], activations [B, 1, H, D]."""
    dev = positions.device
    freqs = torch.exp(torch.arange(head_dim // 2, device=dev, dtype=torch.float32)
                      * (-math.log(max_period) * 2 / head_dim))  # [D/2]
    angles = freqs * positions.float().view(-1, 1, 1, 1)  # [B, 1, 1, D/2]
    cos, sin = torch.cos(angles), torch.sin(angles)
    cos = torch.stack((cos, cos), dim=-1).flatten(-2)  # c0 c0 c1 c1 ...
    sin = torch.stack((-sin, sin), dim=-1).flatten(-2)  # -s0 s0 -s1 s1 ...
    return Rotary(cos, sin, torch.arange(head_dim, device=dev) ^ 1)


def sin_embedding(positions: torch.Tensor, dim: int, max_period: float, dtype: torch.dtype) -> torch.Tensor:
    """moshi's sinusoidal embedding [cos | sin] for positions [B, T, 1] -> [B, T, dim]."""
    half = dim // 2
    p = positions.to(dtype)
    adim = torch.arange(half, device=p.device, dtype=dtype).view(1, 1, -1)
    phase = p / (torch.full([], max_period, device=p.device, dtype=dtype) ** (adim / (half - 1)))
    return torch.cat([torch.cos(phase), torch.sin(phase)], dim=-1)


class ZeroEmbedding(nn.Embedding):
    """An embedding where id -1 (moshi's zero token: "no input") gives exactly zeros."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y = super().forward(ids.clamp(min=0))
        return torch.where((ids == -1)[..., None], y.new_zeros(()), y)
