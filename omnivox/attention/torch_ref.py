"""Batched paged attention in plain PyTorch: one masked SDPA per layer for a whole mixed batch.

Layout of a step with B rows, Qmax = longest q_len, Tmax = longest seq_len:
- keys/values: each row's pages gathered into a padded [B, Hkv, Tmax, D] view through
  `kv_index` [B*Tmax] (slot of position t of row b). Padding positions t >= seq_len read the
  row's own position 0 (padding rows: the dummy slot), never another row's or a freed page:
  a masked key still multiplies its value by 0, and 0 * NaN is NaN.
- queries: flat [N, H, D] gathered into [B, H, Qmax, D] through `q_index` (padded queries read
  some real token) and back through `out_index` [N]. Decode-only steps (every q_len 1) skip both:
  q [N, H, D] is already [B, H, 1, D] after an unsqueeze.
- one mask [B, 1, Qmax, Tmax]: query i of row b sits at p = seq_len - q_len + i and sees
  keys 0..p. It is additive (0 / -inf in q's dtype): SDPA turns a boolean mask into that anyway,
  with one more op per layer. NOTE: a fully masked query row gives NaN in SDPA, so padded queries
  and padding rows (seq_len 0) see key 0 only; their outputs are never read.
- a sliding window (meta.window): key t of row b is position lo + t, lo the first key the row's first
  token sees, and Tmax is at most window + Qmax - 1, so no key before lo is gathered (padding
  positions read lo's slot; padded queries see key lo); the mask also hides keys <= p - window.

The layout is derived once per step (the first layer's call) with device ops that read nothing
back, cached in `meta.derived["torch_ref"]`. `forward` itself runs a fixed sequence of ops,
whatever B and the lengths are, and reads nothing back either.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from omnivox.attention.metadata import AttentionMetadata


@dataclass
class _Layout:
    rows: int  # B
    q_max: int  # Qmax
    t_max: int  # Tmax
    kv_index: torch.Tensor  # [B*Tmax] long: slot read for key t of row b
    mask: torch.Tensor  # [B, 1, Qmax, Tmax] q's dtype: 0 = attend, -inf = not
    q_index: torch.Tensor | None  # [B*Qmax] long: flat token of padded query (b, i); None: decode-only
    out_index: torch.Tensor | None  # [N] long: padded position b*Qmax + i of each flat token


class TorchPagedAttention:
    name = "torch_ref"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [N, H, D], k/v [N, Hkv, D], caches [S, Hkv, D] -> [N, H, D]."""
        k_cache.index_copy_(0, meta.write_slots, k)
        v_cache.index_copy_(0, meta.write_slots, v)
        lay = meta.derived.get(self.name)
        if lay is None:
            lay = meta.derived[self.name] = derive_layout(meta, q.dtype)
        (_, heads, d), kv_heads = q.shape, k_cache.shape[1]
        b, qm, t = lay.rows, lay.q_max, lay.t_max
        ks = k_cache.index_select(0, lay.kv_index).view(b, t, kv_heads, d).transpose(1, 2)  # [B, Hkv, Tmax, D]
        vs = v_cache.index_select(0, lay.kv_index).view(b, t, kv_heads, d).transpose(1, 2)
        if lay.q_index is None:
            qs = q.unsqueeze(2)  # [B, H, 1, D]
        else:
            qs = q.index_select(0, lay.q_index).view(b, qm, heads, d).transpose(1, 2)  # [B, H, Qmax, D]
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=lay.mask, enable_gqa=heads != kv_heads)
        if lay.out_index is None:
            return out.squeeze(2)
        return out.transpose(1, 2).reshape(b * qm, heads, d).index_select(0, lay.out_index)  # [N, H, D]


def derive_layout(meta: AttentionMetadata, dtype: torch.dtype) -> _Layout:
    """The step's index tensors and mask, from the device metadata; shapes from the host ints only."""
    rows, n, bs, window = meta.num_rows, meta.num_tokens, meta.block_size, meta.window
    decode = meta.max_q == 1 and n == rows
    q_max, t_max = max(meta.max_q, 1), max(meta.max_seq, 1)
    dev = meta.block_table.device
    cu = meta.cu_q.long()
    seq = meta.seq_lens.long()[:, None]  # [B, 1]
    q_len = (cu[1:] - cu[:-1])[:, None]  # [B, 1]
    table = meta.block_table.long()
    i = torch.arange(q_max, device=dev)  # [Qmax]
    if window is None:
        t = torch.arange(t_max, device=dev)  # [Tmax]: key t is position t
        pages = table.index_select(1, (t // bs).clamp_max(table.shape[1] - 1))  # [B, Tmax]
        own = torch.where(seq > 0, table[:, :1] * bs, meta.dummy_slot)  # [B, 1]: a harmless slot of the row
        kv_index = torch.where(t < seq, pages * bs + t % bs, own)  # [B, Tmax]
        last = torch.where(i < q_len, seq - q_len + i, 0).clamp_min(0)  # [B, Qmax]: last key each query sees
        mask = torch.where(t <= last[:, :, None], 0.0, float("-inf")).to(dtype)[:, None]  # [B, 1, Qmax, Tmax]
    else:
        # key t of row b is position lo + t: the row's tokens together see at most window + q_len - 1
        # keys from lo, its first token's window start; nothing before lo is read (may be freed)
        t_max = min(t_max, window + q_max - 1)
        lo = (seq - q_len - window + 1).clamp_min(0)  # [B, 1]
        t = lo + torch.arange(t_max, device=dev)  # [B, Tmax] key positions
        pages = table.gather(1, (t // bs).clamp_max(table.shape[1] - 1))  # [B, Tmax]
        own = torch.where(seq > 0, table.gather(1, lo // bs) * bs + lo % bs, meta.dummy_slot)  # [B, 1]: slot of lo
        kv_index = torch.where(t < seq, pages * bs + t % bs, own)  # [B, Tmax]
        last = torch.where(i < q_len, seq - q_len + i, lo).clamp_min(0)  # [B, Qmax]; padded queries see lo
        key, last = t[:, None, :], last[:, :, None]
        mask = torch.where((key <= last) & (key > last - window), 0.0, float("-inf")).to(dtype)[:, None]
    q_index = out_index = None
    if not decode:
        q_index = (cu[:-1, None] + i).clamp_max(n - 1).reshape(-1)  # [B*Qmax]
        tok = torch.arange(n, device=dev)
        row = torch.searchsorted(cu[1:], tok, right=True)  # [N]
        out_index = row * q_max + tok - cu[row]
    return _Layout(rows, q_max, t_max, kv_index.reshape(-1), mask, q_index, out_index)
