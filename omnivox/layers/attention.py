"""Decoder self-attention (q/k norm, RoPE, GQA) over an explicit KV cache.

Activations are token-major: a stack takes x [N, hidden] (the engine's flattened tokens) or
[B, S, hidden] (offline loops, parity tests), and attention keeps q/k/v as [..., S, H, D]
with no transpose before the cache.

The cache is a seam with one method, `KVCache.attend` (its docstring is the contract):

    cache.attend(layer, q [..., S, H, D], k [..., S, Hkv, D], v [..., S, Hkv, D]) -> [..., S, H, D]

Implementations: `DenseKVCache` (one contiguous tensor per layer: offline generation),
`FrameKVCache` (preallocated, for the fixed-shape per-frame inner loops: Qwen3-Omni's code
predictor, S2's fast AR) and the engine's `stages.step.PagedContext` (pages of a pool through an
attention backend).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from omnivox.layers.collectives import Collectives
from omnivox.layers.merged import MergedLinear, keep_checkpoint_names
from omnivox.layers.norm import RMSNorm
from omnivox.layers.rotary import Rotary



class KVCache(Protocol):
    """Where a decoder's attention keeps its keys and values, and how it attends over them."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [..., S, H, D], k/v [..., S, Hkv, D] (post-RoPE) -> [..., S, H, D].

        `...` is empty (2-D input: the flattened tokens of a step, or one token per row of an
        inner loop) or the batch rows (3-D input). Stores this step's k/v for `layer`, then
        returns each query attending causally over its sequence's cached keys plus the new ones.
        The cache owns storage, masking and which rows form a sequence, and may transpose
        internally for SDPA. H is a multiple of Hkv (query head i reads kv head i // (H/Hkv)).
        Layers are called in order 0..n_layer-1 per step; a cache that tracks positions advances
        after the last one.
        """
        ...


@dataclass
class DenseKVCache:
    """Per-layer K/V of shape [..., T, Hkv, D] (token-major, like the inputs), grown by concatenation."""

    keys: list[torch.Tensor | None] = field(default_factory=list)
    values: list[torch.Tensor | None] = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if not self.keys or self.keys[0] is None else self.keys[0].shape[-3]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append this step's k/v [..., S, Hkv, D] and attend causally over everything cached."""
        k, v = self.update(layer, k, v)
        return causal_attention(q, k, v)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self.keys) <= layer:
            self.keys.append(None)
            self.values.append(None)
        if self.keys[layer] is not None:
            k = torch.cat((self.keys[layer], k), dim=-3)
            v = torch.cat((self.values[layer], v), dim=-3)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class FrameKVCache:
    """Preallocated per-layer K/V [capacity, max_len, Hkv, D] for a short fixed-shape inner loop
    (a frame of Qwen3-Omni's code predictor or S2's fast AR): `rewind()` starts a frame; each
    `attend` writes its S new positions of rows [0, B) at the shared position `pos` and attends
    causally over positions [0, pos + S), with no allocation per step. Rows are requests:
    q [B, S, H, D], or q [B, H, D] for one token per row (2-D input, the per-frame inner loop).
    Rewinding never zeroes: entries at or beyond pos + S are stale rows of an earlier frame.

    Two ways to attend, each bit-identical to its family's reference (SDPA over a longer,
    masked key axis reduces in a different order than over exactly the live keys):
    - `fixed_shape=False` (code predictor): slice the keys to [0, pos + S), the values and
      lengths transformers' growing cache holds.
    - `fixed_shape=True` (S2's fast AR): attend over all max_len keys with an additive causal
      mask, as fish-speech's fixed-size cache does; the key shape never changes.
    Either way every shape depends only on the step within the frame and on B, so a CUDA graph
    of a whole frame (the Talker's step, S2's slow + fast AR step) replays it.
    """

    def __init__(self, n_layer: int, max_len: int, reserve: int = 0, fixed_shape: bool = False):
        self.n_layer, self.max_len, self.fixed_shape = n_layer, max_len, fixed_shape
        self.reserve = reserve  # rows allocated at once (NOTE: growing later would leave captured graphs stale)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.pos = 0
        self._mask: tuple[tuple, torch.Tensor] | None = None  # fixed_shape: (key, [S, max_len] mask)

    def rewind(self) -> "FrameKVCache":
        self.pos = 0
        return self

    def _ensure(self, k: torch.Tensor) -> None:
        """Room for B rows of k [B, S, Hkv, D] (kept across frames and batch sizes: rows [0, B) are used)."""
        have = self.keys[0] if self.keys else None
        if (have is not None and have.shape[0] >= k.shape[0] and have.shape[2:] == k.shape[2:]
                and have.dtype == k.dtype and have.device == k.device):
            return
        rows = max(k.shape[0], 2 * have.shape[0] if have is not None else 0, self.reserve)
        shape = (rows, self.max_len, *k.shape[2:])
        self.keys = [k.new_zeros(shape) for _ in range(self.n_layer)]
        self.values = [k.new_zeros(shape) for _ in range(self.n_layer)]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """`KVCache.attend` at positions pos..pos+S-1 of rows [0, B)."""
        one = q.dim() == 3  # one token per row
        if one:
            q, k, v = q[:, None], k[:, None], v[:, None]  # [B, 1, H|Hkv, D]
        self._ensure(k)
        end = self.pos + q.shape[1]
        keys, values = self.keys[layer][:q.shape[0]], self.values[layer][:q.shape[0]]  # [B, L, Hkv, D]
        keys[:, self.pos:end], values[:, self.pos:end] = k, v
        if self.fixed_shape:
            out = masked_attention(q, keys, values, self._causal_mask(q.shape[1], q.dtype, q.device))
        else:
            out = causal_attention(q, keys[:, :end], values[:, :end])
        if layer == self.n_layer - 1:
            self.pos = end
        return out[:, 0] if one else out

    def _causal_mask(self, s: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Additive [S, max_len] mask for queries at pos..pos+S-1; built once per step, shared by the layers."""
        key = (self.pos, s, dtype, device)
        if self._mask is None or self._mask[0] != key:
            qpos = torch.arange(self.pos, self.pos + s, device=device)[:, None]
            self._mask = key, additive_mask(torch.arange(self.max_len, device=device)[None, :] <= qpos, dtype)
        return self._mask[1]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [..., S, H, D] attends causally to k/v [..., P+S, Hkv, D] whose last S rows are q's own
    -> [..., S, H, D]. `...` is empty or one batch axis."""
    if q.dim() == 3:  # NOTE: SDPA's fused CPU kernel needs a batch axis (3-D inputs take another path)
        return causal_attention(q[None], k[None], v[None])[0]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, S, D] views
    gqa = q.shape[1] != k.shape[1]
    s, total = q.shape[2], k.shape[2]
    if s == 1:
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    elif s == total:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    else:  # additive: SDPA turns a bool mask into exactly this, once per call
        mask = torch.full((s, total), float("-inf"), dtype=q.dtype, device=q.device).triu(total - s + 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return out.transpose(1, 2)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, S, H, D] over k/v [B, L, Hkv, D] with an additive mask [S, L] -> [B, S, H, D]."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, S, D] views
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = may attend) as SDPA's float form (0 / -inf in `dtype`), the exact
    tensor SDPA would build from the bool mask on every call; build it once per forward."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


class DecoderAttention(nn.Module):
    """q/k/v/o projections without bias, per-head RMSNorm on q and k before RoPE.

    Checkpoint names q_proj / k_proj / v_proj / q_norm / k_norm are kept; they load into one
    `qkv_proj` and one `qk_norm` (normalising the H + Hkv heads of q and k in one call).

    Tensor parallel (`parallel/shard.py`): a rank holds a contiguous group of H/N q heads and
    Hkv/N kv heads (`heads`/`kv_heads` are then the local counts), `o_proj` the input columns of
    those heads, and `tp` sums the ranks' partial outputs.
    """

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.qkv_proj = MergedLinear(hidden, {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim,
                                              "v_proj": kv_heads * head_dim})
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.qk_norm = RMSNorm(head_dim, eps, heads={"q_norm": heads, "k_norm": kv_heads})
        keep_checkpoint_names(self)
        self.tp: Collectives | None = None

    def forward(self, x: torch.Tensor, rope: Rotary, cache: KVCache | None, layer: int) -> torch.Tensor:
        """x [..., S, hidden] -> [..., S, hidden]."""
        qkv = self.qkv_proj(x).unflatten(-1, (-1, self.head_dim))  # [..., S, H+2Hkv, D]
        qk, v = qkv.split((self.heads + self.kv_heads, self.kv_heads), dim=-2)
        q, k = rope(self.qk_norm(qk)).split((self.heads, self.kv_heads), dim=-2)
        # [..., S, H, D]; the cache (dense, per-frame or the engine's pages) owns storage and masking
        out = causal_attention(q, k, v) if cache is None else cache.attend(layer, q, k, v)
        out = self.o_proj(out.flatten(-2))  # [..., S, hidden] (tp: this rank's heads' share)
        return out if self.tp is None else self.tp.all_reduce(out)
