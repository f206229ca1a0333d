"""Forward metadata for one step of a flattened, continuously batched AR stage.

The step's tokens from all scheduled sequences are concatenated into [N, H] (or one batch
row [1, N, H]); sequence i owns tokens [cu[i], cu[i+1]) at positions [past_i, past_i + n_i).
`attend` writes this step's K/V into the pool's pages and attends, per sequence, over that
sequence's own pages only (past + new, causal).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from omnivox.kv_cache.pool import KVPool
from omnivox.layers.attention import causal_attention


@dataclass
class SeqSlice:
    block_table: list[int]
    past: int  # tokens already in the cache
    n: int  # new tokens this step


class PagedBatch:
    def __init__(self, pool: KVPool, seqs: list[SeqSlice]):
        self.pool, self.seqs = pool, seqs
        self.cu = [0]
        for s in seqs:
            self.cu.append(self.cu[-1] + s.n)
        self.write_slots = torch.cat([pool.slots(s.block_table, s.past, s.past + s.n) for s in seqs])
        self.read_slots = [pool.slots(s.block_table, 0, s.past + s.n) for s in seqs]

    @property
    def last_index(self) -> torch.Tensor:
        """Index of each sequence's last token in the flat batch."""
        return torch.tensor(self.cu[1:]) - 1

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, H, D], k/v [N, Hkv, D] (or with a leading batch axis of 1) -> like q."""
        shape = q.shape
        q, k, v = q.reshape(-1, *shape[-2:]), k.reshape(-1, *k.shape[-2:]), v.reshape(-1, *v.shape[-2:])
        self.pool.k[layer, self.write_slots] = k
        self.pool.v[layer, self.write_slots] = v
        outs = []
        for i, slots in enumerate(self.read_slots):
            ks, vs = self.pool.k[layer, slots], self.pool.v[layer, slots]  # [T, Hkv, D]
            outs.append(causal_attention(q[self.cu[i]:self.cu[i + 1]], ks, vs))
        return torch.cat(outs).view(shape)
