"""Causal sliding-window attention state for streaming transformers (the vocoders' pre-nets).

A stream keeps the post-RoPE K/V of its last `window - 1` frames per layer and its absolute
position; a step of n new frames attends over those plus itself, masked to the window.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from omnivox.layers.streaming_conv import BatchedState


@dataclass
class WindowState(BatchedState):
    """Per-request context of a windowed transformer, one row per request."""

    keys: list[torch.Tensor]  # per layer [B, kv_heads, window-1, head_dim]
    values: list[torch.Tensor]  # per layer [B, kv_heads, window-1, head_dim]
    pos: torch.Tensor  # [B] long: frames seen so far = absolute position of the next frame


def window_mask(start: torch.Tensor, n: int, cached: int, window: int) -> torch.Tensor:
    """[B, 1, n, cached+n] bool: query i (absolute start+i) may read key j (absolute
    start-cached+j) iff 0 <= query - key < window and the key exists (absolute >= 0)."""
    i = torch.arange(n, device=start.device)[:, None]
    j = torch.arange(cached + n, device=start.device)[None, :]
    rel = cached + i - j  # [n, cached+n] query minus key position
    band = (rel >= 0) & (rel < window)
    exists = j[None] >= cached - start[:, None, None]  # [B, 1, cached+n]
    return (band[None] & exists)[:, None]
