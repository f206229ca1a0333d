"""Mimi, Kyutai's streaming speech codec (moshi's `MimiModel` at inference), batched across sessions.

Encode, per 1920-sample frame (80 ms at 24 kHz): SEANet conv encoder (hop 960) -> 2 steps of a
causal transformer (8 layers, RoPE, a 250-step window) -> a learnt stride-2 conv -> split RVQ (the
semantic codebook and the acoustic ones each quantize the same latent) -> n_q codes.
Decode mirrors it: codebook sum -> channel-wise stride-2 transposed conv -> transformer -> SEANet
decoder -> 1920 samples.

Streaming state is data, one row per session (`MimiEncoderState`, `MimiDecoderState`, both
`BatchedState`s): rows of sessions started at different times step together in one call, a joining
session is `concat`enated as a fresh row, a leaving one dropped with `select`. A call takes k whole
frames per row and equals k one-frame calls of moshi's streaming `encode` / `decode`: its
transformers keep a ring of `context` steps written 2 steps per frame (`WindowTransformer.ring_chunk`).

Module names follow moshi's state dict; `mimi_weights` maps the few that differ.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from omnivox.layers.rotary import Rotary, pair_rotary
from omnivox.layers.streaming_conv import (BatchedState, CausalConv1d, CausalConvTranspose1d, ConvState, Residual,
                                           TransConvState, stream_init, stream_step)
from omnivox.layers.window_attention import LayerScale, WindowState, WindowTransformer
from omnivox.models.moshi.mimi_config import MimiConfig, SeanetConfig, TransformerConfig


def _activation(cfg: SeanetConfig) -> nn.Module:
    return getattr(nn, cfg.activation)(**dict(cfg.activation_params))


class SeanetResBlock(Residual):
    """x + conv1(act(conv_k(act(x)))), the hidden width dim / compress."""

    def __init__(self, cfg: SeanetConfig, dim: int, dilation: int):
        hidden, pad = dim // cfg.compress, cfg.pad_mode
        super().__init__(_activation(cfg), CausalConv1d(dim, hidden, cfg.residual_kernel_size, dilation, pad_mode=pad),
                         _activation(cfg), CausalConv1d(hidden, dim, 1, pad_mode=pad))


class SeanetEncoder(nn.Module):
    """[B, 1, L] -> [B, dimension, L / hop]; `model` indexes as moshi's SEANetEncoder.model."""

    def __init__(self, cfg: SeanetConfig):
        super().__init__()
        width, pad = cfg.n_filters, cfg.pad_mode
        mods: list[nn.Module] = [CausalConv1d(cfg.channels, width, cfg.kernel_size, pad_mode=pad)]
        for ratio in reversed(cfg.ratios):
            mods += [SeanetResBlock(cfg, width, cfg.dilation_base ** j) for j in range(cfg.n_residual_layers)]
            mods += [_activation(cfg), CausalConv1d(width, 2 * width, 2 * ratio, stride=ratio, pad_mode=pad)]
            width *= 2
        mods += [_activation(cfg), CausalConv1d(width, cfg.dimension, cfg.last_kernel_size, pad_mode=pad)]
        self.model = nn.Sequential(*mods)


class SeanetDecoder(nn.Module):
    """[B, dimension, T] -> [B, 1, T * hop]; `model` indexes as moshi's SEANetDecoder.model."""

    def __init__(self, cfg: SeanetConfig):
        super().__init__()
        width, pad = cfg.n_filters * 2 ** len(cfg.ratios), cfg.pad_mode
        mods: list[nn.Module] = [CausalConv1d(cfg.dimension, width, cfg.kernel_size, pad_mode=pad)]
        for ratio in cfg.ratios:
            mods += [_activation(cfg), CausalConvTranspose1d(width, width // 2, 2 * ratio, ratio, look_ahead=False)]
            width //= 2
            mods += [SeanetResBlock(cfg, width, cfg.dilation_base ** j) for j in range(cfg.n_residual_layers)]
        mods += [_activation(cfg), CausalConv1d(width, cfg.channels, cfg.last_kernel_size, pad_mode=pad)]
        self.model = nn.Sequential(*mods)


# ---------------------------------------------------------------- transformer


class MimiAttention(nn.Module):
    """Fused qkv (`in_projs.0`, layout (3, heads, head_dim)) and `out_projs.0`, no biases."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.in_projs = nn.ModuleList([nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)])
        self.out_projs = nn.ModuleList([nn.Linear(cfg.d_model, cfg.d_model, bias=False)])

    def forward(self, x, rope: Rotary, past_k, past_v, mask):
        """x [B, n, C], past [B, H, c, D], mask [B, 1, n, c+n] -> (out [B, n, C], k, v [B, H, c+n, D])."""
        b, n, _ = x.shape
        qkv = self.in_projs[0](x).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)  # [3, B, H, n, D]
        q, k = rope(qkv[:2])
        k, v = torch.cat((past_k, k), dim=2), torch.cat((past_v, qkv[2]), dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_projs[0](out.transpose(1, 2).reshape(b, n, -1)), k, v


class MimiLayer(nn.Module):
    """Pre-norm layer: x + s1 * attn(LN(x)), then x + s2 * linear2(gelu(linear1(LN(x))))."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        d = cfg.d_model
        self.self_attn = MimiAttention(cfg)
        self.norm1 = nn.LayerNorm(d, eps=1e-5)
        self.norm2 = nn.LayerNorm(d, eps=1e-5)
        self.linear1 = nn.Linear(d, cfg.dim_feedforward, bias=False)
        self.linear2 = nn.Linear(cfg.dim_feedforward, d, bias=False)
        scaled = cfg.layer_scale is not None
        self.layer_scale_1 = LayerScale(d) if scaled else nn.Identity()
        self.layer_scale_2 = LayerScale(d) if scaled else nn.Identity()

    def forward(self, x, rope: Rotary, past_k, past_v, mask):
        a, k, v = self.self_attn(self.norm1(x), rope, past_k, past_v, mask)
        x = x + self.layer_scale_1(a)
        x = x + self.layer_scale_2(self.linear2(F.gelu(self.linear1(self.norm2(x)))))
        return x, k, v


class MimiTransformer(WindowTransformer):
    """moshi's StreamingTransformer (no final norm): a ring of `context` steps, `steps_per_frame`
    written per frame; interleaved-pair RoPE with moshi's frequencies exp(-2j ln(max_period) / D)."""

    def __init__(self, cfg: TransformerConfig, steps_per_frame: int):
        super().__init__()
        self.window, self.kv_heads, self.head_dim = cfg.context, cfg.num_heads, cfg.head_dim
        self.ring_chunk = steps_per_frame
        self.max_period = cfg.max_period
        self.layers = nn.ModuleList(MimiLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Identity()

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:  # tables [B, 1, n, D]
        d = self.head_dim
        freqs = torch.exp(torch.arange(d // 2, device=positions.device, dtype=torch.float32)
                          * (-math.log(self.max_period) * 2 / d))
        angles = positions.to(torch.float32)[..., None] * freqs  # [B, n, D/2]
        return pair_rotary(angles.cos(), angles.sin(), torch.float32, head_axis=-3)


class ProjectedTransformer(nn.Module):
    """moshi's ProjectedTransformer in conv layout: [B, C, n] -> [B, C, n] (projections only
    where d_model differs from the outer dimension)."""

    def __init__(self, cfg: TransformerConfig, steps_per_frame: int):
        super().__init__()
        self.transformer = MimiTransformer(cfg, steps_per_frame)
        self.input_proj = (nn.Linear(cfg.input_dimension, cfg.d_model, bias=False)
                           if cfg.input_dimension != cfg.d_model else nn.Identity())
        self.output_projs = nn.ModuleList([nn.Linear(cfg.d_model, cfg.output_dimension, bias=False)
                                           if cfg.output_dimension != cfg.d_model else nn.Identity()])

    def init_state(self, batch: int, device, dtype: torch.dtype) -> WindowState:
        return self.transformer.init_state(batch, device, dtype)

    def step(self, x: torch.Tensor, state: WindowState) -> torch.Tensor:
        y = self.transformer.step(self.input_proj(x.transpose(1, 2)), state)
        return self.output_projs[0](y).transpose(1, 2)


# ---------------------------------------------------------------- quantizer


class RVQ(nn.Module):
    """Residual VQ over 1x1-conv projections; `codebooks` [n, bins, dim] stacks moshi's
    per-level embedding_sum / cluster_usage (see mimi_weights)."""

    def __init__(self, outer: int, dim: int, bins: int, levels: int):
        super().__init__()
        self.input_proj = nn.Conv1d(outer, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, outer, 1, bias=False)
        self.register_buffer("codebooks", torch.zeros(levels, bins, dim))

    def encode(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T] -> [B, levels, T] long
        b, _, t = x.shape
        residual = self.input_proj(x).transpose(1, 2).reshape(b * t, -1)  # [B*T, dim]
        codes = []
        for table in self.codebooks:  # NOTE: cdist + argmin as moshi, so ties break the same way
            c = torch.cdist(residual[None], table[None], p=2)[0].argmin(dim=-1)  # [B*T]
            residual = residual - F.embedding(c, table)
            codes.append(c)
        return torch.stack(codes, dim=1).view(b, t, -1).transpose(1, 2)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:  # [B, levels, T] -> [B, C, T]
        z = None
        for table, c in zip(self.codebooks, codes.unbind(1)):
            e = F.embedding(c, table)  # [B, T, dim]
            z = e if z is None else z + e
        return self.output_proj(z.transpose(1, 2))


class SplitRVQ(nn.Module):
    """The semantic RVQ (`rvq_first`) and the acoustic one (`rvq_rest`) both quantize the latent;
    their decodes add."""

    def __init__(self, cfg: MimiConfig):
        super().__init__()
        q = cfg.quantizer
        self.n_semantic = q.n_q_semantic
        self.rvq_first = RVQ(q.input_dimension, q.dimension, q.bins, q.n_q_semantic)
        self.rvq_rest = RVQ(q.input_dimension, q.dimension, q.bins, cfg.num_codebooks - q.n_q_semantic)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.rvq_first.encode(x), self.rvq_rest.encode(x)), dim=1)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.rvq_first.decode(codes[:, :self.n_semantic]) + self.rvq_rest.decode(codes[:, self.n_semantic:])


class Downsample(nn.Module):
    """moshi's ConvDownsample1d (learnt): a stride-s conv, kernel 2s, padded with the first step."""

    def __init__(self, dim: int, stride: int):
        super().__init__()
        self.conv = CausalConv1d(dim, dim, 2 * stride, stride=stride, bias=False, pad_mode="replicate")


class Upsample(nn.Module):
    """moshi's ConvTrUpsample1d (learnt, channel-wise): a stride-s transposed conv, kernel 2s."""

    def __init__(self, dim: int, stride: int):
        super().__init__()
        self.convtr = CausalConvTranspose1d(dim, dim, 2 * stride, stride, groups=dim, bias=False, look_ahead=False)


# ---------------------------------------------------------------- the codec


@dataclass
class MimiEncoderState(BatchedState):
    """One session's encoder: SEANet conv tails, the transformer's window, the downsampler's tail."""

    convs: list  # per SEANet encoder module: ConvState, a res block's [ConvState, ConvState], or None
    transformer: WindowState
    downsample: ConvState | None


@dataclass
class MimiDecoderState(BatchedState):
    """One session's decoder: the upsampler's last input, the transformer's window, SEANet tails."""

    upsample: TransConvState | None
    transformer: WindowState
    convs: list  # per SEANet decoder module: ConvState / TransConvState, a res block's list, or None


class Mimi(nn.Module):
    def __init__(self, cfg: MimiConfig):
        super().__init__()
        self.cfg = cfg
        spf, dim = cfg.steps_per_frame, cfg.seanet.dimension
        self.encoder = SeanetEncoder(cfg.seanet)
        self.decoder = SeanetDecoder(cfg.seanet)
        self.encoder_transformer = ProjectedTransformer(cfg.transformer, spf)
        self.decoder_transformer = ProjectedTransformer(cfg.transformer, spf)
        self.quantizer = SplitRVQ(cfg)
        self.downsample = Downsample(dim, spf) if spf > 1 else None
        self.upsample = Upsample(dim, spf) if spf > 1 else None

    @property
    def frame_size(self) -> int:
        return self.cfg.frame_size

    def init_encoder_state(self, batch: int, device=None, dtype: torch.dtype | None = None) -> MimiEncoderState:
        device, dtype = self._where(device, dtype)
        down = self.downsample.conv.init_state(batch, device, dtype) if self.downsample is not None else None
        return MimiEncoderState(stream_init(self.encoder.model, batch, device, dtype),
                                self.encoder_transformer.init_state(batch, device, dtype), down)

    def init_decoder_state(self, batch: int, device=None, dtype: torch.dtype | None = None) -> MimiDecoderState:
        device, dtype = self._where(device, dtype)
        up = self.upsample.convtr.init_state(batch, device, dtype) if self.upsample is not None else None
        return MimiDecoderState(up, self.decoder_transformer.init_state(batch, device, dtype),
                                stream_init(self.decoder.model, batch, device, dtype))

    def encode_step(self, pcm: torch.Tensor, state: MimiEncoderState) -> torch.Tensor:
        """pcm [B, 1, k * frame_size] -> codes [B, num_codebooks, k] (long); `state` advances k frames."""
        if pcm.dim() != 3 or pcm.shape[1] != 1 or pcm.shape[-1] == 0 or pcm.shape[-1] % self.frame_size:
            raise ValueError(f"Mimi encodes [B, 1, k * {self.frame_size}] samples, got {list(pcm.shape)}")
        skip = torch.zeros(pcm.shape[0], dtype=torch.long, device=pcm.device)
        x, _ = stream_step(self.encoder.model, state.convs, pcm, skip)  # [B, C, k * steps]
        x = self.encoder_transformer.step(x, state.transformer)
        if self.downsample is not None:
            x, _ = self.downsample.conv.step(x, state.downsample, skip)  # [B, C, k]
        return self.quantizer.encode(x)

    def decode_step(self, codes: torch.Tensor, state: MimiDecoderState) -> torch.Tensor:
        """codes [B, num_codebooks, k] -> pcm [B, 1, k * frame_size]; `state` advances k frames.
        NOTE: codes must lie in [0, bins) (not checked: that would read the device)."""
        if codes.dim() != 3 or codes.shape[1] != self.cfg.num_codebooks or codes.shape[-1] == 0:
            raise ValueError(f"Mimi decodes codes [B, {self.cfg.num_codebooks}, k], got {list(codes.shape)}")
        skip = torch.zeros(codes.shape[0], dtype=torch.long, device=codes.device)
        x = self.quantizer.decode(codes)  # [B, C, k]
        if self.upsample is not None:
            x, _ = self.upsample.convtr.step(x, state.upsample, skip)  # [B, C, k * steps]
        x = self.decoder_transformer.step(x, state.transformer)
        pcm, _ = stream_step(self.decoder.model, state.convs, x, skip)
        return pcm

    def _where(self, device, dtype) -> tuple[torch.device, torch.dtype]:
        p = next(self.parameters())
        return torch.device(device) if device is not None else p.device, dtype or p.dtype
