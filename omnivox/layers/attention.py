"""Decoder self-attention (q/k norm, RoPE, GQA) over an explicit KV cache.

Activations are token-major: a stack takes x [N, hidden] (the engine's flattened tokens) or
[B, S, hidden] (offline loops, parity tests), and attention keeps q/k/v as [..., S, H, D]
with no transpose before the cache.

The cache is a seam with one method:

    cache.attend(layer, q [..., S, H, D], k [..., S, Hkv, D], v [..., S, Hkv, D]) -> [..., S, H, D]

`...` is empty (2-D input) or the batch rows (3-D input). The cache stores this step's k/v
(post-RoPE) for `layer`, then returns each query attending causally over its sequence's cached
keys plus the new ones; it owns storage, masking and which rows form a sequence, and may
transpose internally for SDPA. H is a multiple of Hkv (query head i reads kv head i // (H/Hkv)).
Implementations: `DenseKVCache` (one contiguous tensor per layer: offline generation, the code
predictor), the engine's `stages.step.PagedContext` (pages of a pool through an attention backend) and
S2's `FastKVCache` (a preallocated per-frame cache).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from omnivox.layers.collectives import Collectives
from omnivox.layers.merged import MergedLinear, keep_checkpoint_names
from omnivox.layers.norm import RMSNorm
from omnivox.layers.rotary import Rotary



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


class StaticKVCache:
    """Preallocated per-layer K/V [capacity, max_len, Hkv, D] for a short fixed-shape inner loop
    (the code predictor's frame): `begin(B)` rewinds; each call writes its S new positions of
    rows [0, B) at the shared position and attends over exactly positions [0, pos + S): the
    values and lengths a cache grown by concatenation would hold, with no allocation per step.
    Rows are requests: q [B, S, H, D], or q [B, H, D] for one token per row."""

    def __init__(self, n_layer: int, max_len: int, reserve: int = 0):
        self.n_layer, self.max_len = n_layer, max_len
        self.reserve = reserve  # rows allocated at once (NOTE: growing later would leave captured graphs stale)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.rows = self.pos = 0

    def begin(self, rows: int) -> "StaticKVCache":
        self.rows, self.pos = rows, 0
        return self

    def _ensure(self, k: torch.Tensor) -> None:
        have = self.keys[0].shape[0] if self.keys else 0
        if have >= self.rows and self.keys[0].dtype == k.dtype and self.keys[0].device == k.device:
            return
        shape = (max(self.rows, 2 * have, self.reserve), self.max_len, *k.shape[-2:])
        self.keys = [k.new_zeros(shape) for _ in range(self.n_layer)]
        self.values = [k.new_zeros(shape) for _ in range(self.n_layer)]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        one = q.dim() == 3  # one token per row
        if one:
            q, k, v = q[:, None], k[:, None], v[:, None]
        self._ensure(k)
        end = self.pos + q.shape[1]
        keys, values = self.keys[layer][:self.rows], self.values[layer][:self.rows]
        keys[:, self.pos:end], values[:, self.pos:end] = k, v
        out = causal_attention(q, keys[:, :end], values[:, :end])
        if layer == self.n_layer - 1:
            self.pos = end
        return out[:, 0] if one else out


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

    def forward(self, x: torch.Tensor, rope: Rotary, cache, layer: int) -> torch.Tensor:
        """x [..., S, hidden] -> [..., S, hidden]."""
        qkv = self.qkv_proj(x).unflatten(-1, (-1, self.head_dim))  # [..., S, H+2Hkv, D]
        qk, v = qkv.split((self.heads + self.kv_heads, self.kv_heads), dim=-2)
        q, k = rope(self.qk_norm(qk)).split((self.heads, self.kv_heads), dim=-2)
        # [..., S, H, D]; the cache (dense or the engine's pages) owns storage and masking
        out = causal_attention(q, k, v) if cache is None else cache.attend(layer, q, k, v)
        out = self.o_proj(out.flatten(-2))  # [..., S, hidden] (tp: this rank's heads' share)
        return out if self.tp is None else self.tp.all_reduce(out)
