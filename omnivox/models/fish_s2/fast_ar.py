"""Fast AR: a small decoder over the codebook axis, one frame at a time (spec 9).

Position 0 takes the slow AR's hidden state, position p >= 1 takes E_fast[c_{p-1}] and predicts
c_p. `decode_frame` runs the 10 single-token passes batched across requests over a static
`FastKVCache` that is rewound, never zeroed, between frames.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F

from omnivox.layers.attention import additive_mask
from omnivox.layers.rotary import Rotary
from omnivox.models.fish_s2.blocks import Block, FishRMSNorm, interleaved_rope, rope_freqs
from omnivox.models.fish_s2.config import FishConfig


class FastKVCache:
    """Preallocated per-layer K/V [B, max_len, Hkv, D] with one shared write position.

    `attend` writes this step's k/v at `pos` and attends causally over [0, pos + S); entries at
    or beyond that are stale rows of earlier frames and are masked, so `reset()` only rewinds.
    Rows are requests: q [B, S, H, D] (3-D input), or q [B, H, D] when the input is the
    flattened tokens of B requests, one token each (2-D input, the per-frame inner loop).
    """

    def __init__(self, n_layer: int, max_len: int, reserve: int = 0):
        self.n_layer, self.max_len = n_layer, max_len
        self.reserve = reserve  # rows allocated at once (NOTE: growing later would leave captured graphs stale)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.pos = 0
        self._mask: tuple[tuple, torch.Tensor] | None = None

    def reset(self) -> None:
        self.pos = 0

    def _ensure(self, k: torch.Tensor) -> None:
        """Room for B rows (kept across frames and batch sizes: rows [0, B) are used)."""
        b, hkv, d = k.shape[0], k.shape[-2], k.shape[-1]
        if self.keys and self.keys[0].shape[0] >= b and self.keys[0].shape[2] == hkv and self.keys[0].dtype == k.dtype:
            return
        shape = (max(b, 2 * self.keys[0].shape[0] if self.keys else b, self.reserve), self.max_len, hkv, d)
        self.keys = [k.new_zeros(shape) for _ in range(self.n_layer)]
        self.values = [k.new_zeros(shape) for _ in range(self.n_layer)]

    def _causal_mask(self, s: int, dtype: torch.dtype, device) -> torch.Tensor:
        """Additive [S, max_len] mask for queries at pos..pos+S-1; built once per step, shared by the layers."""
        key = (self.pos, s, dtype, device)
        if self._mask is None or self._mask[0] != key:
            qpos = torch.arange(self.pos, self.pos + s, device=device)[:, None]
            self._mask = key, additive_mask(torch.arange(self.max_len, device=device)[None, :] <= qpos, dtype)
        return self._mask[1]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, S, H, D], k/v [B, S, Hkv, D] at positions pos..pos+S-1 -> [B, S, H, D]
        (or [B, H, D] / [B, Hkv, D] -> [B, H, D]: one token per row, at pos)."""
        rows = q.dim() == 3
        self._ensure(k)
        s = 1 if rows else q.shape[1]
        end = self.pos + s
        keys, values = self.keys[layer][:q.shape[0]], self.values[layer][:q.shape[0]]  # [B, L, Hkv, D]
        if rows:
            keys[:, self.pos], values[:, self.pos] = k, v
        else:
            keys[:, self.pos:end], values[:, self.pos:end] = k, v
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, Hkv, L, D]
        qh = q.unsqueeze(2) if rows else q.transpose(1, 2)  # [B, H, S, D]
        out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=self._causal_mask(s, q.dtype, q.device),
                                             enable_gqa=qh.shape[1] != keys.shape[1])
        if layer == self.n_layer - 1:
            self.pos = end
        return out.squeeze(2) if rows else out.transpose(1, 2)


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

    def new_cache(self, rows: int = 0) -> FastKVCache:
        return FastKVCache(self.cfg.fast.n_layer, self.cfg.num_codebooks, reserve=rows)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache=None, rope: Rotary | None = None) -> torch.Tensor:
        """x [B, S, dim] input vectors at positions [B, S] -> logits [B, S, K]; or x [B, dim] at
        positions [B], one token per request row (with a `FastKVCache`) -> logits [B, K].
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


def decode_frame(fast: FastAR, h: torch.Tensor, c0: torch.Tensor, cache: FastKVCache,
                 sample: Sample) -> torch.Tensor:
    """The per-frame inner loop, batched over B requests: h [B, dim], c0 [B] -> codes [B, N].

    10 sequential single-token passes at positions 0..N-1; position 0's logits are unused.
    """
    n = fast.cfg.num_codebooks
    cache.reset()
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
