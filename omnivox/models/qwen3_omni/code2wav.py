"""Code2Wav: Qwen3-Omni's vocoder, codec codes [B, Q, T] -> 24 kHz waveform (spec section 10).

mean of Q code embeddings -> causal sliding-window transformer -> 2 x (transposed conv x2 +
ConvNeXt) -> conv -> 4 decoder blocks (SnakeBeta, causal transposed conv, dilated residual
units) -> SnakeBeta -> conv -> clamp[-1, 1].

Two ways to run it, exactly equal:
- `forward(codes)`: one shot, total_upsample*T - trim samples (1920*T - 555 for the real model),
  identical to transformers' plain `code2wav(codes)` (not its seamed `chunked_decode`).
- `decode_step(codes, state)`: n new frames per request, with all causal context carried in a
  per-request `Code2WavState` (KV windows, conv tails, transposed-conv look-ahead steps). After
  k frames a request has received exactly the first total_upsample*k - trim samples of the
  one-shot decode: the first call yields total_upsample*n - trim, later calls total_upsample*n.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from omnivox.errors import CheckpointError, InputError
from omnivox.layers.merged import MergedLinear, keep_checkpoint_names
from omnivox.layers.mlp import SwiGLU
from omnivox.layers.norm import RMSNorm
from omnivox.layers.rotary import Rotary, inv_freq, rotate_half_rope

SAMPLE_RATE = 24000  # Hz of the waveform Code2Wav writes: the one place Qwen3-Omni's output rate is stated
from omnivox.layers.streaming_conv import (BatchedState, CausalConv1d, CausalConvTranspose1d, ConvNeXtBlock,
                                           ConvState, stream_init, stream_step, zero_prefix)
from omnivox.layers.window_attention import LayerScale, WindowState, WindowTransformer
from omnivox.models.qwen3_omni.config import Code2WavConfig, DecoderConfig


# ---------------------------------------------------------------- pre-transformer



class Code2WavAttention(nn.Module):
    """Plain MHA/GQA with RoPE, no q/k norm, no biases; q_proj / k_proj / v_proj load into one `qkv_proj`."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        kv = self.kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q_proj": self.heads * self.head_dim, "k_proj": kv, "v_proj": kv})
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        keep_checkpoint_names(self)

    def forward(self, x: torch.Tensor, rope: Rotary, past_k: torch.Tensor,
                past_v: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, n, H]; past_k/v [B, kv, C, D]; mask [B, 1, n, C+n] -> (out [B, n, H], k, v [B, kv, C+n, D])."""
        qkv = self.qkv_proj(x).unflatten(-1, (-1, self.head_dim))  # [B, n, h+2kv, D]
        qk, v = qkv.split((self.heads + self.kv_heads, self.kv_heads), dim=-2)
        q, k = rope(qk).transpose(1, 2).split((self.heads, self.kv_heads), dim=1)  # [B, h, n, D], [B, kv, n, D]
        k, v = torch.cat((past_k, k), dim=2), torch.cat((past_v, v.transpose(1, 2)), dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).flatten(-2)), k, v


class Code2WavLayer(nn.Module):
    """Pre-norm layer with per-channel LayerScale on both residual branches."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Code2WavAttention(cfg)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size)

    def forward(self, h, rope: Rotary, past_k, past_v, mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, k, v = self.self_attn(self.input_layernorm(h), rope, past_k, past_v, mask)
        h = h + self.self_attn_layer_scale(a)
        h = h + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(h)))
        return h, k, v


class Code2WavTransformer(WindowTransformer):
    """Code2Wav's pre-transformer: the shared sliding-window transformer over Code2Wav's layers
    and rotate-half RoPE (angles in fp32 even when the model runs in fp64: the reference's fp32
    island), with the float mask the reference's attention builds."""

    additive = True

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        if not cfg.sliding_window:
            raise CheckpointError("config.json: code2wav_config.sliding_window is missing (72 in Qwen3-Omni)")
        self.cfg = cfg
        self.window, self.kv_heads, self.head_dim = int(cfg.sliding_window), cfg.num_key_value_heads, cfg.head_dim
        self.layers = nn.ModuleList(Code2WavLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", inv_freq(cfg.head_dim, cfg.rope_theta), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute non-persistent tables (after building on the meta device)."""
        self.inv_freq = inv_freq(self.cfg.head_dim, self.cfg.rope_theta, device=self.norm.weight.device)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        return rotate_half_rope(positions, self.inv_freq.float(), dtype)  # tables [B, n, 1, D]


# ---------------------------------------------------------------- convolutional stack

class SnakeBeta(nn.Module):
    """x + sin^2(x·e^alpha) / (e^beta + 1e-9), per channel; alpha and beta stored in log space."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, L]
        alpha = self.alpha.exp()[None, :, None]
        beta = self.beta.exp()[None, :, None]
        return x + (1.0 / (beta + 1e-9)) * torch.sin(x * alpha).pow(2)


class ResidualUnit(nn.Module):
    """x + conv2(snake2(conv1(snake1(x)))); conv1 kernel 7 with a dilation, conv2 kernel 1."""

    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))

    def init_state(self, batch: int, device, dtype: torch.dtype) -> ConvState:
        return self.conv1.init_state(batch, device, dtype)  # conv2 has kernel 1: no context

    def step(self, x: torch.Tensor, state: ConvState, skip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, skip = self.conv1.step(self.act1(x), state, skip)
        return x + self.conv2(self.act2(y)), skip


class DecoderBlock(nn.Module):
    """SnakeBeta -> causal transposed conv (x rate) -> residual units with dilations 1, 3, 9."""

    def __init__(self, in_dim: int, out_dim: int, rate: int):
        super().__init__()
        self.block = nn.ModuleList([SnakeBeta(in_dim), CausalConvTranspose1d(in_dim, out_dim, 2 * rate, rate),
                                    *(ResidualUnit(out_dim, d) for d in (1, 3, 9))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.block:
            x = m(x)
        return x

    def init_state(self, batch: int, device, dtype: torch.dtype) -> list:
        return stream_init(self.block, batch, device, dtype)

    def step(self, x: torch.Tensor, state: list, skip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return stream_step(self.block, state, x, skip)


# ---------------------------------------------------------------- the vocoder

@dataclass
class Code2WavState(BatchedState):
    """One request per row: everything the next frames' samples depend on, bounded in size."""

    transformer: WindowState
    upsample: list[list]  # per stage [TransConvState, ConvState]
    decoder: list  # per decoder module: ConvState | list (decoder block) | None (SnakeBeta)

    @property
    def frames(self) -> torch.Tensor:
        """[B] frames decoded so far per request (0 = fresh)."""
        return self.transformer.pos


class Code2Wav(nn.Module):
    def __init__(self, cfg: Code2WavConfig):
        super().__init__()
        t = cfg.transformer
        n_blocks = len(cfg.upsample_rates)
        if cfg.decoder_dim % 2 ** n_blocks:
            raise CheckpointError(f"config.json: code2wav decoder_dim {cfg.decoder_dim} must be divisible by "
                                  f"2^{n_blocks} (channels halve in every decoder block)")
        self.cfg = cfg
        self.code_embedding = nn.Embedding(cfg.codebook_size * cfg.num_quantizers, t.hidden_size)
        self.register_buffer("code_offset", self._offsets(), persistent=False)
        self.pre_transformer = Code2WavTransformer(t)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalConvTranspose1d(t.hidden_size, t.hidden_size, f, f), ConvNeXtBlock(t.hidden_size)])
            for f in cfg.upsampling_ratios)
        dims = [cfg.decoder_dim // 2 ** i for i in range(n_blocks + 1)]
        self.decoder = nn.ModuleList([
            CausalConv1d(t.hidden_size, dims[0], 7),
            *(DecoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(cfg.upsample_rates)),
            SnakeBeta(dims[-1]),
            CausalConv1d(dims[-1], 1, 7),
        ])
        self.total_upsample = cfg.total_upsample
        self.trim = self._lost_samples()

    def _offsets(self, device=None) -> torch.Tensor:
        q = torch.arange(self.cfg.num_quantizers, device=device)
        return (q * self.cfg.codebook_size).view(1, -1, 1)  # [1, Q, 1]

    def reset_buffers(self) -> None:
        """Recompute non-persistent tables (after building on the meta device)."""
        self.code_offset = self._offsets(self.code_embedding.weight.device)

    def _lost_samples(self) -> int:
        """Samples a one-shot call lacks vs total_upsample*T: each look-ahead step of a transposed
        conv costs its stride, multiplied by every later stride (555 for the real model)."""
        lost = 0
        for m in self.modules():  # registration order = signal order
            if isinstance(m, CausalConvTranspose1d):
                lost = (lost + m.context) * m.stride
        return lost

    def num_samples(self, frames: int) -> int:
        """Length of the one-shot decode of `frames` frames."""
        return self.total_upsample * frames - self.trim

    def _embed(self, codes: torch.Tensor, state: Code2WavState | None = None) -> torch.Tensor:
        if codes.dim() != 3 or codes.shape[1] != self.cfg.num_quantizers or codes.shape[2] < 1:
            raise InputError(f"Code2Wav expects codes [B, {self.cfg.num_quantizers}, T>=1], got {tuple(codes.shape)}")
        if state is not None and state.frames.shape[0] != codes.shape[0]:
            raise InputError(f"codes have {codes.shape[0]} rows but the state has {state.frames.shape[0]}")
        # NOTE: the MEAN over quantizers, not the sum (spec pitfall 4).
        return self.code_embedding(codes + self.code_offset).mean(1)  # [B, T, H]

    def forward(self, codes: torch.LongTensor) -> torch.Tensor:
        """codes [B, Q, T] -> waveform [B, 1, total_upsample*T - trim] in [-1, 1]."""
        x = self.pre_transformer(self._embed(codes)).transpose(1, 2)  # [B, H, T]
        for stage in self.upsample:
            for m in stage:
                x = m(x)
        for m in self.decoder:
            x = m(x)
        return x.clamp(-1, 1)

    def init_state(self, batch: int, device=None, dtype: torch.dtype | None = None) -> Code2WavState:
        """States of `batch` fresh requests (all context zero, position 0); device and dtype
        default to the model's."""
        device = self.code_embedding.weight.device if device is None else device
        dtype = self.code_embedding.weight.dtype if dtype is None else dtype
        return Code2WavState(
            transformer=self.pre_transformer.init_state(batch, device, dtype),
            upsample=[stream_init(stage, batch, device, dtype) for stage in self.upsample],
            decoder=stream_init(self.decoder, batch, device, dtype),
        )

    def decode_step(self, codes: torch.LongTensor, state: Code2WavState) -> torch.Tensor:
        """Decode n NEW frames per request, codes [B, Q, n]; `state` is advanced in place.

        Row b continues its own stream at frame state.frames[b] (its RoPE position). Returns
        [B, total_upsample*n] samples, the next ones of each request's one-shot decode, except:
        a fresh row (state.frames == 0 before the call) gets only total_upsample*n - trim. If
        every row is fresh the output is [B, total_upsample*n - trim]; in a call that mixes fresh
        and started rows, fresh rows are LEFT-padded with `trim` zeros.
        """
        wav, skip = self.decode_step_padded(codes, state)
        lead = set(skip.tolist())  # NOTE: one host sync: the output length depends on it
        return wav[:, lead.pop():] if len(lead) == 1 else wav

    def decode_step_padded(self, codes: torch.LongTensor, state: Code2WavState) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode_step` without the host sync: (samples [B, total_upsample*n], skip [B]) where a
        fresh row's first skip[b] (= trim) samples are zeros to drop; every shape is fixed."""
        h = self.pre_transformer.step(self._embed(codes, state), state.transformer)  # [B, n, H]
        x = h.transpose(1, 2)  # [B, H, n]
        skip = torch.zeros(codes.shape[0], dtype=torch.long, device=codes.device)
        for stage, st in zip(self.upsample, state.upsample):
            x, skip = stream_step(stage, st, x, skip)
        x, skip = stream_step(self.decoder, state.decoder, x, skip)
        return zero_prefix(x.clamp(-1, 1), skip)[:, 0], skip
