"""The decoder stack shared by the Thinker, the Talker and the code predictor.

A stack owns `layers` and `norm` (checkpoint names) and computes final-normed hidden
states for given input embeddings and explicit positions; sampling lives elsewhere.
"""
from __future__ import annotations

import torch
from torch import nn

from omnivox.layers.attention import DecoderAttention, KVCache
from omnivox.layers.mlp import SwiGLU
from omnivox.layers.moe import SparseMoE
from omnivox.layers.norm import RMSNorm
from omnivox.layers.rotary import Rotary, inv_freq, rotate_half_rope
from omnivox.models.qwen3_omni.config import DecoderConfig


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.self_attn = DecoderAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          cfg.head_dim, cfg.rms_norm_eps)
        if cfg.num_experts:
            self.mlp = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size,
                                 cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.shared_expert_intermediate_size)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: Rotary, cache: KVCache | None, layer: int) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), rope, cache, layer)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderStack(nn.Module):
    """`layers` + `norm` over x [N, H] (flattened tokens; positions [N], or [3, N] for
    interleaved M-RoPE) or x [B, S, H] (positions [B, S] or [3, B, S])."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", inv_freq(cfg.head_dim, cfg.rope_theta), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute non-persistent tables (after building on the meta device)."""
        self.inv_freq = inv_freq(self.cfg.head_dim, self.cfg.rope_theta, device=self.norm.weight.device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
                capture: int | None = None, inject: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
                taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """x [..., H] -> (final-normed [..., H], raw output of layer `capture - 1` or None, taps).

        `capture=k` returns hidden_states[k] in the reference's numbering (0 = the input,
        k = output of layer k-1 before any injection). `inject[i] = (rows [M] long, feats [M, H])`
        adds feats to the given rows of the flattened tokens x.view(-1, H) after layer i (deepstack).
        `taps` (layer ids, increasing): the outputs of those layers AFTER their injection,
        concatenated [..., len(taps) * H] (a drafter's target features: transformers'
        `hidden_states[i + 1]` where nothing is injected), on the device; None without taps.
        NOTE: as in transformers' `hidden_states`, the last layer's entry is the final-normed
        output (what a draft trained on them read), every other layer's the raw one.
        """
        rope = rotate_half_rope(positions, self.inv_freq, x.dtype, self.cfg.mrope_section)  # once per forward
        captured = x if capture == 0 else None
        tapped = []
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, cache, i)
            if capture == i + 1:
                captured = x
            if inject and i in inject:
                rows, feats = inject[i]
                x = x.flatten(0, -2).index_add(0, rows, feats.to(x.dtype)).view_as(x)
            if i in taps and i < len(self.layers) - 1:
                tapped.append(x)
        x = self.norm(x)
        if len(self.layers) - 1 in taps:
            tapped.append(x)
        return x, captured, torch.cat(tapped, dim=-1) if tapped else None
