"""The causal sliding-window streaming transformer of the vocoders' pre-nets (Qwen3-Omni's
Code2Wav, S2's codec), and its per-request state.

A stream keeps the post-RoPE K/V of its last `window - 1` frames per layer and its absolute
position; a step of n new frames attends over those plus itself, masked to the window. The
one-shot `forward` is the same computation from an empty state, so a stream's steps,
concatenated, equal it.

`WindowTransformer` is the one implementation; a family subclasses it with its checkpoint-named
layers (`layers`, each `(x, rope, past_k, past_v, mask) -> (x, k, v)`), its final `norm` and its
RoPE tables (`rope`), and says how many K/V heads of which size its layers cache.
"""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from omnivox.layers.attention import additive_mask
from omnivox.layers.rotary import Rotary
from omnivox.layers.streaming_conv import BatchedState


@dataclass
class WindowState(BatchedState):
    """Per-request context of a windowed transformer, one row per request."""

    keys: list[torch.Tensor]  # per layer [B, kv_heads, window-1, head_dim]
    values: list[torch.Tensor]  # per layer [B, kv_heads, window-1, head_dim]
    pos: torch.Tensor  # [B] long: frames seen so far = absolute position of the next frame


def window_mask(start: torch.Tensor, n: int, cached: int, window: int, ring_chunk: int | None = None) -> torch.Tensor:
    """[B, 1, n, cached+n] bool: query i (absolute start+i) may read key j (absolute
    start-cached+j) iff 0 <= query - key < window and the key exists (absolute >= 0).

    With `ring_chunk` c (moshi's RingKVCache of `window` entries, written c steps per call), the
    keys of query i's whole chunk are written before it reads, evicting the oldest: it also needs
    key >= (its chunk's exclusive end) - window, so a chunk's first query sees window - c + 1 keys."""
    i = torch.arange(n, device=start.device)[:, None]
    j = torch.arange(cached + n, device=start.device)[None, :]
    rel = cached + i - j  # [n, cached+n] query minus key position
    band = (rel >= 0) & (rel < window)
    if ring_chunk is not None:
        band &= j >= cached + (i // ring_chunk + 1) * ring_chunk - window
    exists = j[None] >= cached - start[:, None, None]  # [B, 1, cached+n]
    return (band[None] & exists)[:, None]


class LayerScale(nn.Module):
    """Per-channel scale of a residual branch; `name` is the checkpoint's parameter name."""

    def __init__(self, dim: int, name: str = "scale"):
        super().__init__()
        self.name = name
        self.register_parameter(name, nn.Parameter(torch.ones(dim)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.name) * x


class WindowTransformer(nn.Module):
    """Causal window-`window` transformer over frames [B, T, C]; positions are absolute from the
    stream start. Subclasses set `layers`, `norm`, `window`, `kv_heads`, `head_dim` and `rope`."""

    layers: nn.ModuleList
    norm: nn.Module
    window: int
    kv_heads: int
    head_dim: int
    additive: bool = False  # pass SDPA the float (0 / -inf) mask, built once, instead of the bool one
    one_shot_chunk: int | None = None  # forward over longer inputs runs in steps of this many frames
    ring_chunk: int | None = None  # moshi's ring cache written this many frames per call (see window_mask)

    @abstractmethod
    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        """The RoPE of a forward at `positions` [B, n], laid out for the family's attention."""

    def forward(self, x: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
        """One shot at positions 0..T-1: [B, T, C] -> [B, T, C].

        NOTE: with a `chunk` (default `one_shot_chunk`), long inputs (a 30 s S2 reference is ~2600 encoder frames) run
        in query chunks over the carried window state, so memory is O(T * window), never T x T.
        """
        b, chunk = x.shape[0], chunk or self.one_shot_chunk
        if chunk is not None and x.shape[1] > 2 * chunk:
            state = self.init_state(b, x.device, x.dtype)
            return torch.cat([self.step(part, state) for part in x.split(chunk, dim=1)], dim=1)
        empty = [x.new_zeros(b, self.kv_heads, 0, self.head_dim)] * len(self.layers)
        return self._run(x, torch.zeros(b, dtype=torch.long, device=x.device), empty, empty)[0]

    def init_state(self, batch: int, device, dtype: torch.dtype) -> WindowState:
        shape = (batch, self.kv_heads, self.window - 1, self.head_dim)
        keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in self.layers]
        return WindowState(keys, [k.clone() for k in keys], torch.zeros(batch, dtype=torch.long, device=device))

    def step(self, x: torch.Tensor, state: WindowState) -> torch.Tensor:
        """n new frames per row [B, n, C] at positions state.pos.. -> [B, n, C]; state keeps W-1 frames."""
        out, keys, values = self._run(x, state.pos, state.keys, state.values)
        keep = self.window - 1  # views of the last W-1 (no copy: the next step's concatenation is the one copy)
        state.keys = [k[:, :, k.shape[2] - keep:] for k in keys]
        state.values = [v[:, :, v.shape[2] - keep:] for v in values]
        state.pos = state.pos + x.shape[1]
        return out

    def _run(self, x, start, past_k, past_v):
        n = x.shape[1]
        rope = self.rope(start[:, None] + torch.arange(n, device=x.device), x.dtype)  # positions [B, n]
        # once, not per layer; NOTE: with a ring_chunk, every row's start is a multiple of it
        mask = window_mask(start, n, past_k[0].shape[2], self.window, self.ring_chunk)
        if self.additive:
            mask = additive_mask(mask, x.dtype)
        keys, values = [], []
        for layer, pk, pv in zip(self.layers, past_k, past_v):
            x, k, v = layer(x, rope, pk, pv, mask)
            keys.append(k)
            values.append(v)
        return self.norm(x), keys, values
