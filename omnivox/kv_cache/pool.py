"""The KV tensor pool of one autoregressive stage: one preallocated tensor of pages.

k/v: [layers, (num_blocks + 1) * block_size, kv_heads, head_dim], flat over slots. A sequence's
keys live in the pages of its block table, slot = block * block_size + offset. Pages
0..num_blocks-1 belong to the block allocator; one extra page after them, the dummy page, is
where padding tokens write (`dummy_slot`), so a padded step changes no allocator page.
"""
from __future__ import annotations

import torch


class KVPool:
    def __init__(self, layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (layers, (num_blocks + 1) * block_size, kv_heads, head_dim)  # + the dummy page
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.num_blocks = num_blocks  # allocator pages, the dummy page not counted
        self.dummy_slot = num_blocks * block_size  # first slot of the dummy page

    @staticmethod
    def bytes_per_block(layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one allocator page (k and v, all layers); the dummy page is not counted."""
        return 2 * layers * block_size * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Flat slot indices of positions [start, end) of a sequence."""
        pos = torch.arange(start, end)
        blocks = torch.tensor(block_table, dtype=torch.long)[pos // self.block_size]
        return (blocks * self.block_size + pos % self.block_size).to(self.k.device)

    def poison(self, blocks: list[int]) -> None:
        """Fill pages with NaN (tests: any read of a freed page shows in the output)."""
        for b in blocks:
            sl = slice(b * self.block_size, (b + 1) * self.block_size)
            self.k[:, sl] = float("nan")
            self.v[:, sl] = float("nan")
