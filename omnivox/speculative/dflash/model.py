"""The DFlash draft network: Qwen3 decoder layers (checkpoint names `layers.*`), `fc` and
`hidden_norm` over the target's features, the final `norm`; no embedding and no LM head of its
own (the Thinker's serve: `DFlashDrafter`).

Two passes, both over paged context K/V (the draft's pool shares the Thinker's page ids):
- `write_context` (inside the Thinker's step, for every token it computes): the target features
  -> `hidden_norm(fc(.))` -> each layer's k/v projections, `k_norm` and 1-D RoPE at the token's
  sequence index -> written at the token's slot. The context goes through no layer: every layer
  projects the same fused context, as the reference does.
- `block` (one forward per drafting row): the block [anchor, mask x (block - 1)] at positions
  computed..computed + block - 1; in every layer queries come from the block only, keys and
  values from the row's context (positions [0, computed)) then the block's own, attended WITHOUT a
  causal mask (every block position sees the whole block).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from omnivox.kv_cache.pool import KVPool
from omnivox.layers.attention import DecoderAttention, additive_mask, masked_attention
from omnivox.layers.mlp import SwiGLU
from omnivox.layers.norm import RMSNorm
from omnivox.layers.rotary import Rotary, inv_freq, rotate_half_rope
from omnivox.speculative.dflash.config import DFlashConfig


@dataclass
class BlockLayout:
    """Where each drafting row's context lives in the pool: `kv_index` [R * T] the slot of context
    position t of row r (positions t >= computed read the row's first slot, masked), `mask`
    [R, 1, 1, T + block] additive (0: attend), `positions` [R, block] the block's sequence indices."""

    kv_index: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    width: int  # T

    @classmethod
    def build(cls, tables: list[list[int]], computed: list[int], block: int, block_size: int, dummy_slot: int,
              dtype: torch.dtype, device: torch.device | str) -> "BlockLayout":
        """Host side, vectorised; one copy of each tensor."""
        rows, width = len(computed), max(max(computed, default=0), 1)
        t = np.arange(width)
        index = np.full((rows, width), dummy_slot, dtype=np.int64)
        for r, (table, n) in enumerate(zip(tables, computed)):
            if n:
                pages = np.asarray(table, dtype=np.int64)[np.minimum(t, n - 1) // block_size]
                index[r] = np.where(t < n, pages * block_size + t % block_size, pages[0] * block_size)
        seen = np.concatenate([t[None] < np.asarray(computed)[:, None], np.ones((rows, block), bool)], axis=1)
        pos = np.asarray(computed, dtype=np.int64)[:, None] + np.arange(block)
        mask = additive_mask(torch.from_numpy(seen).to(device), dtype)[:, None, None, :]
        return cls(torch.from_numpy(index.reshape(-1)).to(device), mask, torch.from_numpy(pos).to(device), width)


class DFlashLayer(nn.Module):
    """One draft layer: Qwen3 attention (q/k/v/o, q_norm/k_norm) whose keys and values are the
    context's then the block's, and a SwiGLU MLP."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.self_attn = DecoderAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                          c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def project(self, x: torch.Tensor, rope: Rotary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., S, H] -> q [..., S, Hq, D], k and v [..., S, Hkv, D] (normed, rotated)."""
        a = self.self_attn
        qkv = a.qkv_proj(x).unflatten(-1, (-1, a.head_dim))
        qk, v = qkv.split((a.heads + a.kv_heads, a.kv_heads), dim=-2)
        q, k = rope(a.qk_norm(qk)).split((a.heads, a.kv_heads), dim=-2)
        return q, k, v

    def forward(self, x: torch.Tensor, rope: Rotary, pool: KVPool, layer: int, lay: BlockLayout) -> torch.Tensor:
        """x [R, B, H] (the blocks) -> [R, B, H]."""
        rows, block = x.shape[:2]
        q, k, v = self.project(self.input_layernorm(x), rope)
        kv_heads, d = k.shape[-2:]
        ctx_k = pool.k[layer].index_select(0, lay.kv_index).view(rows, lay.width, kv_heads, d)
        ctx_v = pool.v[layer].index_select(0, lay.kv_index).view(rows, lay.width, kv_heads, d)
        out = masked_attention(q, torch.cat([ctx_k, k], dim=1), torch.cat([ctx_v, v], dim=1), lay.mask)
        x = x + self.self_attn.o_proj(out.flatten(-2))
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraft(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.cfg = c
        self.layers = nn.ModuleList(DFlashLayer(c) for _ in range(c.num_hidden_layers))
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.register_buffer("inv_freq", inv_freq(c.head_dim, c.rope_theta), persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        return rotate_half_rope(positions, self.inv_freq, dtype)

    def write_context(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      pool: KVPool) -> None:
        """features [N, len(target_layer_ids) * H] of tokens at sequence `positions` [N] -> their
        context K/V in every layer's pages at `slots` [N]. Device only."""
        c = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))  # [N, H]
        rope = self.rope(positions, c.dtype)
        for i, layer in enumerate(self.layers):
            _, k, v = layer.project(c, rope)
            pool.k[i].index_copy_(0, slots, k)
            pool.v[i].index_copy_(0, slots, v)

    def block(self, x: torch.Tensor, pool: KVPool, lay: BlockLayout) -> torch.Tensor:
        """x [R, B, H] the blocks' input rows -> final-normed hidden states [R, B, H]."""
        rope = self.rope(lay.positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, pool, i, lay)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        """The Thinker's `head` over the draft's hidden states, with the draft's output scaling."""
        out = head(hidden).float() * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        return torch.tanh(out / cap) * cap if cap else out
