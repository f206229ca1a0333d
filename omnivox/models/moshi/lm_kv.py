"""The temporal transformer's KV state: a per-session ring of `context` steps, batch-first.

Each session (row) keeps, per layer, K and V of its last `context` steps in a ring
[B, Hkv, context, D] (the SDPA layout moshi's `RingKVCache` uses): step p lives in slot
p % context. A step writes every row's new K/V at its own slot and attends over the slots whose
step lies in the window (p - context, p]; older steps are overwritten, never read. The slot
order and the boolean mask are moshi's, so attention equals the reference bit for bit, also
after a session passes `context` steps.

Rows are independent (own position, own ring), so sessions join and leave between steps by
`WindowKVState.concat` / `select` (`BatchedState`): nothing else in the batch changes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from omnivox.layers.streaming_conv import BatchedState


@dataclass
class WindowKVState(BatchedState):
    keys: list[torch.Tensor]  # per layer [B, Hkv, context, D]
    values: list[torch.Tensor]  # per layer [B, Hkv, context, D]
    pos: torch.Tensor  # [B] long: steps this row has taken = position of its next step

    @classmethod
    def empty(cls, batch: int, layers: int, kv_heads: int, context: int, head_dim: int, dtype: torch.dtype,
              device: torch.device | str) -> "WindowKVState":
        shape = (batch, kv_heads, context, head_dim)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
                   torch.zeros(batch, dtype=torch.long, device=device))

    @property
    def context(self) -> int:
        return self.keys[0].shape[2]


class WindowKV:
    """`KVCache.attend` over a `WindowKVState`, one new token per row, for one step of all layers.

    q [B, 1, H, D], k/v [B, 1, Hkv, D] -> [B, 1, H, D]. The step's mask is built at layer 0 and
    the rows' positions advance after the last layer.
    """

    def __init__(self, state: WindowKVState):
        self.state = state
        self.layers = len(state.keys)
        self._slot: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        st = self.state
        if layer == 0:
            self._slot, self._mask = window_slots(st.pos, st.context)
        rows = torch.arange(q.shape[0], device=q.device)
        keys, values = st.keys[layer], st.values[layer]  # [B, Hkv, C, D]
        keys[rows, :, self._slot] = k[:, 0]
        values[rows, :, self._slot] = v[:, 0]
        rep = q.shape[2] // keys.shape[1]
        if rep > 1:  # moshi expands the kv heads rather than letting SDPA group them
            keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, self._mask)  # [B, H, 1, D]
        if layer == self.layers - 1:
            st.pos = st.pos + 1
        return out.transpose(1, 2)


def window_slots(pos: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows about to take step `pos` [B]: their write slot [B] and the bool mask [B, 1, 1, context]
    of slots holding a step in (pos - context, pos] (slot j holds step pos - ((pos - j) mod context),
    a real step iff it is >= 0)."""
    j = torch.arange(context, device=pos.device)
    held = pos[:, None] - torch.remainder(pos[:, None] - j, context)  # [B, C]
    return pos % context, (held >= 0)[:, None, None, :]
