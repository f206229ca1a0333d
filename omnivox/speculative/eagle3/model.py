"""The EAGLE-3 head (SafeAILab's `LlamaForCausalLMEagle3`, SGLang's description; checkpoint names
`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`, optional `embed_tokens`).

One draft step at sequence index p reads a token embedding e and a hidden state h (H each):

    residual = h (or hidden_norm(h) with norm_before_residual)
    x = cat(input_layernorm(e), hidden_norm(h))                     # 2H: q/k/v take 2H inputs
    r = residual + o_proj(attention(x at RoPE position p))
    a = r + mlp(post_attention_layernorm(r))                        # the next step's h
    logits = lm_head(norm(a))                                       # the draft vocabulary

The first step of a chain reads e = the embedding of the token at p + 1 and h = fc(features of
p) (the Thinker's layer outputs, concatenated); later steps read their own drawn token and `a`.
Attention is causal over the head's own K/V: one entry per sequence index, each a function of
its (e, h) only (one layer), so an entry made from target features stays valid once written.
A draft id d is the Thinker's id d + d2t[d].
"""
from __future__ import annotations

import torch
from torch import nn

from omnivox.layers.merged import MergedLinear, keep_checkpoint_names
from omnivox.layers.mlp import SwiGLU
from omnivox.layers.norm import RMSNorm
from omnivox.layers.rotary import Rotary, inv_freq, rotate_half_rope
from omnivox.speculative.eagle3.config import Eagle3Config


class Eagle3Attention(nn.Module):
    """q/k/v over the 2H input (checkpoint names q_proj / k_proj / v_proj, loaded into one
    `qkv_proj`), o_proj back to H, per-head q/k RMSNorm only for a Qwen3-style layer."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        d = c.head_dim
        self.qkv_proj = MergedLinear(2 * c.hidden_size, {"q_proj": self.heads * d, "k_proj": self.kv_heads * d,
                                                         "v_proj": self.kv_heads * d})
        self.o_proj = nn.Linear(self.heads * d, c.hidden_size, bias=False)
        if c.qk_norm:
            self.qk_norm = RMSNorm(d, c.rms_norm_eps, heads={"q_norm": self.heads, "k_norm": self.kv_heads})
        keep_checkpoint_names(self)

    def project(self, x: torch.Tensor, rope: Rotary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., 2H] -> q [..., Hq, D], k and v [..., Hkv, D] (normed, rotated)."""
        qkv = self.qkv_proj(x).unflatten(-1, (-1, self.head_dim))
        qk, v = qkv.split((self.heads + self.kv_heads, self.kv_heads), dim=-2)
        if hasattr(self, "qk_norm"):
            qk = self.qk_norm(qk)
        q, k = rope(qk).split((self.heads, self.kv_heads), dim=-2)
        return q, k, v


class Eagle3Layer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.self_attn = Eagle3Attention(c)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Eagle3Head(nn.Module):
    def __init__(self, c: Eagle3Config, taps: int):
        """`taps`: how many target layers `fc` fuses (SGLang's heads: 3)."""
        super().__init__()
        self.cfg = c
        self.fc = nn.Linear(taps * (c.target_hidden_size or c.hidden_size), c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool))
        self.register_buffer("inv_freq", inv_freq(c.head_dim, c.rope_theta), persistent=False)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[N, taps * H] target features -> [N, H] (`fc`)."""
        return self.fc(features.to(self.fc.weight.dtype))

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotary:
        return rotate_half_rope(positions, self.inv_freq, dtype)

    def project(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """Step inputs e, h [..., H] at sequence `positions` [...] -> (q [..., Hq, D], k, v
        [..., Hkv, D], residual [..., H])."""
        layer = self.midlayer
        h = layer.hidden_norm(hidden)
        residual = h if self.cfg.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(embeds), h], dim=-1)
        q, k, v = layer.self_attn.project(x, self.rope(positions, x.dtype))
        return q, k, v, residual

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Attention output [..., Hq, D] and the residual [..., H] -> the step's hidden state `a`."""
        layer = self.midlayer
        r = residual + layer.self_attn.o_proj(attended.flatten(-2))
        a = r + layer.mlp(layer.post_attention_layernorm(r))
        return self.norm(a) if self.cfg.norm_output else a

    def logits(self, a: torch.Tensor) -> torch.Tensor:
        """[..., H] -> fp32 logits over the draft vocabulary [..., draft_vocab_size]."""
        return self.lm_head(a if self.cfg.norm_output else self.norm(a)).float()

    def to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., Vd] -> the Thinker's vocabulary [..., V] (-inf where the
        draft has no id): draft id d sits at d + d2t[d]."""
        ids = torch.arange(logits.shape[-1], device=logits.device) + self.d2t
        out = logits.new_full((*logits.shape[:-1], self.cfg.vocab_size), float("-inf"))
        return out.index_copy_(-1, ids, logits)
