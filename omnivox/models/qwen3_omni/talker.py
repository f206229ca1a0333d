"""The Talker (MoE decoder writing codebook 0) and its code predictor (codebooks 1..Q-1)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnivox.layers.attention import DenseKVCache
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
    """Fills codebooks 1..Q-1 of a frame; a fresh cache per frame, positions 0..Q-1."""

    def __init__(self, cfg: TalkerConfig):
        super().__init__()
        cp = cfg.code_predictor
        self.model = CodePredictorModel(cp, cfg.num_code_groups)
        self.lm_head = nn.ModuleList(nn.Linear(cp.hidden_size, cp.vocab_size, bias=False)
                                     for _ in range(cfg.num_code_groups - 1))

    def step(self, x: torch.Tensor, start: int, cache: DenseKVCache) -> torch.Tensor:
        """x [B, S, H] at positions start..start+S-1 -> final-normed hidden of the last position [B, H]."""
        b, s, _ = x.shape
        pos = torch.arange(start, start + s, device=x.device).expand(b, s)
        h, _ = self.model(x, pos, cache)
        return h[:, -1]


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
        h, _ = self.model(x, positions, cache)
        return h

    def frame_embedding(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, Q] -> sum of the Q code embeddings [B, H] (code0 from the talker table)."""
        rows = [self.model.codec_embedding(codes[:, 0])]
        rows += [table(codes[:, g + 1]) for g, table in enumerate(self.code_predictor.model.codec_embedding)]
        return torch.stack(rows, dim=1).sum(1)  # one reduction, as the reference sums [B, Q, H]
