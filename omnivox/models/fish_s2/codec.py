"""The S2 codec: a modified, fully causal DAC at 44.1 kHz (spec 12).

encode: audio [B, 1, L] -> codes [B, 10, ceil(L / hop)]   (reference audio for voice cloning)
decode: codes [B, 10, N] -> audio [B, 1, hop * N]          (one shot)
decode_step: codes [B, 10, n] + `CodecStreamState` -> the next hop * n samples, exactly equal to
the one-shot decode (every conv is causal, the post-module keeps a window-1 KV cache and an
absolute position). State per request is bounded: conv tails, one transposed-conv input step,
and (window-1) K/V frames per post-module layer.

Served, a reference's encode runs in the engine's encoder stage (`ReferenceEncoding`, its adapter).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from omnivox.layers.streaming_conv import (BatchedState, CausalConv1d, CausalConvTranspose1d, ConvNeXtBlock,
                                           stream_init, stream_step)
from omnivox.layers.window_attention import WindowState
from omnivox.models.fish_s2.codec_layers import (CodecTransformer, ResidualUnit, Snake,
                                                 StridedCausalConv)
from omnivox.models.fish_s2.config import CodecConfig, CodecTransformerConfig
from omnivox.engine.off_route import OffRouteAdapter


class EncoderBlock(nn.Module):
    """3 residual units at dim/2 -> Snake -> strided causal conv dim/2 -> dim [-> transformer]."""

    def __init__(self, dim: int, stride: int, transformer: CodecTransformerConfig | None):
        super().__init__()
        half = dim // 2
        mods: list[nn.Module] = [ResidualUnit(half, 1), ResidualUnit(half, 3), ResidualUnit(half, 9),
                                 Snake(half), StridedCausalConv(half, dim, 2 * stride, stride)]
        if transformer is not None:
            mods.append(CodecTransformer(transformer))
        self.block = nn.ModuleList(mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.block:
            x = m(x.transpose(1, 2)).transpose(1, 2) if isinstance(m, CodecTransformer) else m(x)
        return x


class Encoder(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        d = cfg.encoder_dim
        mods: list[nn.Module] = [CausalConv1d(1, d, 7)]
        for i, stride in enumerate(cfg.encoder_rates):
            d *= 2
            last = i == len(cfg.encoder_rates) - 1
            mods.append(EncoderBlock(d, stride, cfg.encoder_transformer if last else None))
        mods += [Snake(d), CausalConv1d(d, d, 3)]
        self.block = nn.ModuleList(mods)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:  # [B, 1, L] -> [B, latent, L / prod(rates)]
        x = audio
        for m in self.block:
            x = m(x)
        return x


class VectorQuantize(nn.Module):
    """Factorised VQ: 1x1 in_proj to codebook_dim, cosine lookup, out_proj of the raw codebook row."""

    def __init__(self, dim: int, size: int, codebook_dim: int):
        super().__init__()
        self.in_proj = nn.Conv1d(dim, codebook_dim, 1)
        self.out_proj = nn.Conv1d(codebook_dim, dim, 1)
        self.codebook = nn.Embedding(size, codebook_dim)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, C, T] -> (z_q [B, C, T], indices [B, T])."""
        z = F.normalize(self.in_proj(x).transpose(1, 2), dim=-1)  # [B, T, d]
        book = F.normalize(self.codebook.weight, dim=-1)  # [K, d]
        idx = (z @ book.T).argmax(dim=-1)
        return self.decode(idx), idx

    def decode(self, idx: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, C, T]
        return self.out_proj(self.codebook(idx).transpose(1, 2))


class ResidualVQ(nn.Module):
    def __init__(self, n: int, dim: int, size: int, codebook_dim: int):
        super().__init__()
        self.quantizers = nn.ModuleList(VectorQuantize(dim, size, codebook_dim) for _ in range(n))

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, C, T] -> (sum of z_q [B, C, T], codes [B, n, T])."""
        residual, total, codes = x, torch.zeros_like(x), []
        for q in self.quantizers:
            zq, idx = q.encode(residual)
            residual, total = residual - zq, total + zq
            codes.append(idx)
        return total, torch.stack(codes, dim=1)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:  # [B, n, T] -> [B, C, T]
        return sum(q.decode(codes[:, i]) for i, q in enumerate(self.quantizers))


class DownsampleRVQ(nn.Module):
    """Quantizer: 4x down (conv + ConvNeXt), pre-module, semantic VQ + residual VQ; the decode side
    is VQ sum, post-module and 4x up (transposed conv + ConvNeXt)."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        d = cfg.latent_dim
        self.downsample = nn.ModuleList(nn.Sequential(StridedCausalConv(d, d, f, f), ConvNeXtBlock(d))
                                        for f in cfg.downsample_factor)
        self.pre_module = CodecTransformer(cfg.pre_module)
        self.semantic_quantizer = ResidualVQ(1, d, cfg.semantic_codebook_size, cfg.codebook_dim)
        self.quantizer = ResidualVQ(cfg.n_residual, d, cfg.codebook_size, cfg.codebook_dim)
        self.post_module = CodecTransformer(cfg.post_module)
        self.upsample = nn.ModuleList(nn.Sequential(CausalConvTranspose1d(d, d, f, f, look_ahead=False), ConvNeXtBlock(d))
                                      for f in reversed(cfg.downsample_factor))

    def encode(self, z: torch.Tensor) -> torch.Tensor:
        """z [B, latent, 4N] -> codes [B, 1 + n_residual, N]."""
        for stage in self.downsample:
            z = stage(z)
        z = self.pre_module(z.transpose(1, 2)).transpose(1, 2)
        zs, c0 = self.semantic_quantizer.encode(z)
        _, rest = self.quantizer.encode(z - zs)
        return torch.cat((c0, rest), dim=1)

    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        """Clamped codes [B, 10, N] -> z [B, N, latent] (the post-module's input layout)."""
        z = self.semantic_quantizer.decode(codes[:, :1]) + self.quantizer.decode(codes[:, 1:])
        return z.transpose(1, 2)


class DecoderBlock(nn.Module):
    def __init__(self, dim_in: int, dim_out: int, stride: int):
        super().__init__()
        self.block = nn.Sequential(Snake(dim_in), CausalConvTranspose1d(dim_in, dim_out, 2 * stride, stride, look_ahead=False),
                                   ResidualUnit(dim_out, 1), ResidualUnit(dim_out, 3), ResidualUnit(dim_out, 9))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)

    def init_state(self, batch: int, device, dtype: torch.dtype) -> list:
        return stream_init(self.block, batch, device, dtype)

    def step(self, x: torch.Tensor, state: list, skip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return stream_step(self.block, state, x, skip)


class Decoder(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        d = cfg.decoder_dim
        mods: list[nn.Module] = [CausalConv1d(cfg.latent_dim, d, 7)]
        for stride in cfg.decoder_rates:
            mods.append(DecoderBlock(d, d // 2, stride))
            d //= 2
        mods += [Snake(d), CausalConv1d(d, 1, 7), nn.Tanh()]
        self.model = nn.Sequential(*mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, latent, 4N] -> [B, 1, hop*N]
        return self.model(x)


@dataclass
class CodecStreamState(BatchedState):
    """Everything one request's streaming decode carries between chunks (batch-first)."""

    post: WindowState
    upsample: list
    decoder: list


class FishCodec(nn.Module):
    """Top level of `codec.pth`: `encoder`, `quantizer`, `decoder` (names equal the file's keys)."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.quantizer = DownsampleRVQ(cfg)
        self.decoder = Decoder(cfg)

    def reset_buffers(self) -> None:
        for m in self.modules():
            if isinstance(m, CodecTransformer):
                m.reset_buffers()

    @torch.no_grad()
    def encode(self, audio: torch.Tensor) -> torch.Tensor:
        """audio [B, 1, L] (44.1 kHz, zero-padded on the right to a whole frame) -> codes [B, 10, ceil(L/hop)]."""
        hop = self.cfg.hop_length
        pad = (-audio.shape[-1]) % hop
        z = self.encoder(F.pad(audio, (0, pad)))
        return self.quantizer.encode(z)

    def clamp_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """A clamped copy (never mutates the caller's tensor): c0 <= 4095, c1.. <= 1023."""
        limit = torch.full((codes.shape[1], 1), self.cfg.codebook_size - 1, device=codes.device)
        limit[0] = self.cfg.semantic_codebook_size - 1
        return torch.minimum(codes.clamp(min=0), limit)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, 10, N] -> audio [B, 1, hop * N]."""
        z = self.quantizer.post_module(self.quantizer.embed(self.clamp_codes(codes))).transpose(1, 2)
        for stage in self.quantizer.upsample:
            z = stage(z)
        return self.decoder(z)

    def init_stream(self, batch: int, device=None, dtype: torch.dtype = torch.float32) -> CodecStreamState:
        ups = [stream_init(stage, batch, device, dtype) for stage in self.quantizer.upsample]
        return CodecStreamState(post=self.quantizer.post_module.init_state(batch, device, dtype),
                                upsample=ups, decoder=stream_init(self.decoder.model, batch, device, dtype))

    @torch.no_grad()
    def decode_step(self, codes: torch.Tensor, state: CodecStreamState) -> torch.Tensor:
        """n new frames per request, codes [B, 10, n] -> the next hop * n samples [B, 1, hop * n]."""
        z = self.quantizer.post_module.step(self.quantizer.embed(self.clamp_codes(codes)), state.post)
        x = z.transpose(1, 2)  # [B, latent, n]
        skip = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        for stage, st in zip(self.quantizer.upsample, state.upsample):
            x, skip = stream_step(stage, st, x, skip)
        x, _ = stream_step(self.decoder.model, state.decoder, x, skip)
        return x


@dataclass(frozen=True)
class ReferenceEncoding(OffRouteAdapter):
    """Reference waves (float mono at the codec's rate) -> their codes [10, frames], as the encoder
    stage runs them: one codec call per wave. Not batched: waves of different lengths would need
    padding and a frame count per wave; references are rare and short, so a step's few waves
    encode one by one."""
    codec: FishCodec

    @torch.no_grad()
    def encode(self, waves: list[np.ndarray]) -> list[np.ndarray]:
        p = next(self.codec.parameters())
        return [self.codec.encode(torch.from_numpy(w).to(p.device, p.dtype)[None, None])[0].cpu().numpy()
                for w in waves]
