"""Moshi's LM (moshi's `LMModel`): the temporal transformer over the text stream and 2 x dep_q
audio streams with acoustic delays, and the depformer's per-frame loop over the model's dep_q
codebooks. The frame loop around it (`LMGen.step`'s rules: the delayed streams, the initial
tokens, de-delaying the output) is the engine's LM stage (`models/moshi/stages/lm.py`), whose KV
lives on the paged pool under a sliding window of `context` positions.
"""
from __future__ import annotations

import torch
from torch import nn

from omnivox.layers.attention import FrameKVCache
from omnivox.models.moshi.config import MoshiConfig
from omnivox.models.moshi.lm_layers import Transformer, ZeroEmbedding, make_norm
from omnivox.models.moshi.lm_sampling import MoshiSampler


class MoshiLM(nn.Module):
    """Attribute names equal moshi's `LMModel` state-dict keys."""

    def __init__(self, cfg: MoshiConfig):
        super().__init__()
        self.cfg = cfg
        t, d = cfg.transformer, cfg.depformer
        self.emb = nn.ModuleList(ZeroEmbedding(cfg.card + 1, t.dim) for _ in range(cfg.n_q))
        self.text_emb = ZeroEmbedding(cfg.text_card + 1, t.dim)
        self.text_linear = nn.Linear(t.dim, cfg.text_card_out, bias=cfg.bias_proj)
        self.transformer = Transformer(t)
        self.out_norm = make_norm(t.norm, t.dim)
        self.depformer_in = nn.ModuleList(nn.Linear(t.dim, d.dim, bias=False) for _ in range(cfg.depformer_in_count))
        self.depformer_emb = nn.ModuleList(ZeroEmbedding(cfg.card + 1, d.dim) for _ in range(cfg.dep_q - 1))
        self.depformer_text_emb = ZeroEmbedding(cfg.text_card + 1, d.dim)
        self.depformer_norms = nn.ModuleList(
            nn.Identity() if cfg.depformer_norm is None else make_norm(cfg.depformer_norm, d.dim)
            for _ in range(cfg.dep_q))
        self.depformer = Transformer(d)
        self.linears = nn.ModuleList(nn.Linear(d.dim, cfg.card, bias=cfg.bias_proj) for _ in range(cfg.dep_q))
        self._frame = FrameKVCache(d.num_layers, cfg.dep_q, fixed_shape=True)  # the depformer's per-frame K/V

    @property
    def dtype(self) -> torch.dtype:
        return self.text_emb.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.text_emb.weight.device

    # ---- the model ------------------------------------------------------------------------------
    def temporal(self, inputs: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """inputs [N, 1 + n_q] (text, then audio streams; one token per row) at positions [N]
        -> the hidden state after out_norm [N, 1, dim]; `cache`: a `KVCache` over the rows."""
        x = None
        for i, emb in enumerate(self.emb):  # moshi's summation order: audio streams, then text
            e = emb(inputs[:, i + 1, None])  # [B, 1, dim]
            x = e if x is None else x + e
        x = x + self.text_emb(inputs[:, :1])
        return self.out_norm(self.transformer(x, positions, cache))

    def depth(self, text: torch.Tensor, h: torch.Tensor, sampler: MoshiSampler | None,
              step: torch.Tensor) -> torch.Tensor:
        """The depformer's frame: text [B], h [B, 1, dim] -> the model's audio codes [B, dep_q]."""
        cfg = self.cfg
        cache = self._frame.rewind()
        prev, codes = text, []
        for cb in range(cfg.dep_q):
            emb = self.depformer_text_emb if cb == 0 else self.depformer_emb[cb - 1]
            x = self.depformer_in[cfg.depformer_in_index(cb)](h) + emb(prev[:, None])  # [B, 1, dep_dim]
            pos = torch.full_like(step, cb)
            y = self.depformer(x, pos, cache, w=cfg.depformer.weight_index(cb))
            logits = self.linears[cb](self.depformer_norms[cb](y))[:, 0].float()  # [B, card]
            prev = logits.argmax(dim=-1) if sampler is None else sampler.audio(logits, cb, step)
            codes.append(prev)
        return torch.stack(codes, dim=1)
