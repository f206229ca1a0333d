"""`build_metadata`'s sample positions: the flat index of each sampling row's last token (in the
order given), then one per padding row, computed in the metadata's one copy; a prefill chunk that
does not sample contributes none."""
from __future__ import annotations

import torch

from omnivox.attention.metadata import build_metadata


def test_last_token_index_of_sampling_rows_then_padding():
    # rows: a prefill chunk of 5 that does not sample, a decode row, a 3-token prefill that ends and samples
    meta = build_metadata([[0, 1], [2], [3]], past=[0, 7, 2], new=[5, 1, 3], block_size=4, dummy_slot=99,
                          device="cpu", pad_rows=2, sampled=[2, 1])
    flat = torch.arange(5 + 1 + 3 + 2)  # the step's tokens, padding rows last
    assert meta.last_token_index.tolist() == [8, 5, 9, 10]  # row 2's last, row 1's last, the two padding rows
    assert torch.equal(flat.index_select(0, meta.last_token_index), torch.tensor([8, 5, 9, 10]))
    none = build_metadata([[0, 1]], past=[0], new=[5], block_size=4, dummy_slot=99, device="cpu")
    assert none.last_token_index.numel() == 0
