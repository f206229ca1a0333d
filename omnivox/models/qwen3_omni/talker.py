"""The Talker (MoE decoder writing codebook 0) and its code predictor (codebooks 1..Q-1)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from omnivox.layers.attention import DenseKVCache, FrameKVCache
from omnivox.layers.rotary import Rotary, rotate_half_rope
from omnivox.models.qwen3_omni.config import TalkerConfig
from omnivox.models.qwen3_omni.decoder import DecoderStack


class ResizeMLP(nn.Module):
    """fc2(silu(fc1(x))), both with bias: thinker width -> talker width."""

    def __init__(self, d_in: int, d_mid: int, d_out: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(d_in, d_mid, bias=True)
        self.linear_fc2 = nn.Linear(d_mid, d_out, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class TalkerModel(DecoderStack):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)


class CodePredictorModel(DecoderStack):
    def __init__(self, cfg, groups: int):
        super().__init__(cfg)
        self.codec_embedding = nn.ModuleList(nn.Embedding(cfg.vocab_size, cfg.hidden_size) for _ in range(groups - 1))


class CodePredictor(nn.Module):
    """Fills codebooks 1..Q-1 of a frame (`frame`); a fresh cache per frame, positions 0..Q-1."""

    def __init__(self, cfg: TalkerConfig):
        super().__init__()
        cp = cfg.code_predictor
        self.model = CodePredictorModel(cp, cfg.num_code_groups)
        self.lm_head = nn.ModuleList(nn.Linear(cp.hidden_size, cp.vocab_size, bias=False)
                                     for _ in range(cfg.num_code_groups - 1))
        self._ropes: dict = {}

    def frame(self, h: torch.Tensor, embedded_code0: torch.Tensor,
              sample: Callable[[torch.Tensor, int], torch.Tensor], cache: FrameKVCache) -> torch.Tensor:
        """One frame's codes 1..Q-1 for B rows at once: h [B, H] (the Talker's last hidden state),
        embedded_code0 [B, H] -> [B, Q-1]. Unrolled and fixed-shape: a preallocated cache, the
        RoPE of each inner position computed once, `sample(logits [B, V] fp32, g)` inside."""
        groups = len(self.lm_head) + 1
        cache.rewind()
        x = torch.stack([h, embedded_code0], dim=1)  # [B, 2, H] at positions 0, 1
        codes: list[torch.Tensor] = []
        for g in range(1, groups):
            if g > 1:
                x = self.model.codec_embedding[g - 2](codes[-1])  # [B, H] at position g
            for i, layer in enumerate(self.model.layers):
                x = layer(x, self._rope(g, x), cache, i)
            hh = self.model.norm(x[:, -1] if x.dim() == 3 else x)
            codes.append(sample(self.lm_head[g - 1](hh).float(), g))
        return torch.stack(codes, dim=1)

    def _rope(self, g: int, x: torch.Tensor) -> Rotary:
        """RoPE of inner step g (positions 0-1 for g = 1, else g), cached per dtype and device."""
        key = (g, x.dtype, x.device)
        if key not in self._ropes:
            pos = torch.arange(2, device=x.device)[None] if g == 1 else torch.tensor([g], device=x.device)
            self._ropes[key] = rotate_half_rope(pos, self.model.inv_freq, x.dtype, self.model.cfg.mrope_section)
        return self._ropes[key]

    def new_cache(self, rows: int = 0) -> FrameKVCache:
        """The frame's cache, room for `rows` rows allocated at first use; attends over exactly the
        live keys, like transformers' growing cache (the parity tests compare codes exactly)."""
        return FrameKVCache(len(self.model.layers), len(self.lm_head) + 1, reserve=rows)


class Talker(nn.Module):
    """Checkpoint prefix `talker.`: model, codec_head, text/hidden projections, code_predictor."""

    def __init__(self, cfg: TalkerConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.text
        self.model = TalkerModel(d)
        self.codec_head = nn.Linear(d.hidden_size, d.vocab_size, bias=False)
        self.text_projection = ResizeMLP(cfg.thinker_hidden_size, d.intermediate_size, d.hidden_size)
        self.hidden_projection = ResizeMLP(cfg.thinker_hidden_size, d.intermediate_size, d.hidden_size)
        self.code_predictor = CodePredictor(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: DenseKVCache | None = None) -> torch.Tensor:
        """x [N, H] with positions [3, N], or x [B, S, H] with positions [3, B, S] -> final-normed hidden like x."""
        h, _, _ = self.model(x, positions, cache)
        return h

    def frame_embedding(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, Q] -> sum of the Q code embeddings [B, H] (code0 from the talker table)."""
        rows = [self.model.codec_embedding(codes[:, 0])]
        rows += [table(codes[:, g + 1]) for g, table in enumerate(self.code_predictor.model.codec_embedding)]
        return torch.stack(rows, dim=1).sum(1)  # one reduction, as the reference sums [B, Q, H]
