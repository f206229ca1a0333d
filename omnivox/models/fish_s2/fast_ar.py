"""Fast AR: a small decoder over the codebook axis, one frame at a time (spec 9).

Position 0 takes the slow AR's hidden state, position p >= 1 takes E_fast[c_{p-1}] and predicts
c_p. `decode_frame` runs the 10 single-token passes batched across requests over a static
`FrameKVCache` that is rewound, never zeroed, between frames.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from omnivox.layers.attention import FrameKVCache, KVCache
from omnivox.layers.rotary import Rotary
from omnivox.models.fish_s2.blocks import Block, FishRMSNorm, interleaved_rope, rope_freqs
from omnivox.models.fish_s2.config import FishConfig


class FastAR(nn.Module):
    """Attribute names equal the checkpoint's under `audio_decoder.` (minus codebook_embeddings)."""

    def __init__(self, cfg: FishConfig):
        super().__init__()
        f = cfg.fast
        self.cfg = cfg
        self.embeddings = nn.Embedding(cfg.codebook_size, f.dim)
        self.layers = nn.ModuleList(
            Block(f.dim, f.n_head, f.n_local_heads, f.head_dim, f.intermediate_size, f.qk_norm, f.norm_eps)
            for _ in range(f.n_layer))
        self.norm = FishRMSNorm(f.dim, f.norm_eps)
        self.output = nn.Linear(f.dim, cfg.codebook_size, bias=False)
        self.register_buffer("freqs", rope_freqs(f.head_dim, f.rope_base), persistent=False)
        self._ropes: dict = {}

    def reset_buffers(self) -> None:
        self.freqs = rope_freqs(self.cfg.fast.head_dim, self.cfg.fast.rope_base, device=self.norm.weight.device)
        self._ropes = {}

    def new_cache(self, rows: int = 0) -> FrameKVCache:
        """The frame's cache (room for `rows` rows at first use): fixed shape and masked over all
        num_codebooks positions, like fish-speech's cache (the tests compare codes exactly)."""
        return FrameKVCache(self.cfg.fast.n_layer, self.cfg.num_codebooks, reserve=rows, fixed_shape=True)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None, cache: KVCache | None = None,
                rope: Rotary | None = None) -> torch.Tensor:
        """x [B, S, dim] input vectors at positions [B, S] -> logits [B, S, K]; or x [B, dim] at
        positions [B], one token per request row (with a `FrameKVCache`) -> logits [B, K].
        `rope`: the positions' RoPE, when the caller computed it already."""
        rope = rope or interleaved_rope(positions, self.freqs, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, cache, i)
        return self.output(self.norm(x))

    def rope_at(self, p: int, x: torch.Tensor) -> Rotary:
        """The RoPE of inner position p for one token per row (any number of rows), cached."""
        key = (p, x.dtype, x.device)
        if key not in self._ropes:
            self._ropes[key] = interleaved_rope(torch.tensor([p], device=x.device), self.freqs, x.dtype)
        return self._ropes[key]

    def teacher_forced(self, h: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """One causal pass over [h, E[c0], ..., E[c_{N-2}]]: h [B, dim], codes [B, N] -> logits [B, N, K]."""
        x = torch.cat((h[:, None], self.embeddings(codes[:, :-1])), dim=1)  # [B, N, dim]
        pos = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        return self.forward(x, pos, None)


Sample = Callable[[torch.Tensor, int], torch.Tensor]  # (logits [B, K], codebook index) -> codes [B]


def decode_frame(fast: FastAR, h: torch.Tensor, c0: torch.Tensor, cache: FrameKVCache,
                 sample: Sample) -> torch.Tensor:
    """The per-frame inner loop, batched over B requests: h [B, dim], c0 [B] -> codes [B, N].

    10 sequential single-token passes at positions 0..N-1; position 0's logits are unused.
    """
    n = fast.cfg.num_codebooks
    cache.rewind()
    codes = [c0]
    x = h  # [B, dim]: one token per request row
    for p in range(n):
        logits = fast(x, None, cache, rope=fast.rope_at(p, x))  # [B, K]
        if p == 0:
            x = fast.embeddings(c0)
            continue
        code = sample(logits, p)
        codes.append(code)
        x = fast.embeddings(code)
    return torch.stack(codes, dim=1)  # [B, N]
