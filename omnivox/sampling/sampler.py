"""Logits processing and token choice, one request row at a time.

Order as the reference: repetition penalty -> suppression -> (sampling only) temperature ->
top-k -> top-p -> multinomial draw from the request's own generator, so a seeded request
draws the same tokens alone or in any batch.
"""
from __future__ import annotations

import torch

from omnivox.errors import InputError
from omnivox.sampling.params import SamplingParams


class SamplingError(InputError):
    """A request's logits gave no valid distribution (NaN or inf): only that request fails."""


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


def choose(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None,
           seen: torch.Tensor | None = None, suppress: torch.Tensor | None = None) -> int:
    """One token id from logits [V] (float32 recommended)."""
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, p.repetition_penalty)
    if suppress is not None:
        logits = logits.masked_fill(suppress, float("-inf"))
    if p.is_greedy:
        if not bool(torch.isfinite(logits).any()) or bool(torch.isnan(logits).any()):
            raise SamplingError("sampling failed: the logits hold no finite value")
        return int(torch.argmax(logits))
    probs = warp(logits.float(), p).softmax(-1)
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
        raise SamplingError("sampling failed: these sampling values give no valid distribution")
    return int(torch.multinomial(probs, 1, generator=generator))


def request_generators(seed: int | None, device: torch.device | str) -> tuple[torch.Generator, torch.Generator]:
    """(thinker, talker) generators of one request. Each stage draws only from its own, so a
    seeded request samples the same tokens alone, in any batch, and however stages interleave."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    g1 = torch.Generator(device=device).manual_seed(seed)
    g2 = torch.Generator(device=device).manual_seed((seed * 1_000_003 + 7) % 2**63)
    return g1, g2
