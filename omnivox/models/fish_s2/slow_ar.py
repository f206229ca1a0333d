"""Slow AR: the Qwen3-shaped decoder that takes one step per codec frame (spec 7).

Input per position is a column of the prompt matrix: a token id plus `num_codebooks` codes.
Semantic positions fuse the codes into the embedding (MCF, spec 7.5); text positions ignore them.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from omnivox.models.fish_s2.blocks import Block, FishRMSNorm, interleaved_rope, rope_freqs
from omnivox.models.fish_s2.config import FishConfig


class SlowOutput(NamedTuple):
    residual: torch.Tensor  # [B, S, dim] (or [N, dim]) last layer's output before the final norm
    hidden: torch.Tensor  # [B, S, dim] (or [N, dim]) after the final RMSNorm (feeds the head)


class SlowAR(nn.Module):
    """Attribute names equal the checkpoint's under `text_model.model.` (plus `codebook_embeddings`,
    stored under `audio_decoder.` but used here)."""

    def __init__(self, cfg: FishConfig):
        super().__init__()
        t = cfg.text
        self.cfg = cfg
        self.embeddings = nn.Embedding(t.vocab_size, t.dim)
        self.codebook_embeddings = nn.Embedding(cfg.codebook_size * cfg.num_codebooks, t.dim)
        self.layers = nn.ModuleList(
            Block(t.dim, t.n_head, t.n_local_heads, t.head_dim, t.intermediate_size, t.qk_norm, t.norm_eps)
            for _ in range(t.n_layer))
        self.norm = FishRMSNorm(t.dim, t.norm_eps)
        if not t.tie_word_embeddings:
            self.output = nn.Linear(t.dim, t.vocab_size, bias=False)
        self.register_buffer("freqs", rope_freqs(t.head_dim, t.rope_base), persistent=False)
        self.register_buffer("codebook_offsets", self._offsets(None), persistent=False)

    def _offsets(self, device) -> torch.Tensor:
        return torch.arange(self.cfg.num_codebooks, device=device) * self.cfg.codebook_size  # [N]

    def reset_buffers(self) -> None:
        """Recompute non-persistent tables on the weights' device (after meta-device loading)."""
        dev = self.norm.weight.device
        self.freqs = rope_freqs(self.cfg.text.head_dim, self.cfg.text.rope_base, device=dev)
        self.codebook_offsets = self._offsets(dev)

    def embed(self, ids: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """ids [..., S], codes [..., S, N] -> [..., S, dim]. Semantic positions: (Emb[t] + sum_i CB[i*K + c_i])
        / sqrt(N+1), summing the codes first, all in the embedding dtype; text positions: Emb[t]."""
        cfg = self.cfg
        emb = self.embeddings(ids)  # [B, S, dim]
        semantic = (ids >= cfg.semantic_begin) & (ids <= cfg.semantic_end)  # [B, S]
        safe = torch.where(semantic[..., None], codes, torch.zeros_like(codes))
        safe = safe.clamp(0, cfg.codebook_size - 1)
        fused = self.codebook_embeddings(safe + self.codebook_offsets).sum(dim=-2) + emb  # [B, S, dim]
        if cfg.scale_codebook_embeddings:
            fused = fused / math.sqrt(cfg.num_codebooks + 1)
        return torch.where(semantic[..., None], fused, emb)

    def forward(self, ids: torch.Tensor, codes: torch.Tensor, positions: torch.Tensor, cache=None) -> SlowOutput:
        """ids [B, S], codes [B, S, N], positions [B, S] -> SlowOutput; or the flattened tokens
        ids [T], codes [T, N], positions [T]. With `cache` None the S positions attend causally
        among themselves only."""
        x = self.embed(ids, codes)
        rope = interleaved_rope(positions, self.freqs, x.dtype)  # bf16 tables, once per forward
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, cache, i)
        return SlowOutput(x, self.norm(x))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., dim] -> [..., vocab]; tied to `embeddings` unless the config unties it."""
        weight = self.embeddings.weight if self.cfg.text.tie_word_embeddings else self.output.weight
        return hidden @ weight.T

    def fast_input(self, out: SlowOutput) -> torch.Tensor:
        """What the fast AR receives: post-norm (S2 Pro) or pre-norm (S1-mini) state."""
        return out.hidden if self.cfg.norm_fastlayer_input else out.residual
