"""Rotary position embeddings: 1-D RoPE, Qwen3-Omni's interleaved 3-D M-RoPE, and the
interleaved-pair rotation (S2, Mimi) from any cos/sin tables (`pair_rotary`).

Angles are formed in fp32 (as the reference does, also for fp64 models) and the resulting
cos/sin are cast to the activation dtype. Convention: rotate-half over the full head_dim.

A stack builds one `Rotary` per forward (tables already shaped to broadcast over heads) and
every layer applies it to q and k together, in four ops: x*cos + partner(x)*sin.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Rotary(NamedTuple):
    """The RoPE of one forward for activations [..., S, H, D] (or another head axis).

    Element i is rotated with its partner and `sin` carries the sign, so both conventions are
    one data movement: rotate-half (partner i -+ D/2: a roll by D/2, sin = [-s | s]) and
    interleaved pairs (partner i ^ 1: a gather, sin = [-s0, s0, -s1, s1, ...]). Exact:
    x*(-s) == -(x*s) and a + (-b) == a - b in IEEE arithmetic, so this equals the reference
    formulas bit for bit. The rotation runs in the tables' dtype, cast back to x's dtype.
    """

    cos: torch.Tensor  # [..., S, 1, D] (broadcast over heads)
    sin: torch.Tensor  # [..., S, 1, D] signed
    partner: int | torch.Tensor  # a roll shift, or [D] long indices

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = x.to(self.cos.dtype)
        p = self.partner
        moved = y.roll(p, -1) if isinstance(p, int) else y.index_select(-1, p)
        return (y * self.cos + moved * self.sin).to(x.dtype)


def rotate_half_rope(positions: torch.Tensor, freqs: torch.Tensor, dtype: torch.dtype,
                     mrope_section: tuple[int, ...] | None = None, head_axis: int = -2) -> Rotary:
    """The rotate-half RoPE for `positions` ([..., S], or [3, ..., S] with `mrope_section`),
    tables in the activation `dtype` (as the reference rotates), heads at `head_axis` of x."""
    cos, sin = rope_cos_sin(positions, freqs, dtype, mrope_section)  # [..., S, D]
    half = cos.shape[-1] // 2
    sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return Rotary(cos.unsqueeze(head_axis), sin.unsqueeze(head_axis), half)


def pair_rotary(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype, head_axis: int = -2) -> Rotary:
    """Interleaved-pair rotation from (cos, sin) [..., S, D/2] tables, run in `dtype`:
    (x[2j], x[2j+1]) -> (x[2j] c - x[2j+1] s, x[2j+1] c + x[2j] s)."""
    c, s = cos.to(dtype), sin.to(dtype)
    c = torch.stack((c, c), dim=-1).flatten(-2)  # [..., S, D]: c0 c0 c1 c1 ...
    s = torch.stack((-s, s), dim=-1).flatten(-2)  # -s0 s0 -s1 s1 ...
    partner = torch.arange(c.shape[-1], device=c.device) ^ 1  # 1 0 3 2 ...
    return Rotary(c.unsqueeze(head_axis), s.unsqueeze(head_axis), partner)


def inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """[head_dim/2] fp32 inverse frequencies theta^(-2j/head_dim)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


def rope_cos_sin(positions: torch.Tensor, freqs: torch.Tensor, dtype: torch.dtype,
                 mrope_section: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [..., S, head_dim].

    positions: [..., S] for 1-D RoPE, or [3, ..., S] (T, H, W rows) with `mrope_section`.
    Interleaved M-RoPE: frequency j takes H if j%3==1 and j < 3*sec[1], W if j%3==2 and
    j < 3*sec[2], T otherwise.
    """
    angles = positions.to(torch.float32)[..., None] * freqs.to(positions.device, torch.float32)  # [(3,) ..., S, hd/2]
    # NOTE: the order of cos/concat/recompose mirrors the reference exactly; vectorised cos
    # differs from the scalar path by 1 ulp, so another order changes fp32 round-off.
    if mrope_section is None:
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)
    cos, sin = _interleave(angles.cos(), mrope_section), _interleave(angles.sin(), mrope_section)
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((sin, sin), dim=-1).to(dtype)


def _interleave(per_row: torch.Tensor, section: tuple[int, ...]) -> torch.Tensor:
    """[3, ..., hd/2] -> [..., hd/2]: frequency j from H if j%3==1 and j < 3*section[1],
    from W if j%3==2 and j < 3*section[2], else from T."""
    out = per_row[0].clone()
    for row in (1, 2):
        sl = slice(row, section[row] * 3, 3)
        out[..., sl] = per_row[row][..., sl]
    return out


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, S, D]; cos/sin: [B, S, D] (broadcast over heads)."""
    cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)
    return x * cos + rotate_half(x) * sin
