"""The per-sequence loop behind the backend contract: one causal SDPA per row.

The oracle of the batched backends' tests (the engine's first paged attention): simple
enough to trust, slow on purpose. Its per-row slot lists are built from the host copies of the
metadata, so it is no hot path and no CUDA-graph candidate.
"""
from __future__ import annotations

import torch

from omnivox.attention.metadata import AttentionMetadata
from omnivox.layers.attention import additive_mask, causal_attention, masked_attention


class PerSequenceAttention:
    name = "per_sequence"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [N, H, D], k/v [N, Hkv, D], caches [S, Hkv, D] -> [N, H, D]."""
        k_cache[meta.write_slots] = k
        v_cache[meta.write_slots] = v
        out = torch.zeros_like(q)  # padding rows (seq_len 0) keep zeros
        for start, end, slots in self._rows(meta):
            if meta.window is None:
                out[start:end] = causal_attention(q[start:end], k_cache[slots], v_cache[slots])  # [n, H, D]
            else:
                out[start:end] = self._windowed(q[start:end], k_cache[slots], v_cache[slots], meta.window)
        return out

    @staticmethod
    def _windowed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
        """q [n, H, D] (the tokens at the last n of the L keys) over k/v [L, Hkv, D] -> [n, H, D]."""
        n, total = q.shape[0], k.shape[0]
        delta = torch.arange(total - n, total, device=q.device)[:, None] - torch.arange(total, device=q.device)
        mask = additive_mask((delta >= 0) & (delta < window), q.dtype)  # [n, L]
        return masked_attention(q[None], k[None], v[None], mask)[0]

    def _rows(self, meta: AttentionMetadata) -> list[tuple[int, int, torch.Tensor]]:
        """(first token, end token, slots of positions lo..seq_len-1) of each row with tokens and a past;
        lo is 0, or with a window the first key the row's first token sees."""
        rows = meta.derived.get(self.name)
        if rows is None:
            rows, bs, cu = [], meta.block_size, meta.cu_q_host
            for b, seq_len in enumerate(meta.seq_lens_host):
                if seq_len == 0 or cu[b + 1] == cu[b]:
                    continue
                lo = 0 if meta.window is None else max(0, seq_len - (cu[b + 1] - cu[b]) - meta.window + 1)
                pos = torch.arange(lo, seq_len, device=meta.block_table.device)
                slots = meta.block_table[b, pos // bs].long() * bs + pos % bs
                rows.append((cu[b], cu[b + 1], slots))
            meta.derived[self.name] = rows
        return rows
