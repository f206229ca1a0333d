"""Building blocks of the causal DAC codec (spec 12.2, 12.6): Snake, the strided encoder conv,
residual units, the sliding-window transformer's layers (its loop, the transposed conv and the
ConvNeXt block are the shared ones in `omnivox.layers`). Every module used by the decoder
also streams: `init_state(batch, device, dtype)` + `step(x, state, skip)` as in
`omnivox.layers.streaming_conv` (skip is always zero here: nothing in this codec looks ahead).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from omnivox.layers.streaming_conv import CausalConv1d, Residual
from omnivox.layers.window_attention import LayerScale, WindowTransformer
from omnivox.layers.rotary import Rotary
from omnivox.models.fish_s2.blocks import FeedForward, FishRMSNorm, interleaved_rope, rope_freqs
from omnivox.models.fish_s2.config import CodecTransformerConfig


class Snake(nn.Module):
    """y = x + sin^2(alpha x) / (alpha + 1e-9), per-channel alpha [1, C, 1]."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class StridedCausalConv(nn.Module):
    """Encoder-only conv with stride: left pad k - s, right pad until the last window is complete."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, stride=stride)
        self.kernel, self.stride = kernel_size, stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, L] -> [B, C', ceil(L / s)]
        pad = self.kernel - self.stride
        length = x.shape[-1]
        frames = (length - self.kernel + pad) / self.stride + 1
        extra = (math.ceil(frames) - 1) * self.stride + (self.kernel - pad) - length
        return self.conv(F.pad(x, (pad, max(extra, 0))))


class ResidualUnit(Residual):
    """x + (Snake -> causal conv k7 dilated -> Snake -> conv k1)(x)."""

    def __init__(self, dim: int, dilation: int):
        super().__init__(Snake(dim), CausalConv1d(dim, dim, 7, dilation=dilation), Snake(dim), CausalConv1d(dim, dim, 1))


# ---------------------------------------------------------------- sliding-window transformer



class CodecAttention(nn.Module):
    def __init__(self, cfg: CodecTransformerConfig):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.n_head * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x, rope: Rotary, past_k, past_v, mask):
        """x [B, n, C], past [B, H, c, D], mask [B, 1, n, c+n] -> (out [B, n, C], k, v [B, H, c+n, D]).
        `rope` has its tables on the head-first layout (head_axis=-3)."""
        b, n, _ = x.shape
        qkv = self.wqkv(x).view(b, n, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)  # [3, B, H, n, D]
        q, k = rope(qkv[:2])  # q and k rotated together
        k, v = torch.cat((past_k, k), dim=2), torch.cat((past_v, qkv[2]), dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(b, n, -1)), k, v


class CodecTransformerLayer(nn.Module):
    def __init__(self, cfg: CodecTransformerConfig):
        super().__init__()
        self.attention = CodecAttention(cfg)
        self.feed_forward = FeedForward(cfg.dim, cfg.intermediate_size)
        self.attention_norm = FishRMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = FishRMSNorm(cfg.dim, cfg.norm_eps)
        self.attention_layer_scale = LayerScale(cfg.dim, "gamma")
        self.ffn_layer_scale = LayerScale(cfg.dim, "gamma")

    def forward(self, x, rope: Rotary, past_k, past_v, mask):
        a, k, v = self.attention(self.attention_norm(x), rope, past_k, past_v, mask)
        x = x + self.attention_layer_scale(a)
        x = x + self.ffn_layer_scale(self.feed_forward(self.ffn_norm(x)))
        return x, k, v


class CodecTransformer(WindowTransformer):
    """S2's codec transformer: the shared sliding-window transformer over the codec's layers and
    interleaved RoPE (tables on the head-first layout)."""

    one_shot_chunk = 256

    def __init__(self, cfg: CodecTransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.window, self.kv_heads, self.head_dim = cfg.window, cfg.n_head, cfg.head_dim
        self.layers = nn.ModuleList(CodecTransformerLayer(cfg) for _ in range(cfg.n_layer))
        self.norm = FishRMSNorm(cfg.dim, cfg.norm_eps)
        self.register_buffer("freqs", rope_freqs(cfg.head_dim, cfg.rope_base), persistent=False)

    def reset_buffers(self) -> None:
        self.freqs = rope_freqs(self.cfg.head_dim, self.cfg.rope_base, device=self.norm.weight.device)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        return interleaved_rope(positions, self.freqs, dtype, head_axis=-3)  # tables [B, 1, n, D]
