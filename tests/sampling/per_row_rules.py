"""The per-row sampling rules the engine used before its batched sampler: plain, one row at a time,
kept here as the oracles the batched rules are checked against (Qwen's HF order; S2's fish-speech
filter and SGLang-Omni's windowed penalty)."""
from __future__ import annotations

import torch

from omnivox.sampling.params import SamplingParams


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits [V]; seen: distinct ids generated so far. Positive logits /penalty, negative *penalty."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    logits = logits.clone()
    picked = logits[seen]
    logits[seen] = torch.where(picked < 0, picked * penalty, picked / penalty)
    return logits


def warp(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p on one row of logits [V]; removed entries become -inf."""
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= (1 - p.top_p)
        drop[-1] = False  # always keep the most likely token
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits



def fish_filter_top_p_top_k(logits: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """fish-speech rule on [B, V] logits: remove ranks whose cumulative probability (untempered)
    exceeds top_p (the crossing token too) and ranks >= top_k (0 = off); rank 0 always stays."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
    rank = torch.arange(logits.shape[-1], device=logits.device)
    remove = cum > top_p[:, None]
    remove |= (top_k[:, None] > 0) & (rank[None] >= top_k[:, None])
    remove[:, 0] = False
    mask = torch.zeros_like(remove).scatter(-1, order, remove)
    return logits.masked_fill(mask, float("-inf"))


def windowed_penalty(logits: torch.Tensor, history: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """Penalise tokens in history ([B, H], -1 = empty): positive logits / p, negative * p."""
    valid = history >= 0
    idx = history.clamp(min=0)
    picked = logits.gather(1, idx)
    p = penalty[:, None]
    new = torch.where(picked > 0, picked / p, picked * p)
    new = torch.where(valid, new, picked)
    return logits.scatter(1, idx, new)


