"""Forward metadata of one paged attention step, built host-side once and shared by every layer.

A step runs B rows (sequences). Row b brings q_lens[b] new tokens, which sit at positions
seq_lens[b] - q_lens[b] .. seq_lens[b] - 1 of that sequence; tokens of all rows are flat,
row b owning [cu_q[b], cu_q[b+1]). Before attending, a backend writes each new token's K/V at
`write_slots` (flat slot = page * block_size + offset) of the layer's pool; every row then
attends causally over its own pages only, read through `block_table`.

`window` (a model constant, e.g. Moshi's `context`; None: unbounded) makes the attention a sliding
window: the token at position p sees keys p - window + 1 .. p only. Backends never read a key before
the earliest window of a row's tokens (max(0, seq_len - q_len - window + 1)), so the pages wholly before
it may hold anything (a freed page, NaN). A windowed AR stage frees those pages and passes each row
counted from its first kept page (`past` less the freed pages' positions, stages/ar.py): the masks
depend only on query-key distances, so the shift changes nothing.

Padding rows (to reach a CUDA-graph bucket) have q_lens 1, seq_lens 0 and write to the pool's
dummy slot, so they change no real page; their outputs are garbage and are never read.

`last_token_index` is for the output head: the flat indices of the last new tokens of each row that
samples (its last `sample_counts[i]` tokens, in order: more than one when a row verifies drafts),
then of each padding row (a padded step samples into scratch rows).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    write_slots: torch.Tensor  # [N] long: pool slot of each new token
    cu_q: torch.Tensor  # [B+1] int32: row b owns flat tokens [cu_q[b], cu_q[b+1])
    seq_lens: torch.Tensor  # [B] int32: tokens of row b in the cache after this step (past + new)
    block_table: torch.Tensor  # [B, max_blocks] int32: row b's pages; unused entries point at page 0
    last_token_index: torch.Tensor  # [M] long: flat indices of each sampling row's sampled tokens, then padding rows'
    block_size: int
    dummy_slot: int  # where padding tokens write
    # host copies (plain ints), for shapes and for slicing outputs without reading the device
    cu_q_host: list[int]
    seq_lens_host: list[int]
    max_q: int  # longest q_len of the step
    max_seq: int  # longest seq_len of the step
    window: int | None = None  # sliding window: position p sees keys p - window + 1 .. p; None: 0 .. p
    # what a backend derives once per step (index tensors, masks), keyed by the backend's name
    derived: dict[str, Any] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return len(self.cu_q_host) - 1

    @property
    def num_tokens(self) -> int:
        return self.cu_q_host[-1]


def build_metadata(block_tables: Sequence[Sequence[int]], past: Sequence[int], new: Sequence[int], *,
                   block_size: int, dummy_slot: int, device: torch.device | str,
                   pad_rows: int = 0, width: int | None = None, sampled: Sequence[int] = (),
                   sample_counts: Sequence[int] | None = None,
                   window: int | None = None) -> AttentionMetadata:
    """Metadata for rows with `past[b]` cached tokens and `new[b]` new ones, in one vectorised host
    pass and one host-to-device copy. `sampled`: the rows that sample (indices); `sample_counts`:
    how many of each one's last tokens sample (default 1 each; more to verify drafts). `pad_rows`
    appends decode-shaped padding rows (they sample too); `width` fixes the block table's width
    (pages per row) and `max_seq` to `width * block_size`, so every shape depends on the row
    count alone (a CUDA graph's inputs). `window`: see the module docstring."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"attention window must be a positive int or None, got {window!r}")
    past_a = np.asarray(list(past) + [0] * pad_rows, dtype=np.int64)
    new_a = np.asarray(list(new) + [1] * pad_rows, dtype=np.int64)
    seq = past_a + new_a
    seq[len(past):] = 0  # padding rows hold nothing
    rows = len(past_a)
    fixed = width
    width = fixed or max([len(t) for t in block_tables] + [1])
    if any(len(t) > width for t in block_tables):
        raise ValueError(f"a block table has more than {width} pages")
    table = np.zeros((rows, width), dtype=np.int64)
    for b, t in enumerate(block_tables):
        table[b, :len(t)] = t
    cu = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(new_a, out=cu[1:])
    n = int(cu[-1])
    # flat token -> (row, position in its sequence)
    row_of = np.repeat(np.arange(rows), new_a)
    pos = np.arange(n) - cu[:-1][row_of] + past_a[row_of]
    slots = table[row_of, pos // block_size] * block_size + pos % block_size
    slots[row_of >= len(past)] = dummy_slot
    counts = np.ones(len(sampled), np.int64) if sample_counts is None else np.asarray(sample_counts, np.int64)
    counts = np.concatenate([counts, np.ones(pad_rows, np.int64)])
    ends = cu[1:][np.concatenate([np.asarray(sampled, dtype=np.int64), np.arange(len(past), rows)])]  # [S + pad]
    first = np.cumsum(counts) - counts
    last = np.repeat(ends - counts, counts) + np.arange(int(counts.sum())) - np.repeat(first, counts)
    packed = torch.from_numpy(np.concatenate([slots, cu, seq, table.reshape(-1), last])).to(device)  # one copy
    w, c, s, t, li = packed.split([n, rows + 1, rows, rows * width, len(last)])
    return AttentionMetadata(
        write_slots=w, cu_q=c.to(torch.int32), seq_lens=s.to(torch.int32),
        block_table=t.view(rows, width).to(torch.int32), last_token_index=li, block_size=block_size, dummy_slot=dummy_slot,
        cu_q_host=cu.tolist(), seq_lens_host=seq.tolist(), max_q=int(new_a.max(initial=0)),
        max_seq=fixed * block_size if fixed else int(seq.max(initial=0)), window=window)
