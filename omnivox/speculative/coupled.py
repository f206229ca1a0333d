"""Coupled drafting: a learned draft draws its proposal for draft position j of each row the way
the Thinker will draw that position (`DraftSampling`: the same noise step, warping, penalty and
suppression), so proposal and verification agree as often as the two distributions allow."""
from __future__ import annotations

from dataclasses import fields, replace

import torch

from omnivox.sampling.batched import SamplingTensors, sample
from omnivox.speculative.drafter import DraftSampling


def sampling_rows(t: SamplingTensors, index: torch.Tensor) -> SamplingTensors:
    """The sampling rows `index` of `t` (host flags kept)."""
    return replace(t, **{f.name: getattr(t, f.name).index_select(0, index) for f in fields(t)
                         if isinstance(getattr(t, f.name), torch.Tensor)})


def draw(logits: torch.Tensor, s: DraftSampling | None, j: int, seen: torch.Tensor | None) -> torch.Tensor:
    """logits [R, V] fp32 over the Thinker's vocabulary for draft position `j` of every row -> ids
    [R]: argmax without sampling values, else the Thinker's draw at that position. `seen` [R, V]
    (the repetition penalty's ids; None without a penalty) gains the drawn ids, in place."""
    if s is None:
        return logits.argmax(-1)
    rows = logits.shape[0]
    t = sampling_rows(s.tensors, torch.arange(rows, device=logits.device) * s.width + j)
    ids = sample(logits, t, s.stream, seen=seen, suppress=s.suppress)
    if seen is not None:
        seen.scatter_(1, ids.clamp_min(0)[:, None], True)
    return ids


def penalty_seen(s: DraftSampling | None) -> torch.Tensor | None:
    """A copy of the ids each row drew before its drafts, where a penalty reads them (else None)."""
    return s.seen.clone() if s is not None and s.seen is not None and s.tensors.any_penalty else None
