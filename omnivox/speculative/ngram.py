"""Prompt-lookup drafts (n-gram speculative decoding): the ids that followed the most recent earlier
occurrence of a sequence's last n tokens in its own prompt and output. Pure numpy, host side."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from omnivox.speculative.drafter import Drafter, DraftRow, DraftSampling, Proposals


def propose(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` ids drafted to follow `tokens`: for n from n_max down to n_min, find the latest
    earlier window equal to the last n tokens and return (up to k of) the ids after it, copied on
    into the draft itself when they reach the end (a loop of period p < k drafts k ids). [] when
    nothing matches."""
    t = np.asarray(tokens, dtype=np.int64)
    L = len(t)
    if k <= 0:
        return []
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(t[:L - 1], n)  # windows ending before the last token
        hits = np.nonzero((windows == t[L - n:]).all(axis=1))[0]
        if hits.size:
            start = int(hits[-1]) + n
            head = t[start:start + k].tolist()
            out = head[:k]
            while len(out) < k:
                out.append(out[len(out) - len(head)])
            return out
    return []


class NgramDrafter(Drafter):
    """Prompt lookup on the drafter protocol: host-side matching per row, one copy of the proposals
    to the device. `lookup(ids, k)` is the matcher (tests swap in oracles)."""

    method = "ngram"

    def __init__(self, n_min: int, n_max: int, device: torch.device | str):
        self.device = device
        self.lookup: Callable[[list[int], int], list[int]] = lambda ids, k: propose(ids, k, n_min, n_max)

    def propose(self, rows: list[DraftRow], sampling: DraftSampling | None = None) -> Proposals:
        return Proposals.from_lists([list(self.lookup(list(r.tokens), r.k))[:r.k] for r in rows], self.device)
