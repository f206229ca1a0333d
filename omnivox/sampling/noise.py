"""Counter-based noise: uniform and Gumbel draws that are a pure function of
(seed, stream, step, index), built from integer tensor ops.

No `torch.Generator` state is involved, so a row draws the same values alone or in any batch,
in any row order, on any device and inside a CUDA graph (seed and step are ordinary tensors that
a graph reads from its static buffers).

Hash: the splitmix64 finaliser (Steele, Lea & Flood 2014; the output function of Java's
SplittableRandom) on int64 tensors. Multiplies wrap modulo 2**64 (two's complement) and right
shifts are made LOGICAL by masking, since torch's `>>` on int64 is arithmetic. Keys are chained:

    key = mix(mix(seed + mix(stream)) + step * GOLDEN)      # [B]
    bits[b, i] = mix(key[b] + i * GOLDEN)                   # [B, n]: splitmix64's sequence from key

`stream` names the (stage, code group) so two draws of one request at one step never share noise.
"""
from __future__ import annotations

import secrets

import torch

_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    """Python int -> the int64 with the same low 64 bits."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)

# ---- streams: one per (stage, code group) ----------------------------------------------------
THINKER = 1
TALKER = 2
FISH_SEMANTIC = 3
FISH_RAS = 4
MOSHI_TEXT = 5


def moshi_audio(codebook: int) -> int:
    """Stream of Moshi's depformer codebook `codebook` (0..dep_q-1)."""
    return 0x300 + codebook


def code_predictor(group: int) -> int:
    """Stream of the Qwen3-Omni code predictor's code group `group` (1..)."""
    return 0x100 + group


def fish_residual(codebook: int) -> int:
    """Stream of S2's residual codebook `codebook` (1.. for c1..c9)."""
    return 0x200 + codebook


# ---- seeds (host side) -----------------------------------------------------------------------
def seed_to_int64(seed: int) -> int:
    """A user seed (any Python int: negative, or up to 2**64 - 1 and beyond) -> int64, by its low
    64 bits. Seeds equal modulo 2**64 draw the same noise."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    return _signed(seed)


def draw_seed() -> int:
    """A fresh seed for an unseeded request, drawn at admission (non-negative, < 2**63, so a user
    can pass it back to reproduce the request)."""
    return secrets.randbits(63)


# ---- the hash ----------------------------------------------------------------------------------
def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 by 0 < s < 64."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser, a bijection on 64-bit words."""
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def _mix_int(x: int) -> int:
    """_mix on a Python int (host side, used for the stream constant)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return _signed(x ^ (x >> 31))


def bits(seed: torch.Tensor, stream: int, step: torch.Tensor, n: int) -> torch.Tensor:
    """seed [B] int64, step [B] int64 -> [B, n] int64 of 64 pseudo-random bits each."""
    key = _mix(_mix(seed + _mix_int(stream)) + step * _GOLDEN)  # [B]
    index = torch.arange(n, dtype=torch.int64, device=seed.device)  # [n]
    return _mix(key[:, None] + index[None] * _GOLDEN)  # [B, n]


def uniform(seed: torch.Tensor, stream: int, step: torch.Tensor, n: int) -> torch.Tensor:
    """[B, n] float32 in the open interval (0, 1): the top 23 bits m as (m + 0.5) / 2**23, so every
    value is exact in float32 and identical on every device; min 2**-24, max 1 - 2**-24."""
    m = _shr(bits(seed, stream, step, n), 41)
    return (m * 2 + 1).to(torch.float32) * 2.0 ** -24


def gumbel(seed: torch.Tensor, stream: int, step: torch.Tensor, n: int) -> torch.Tensor:
    """[B, n] float32 standard Gumbel noise -log(-log(u)).

    u takes the top 52 bits of the same hash (so Gumbel tails reach about -3.6 and +36.7) and the
    logs run in float64 before rounding to float32. NOTE: u is bit-identical everywhere; the logs
    are libm's, so a CPU and a GPU value can differ in the last float32 bit only when the float64
    result lies within one float64 ulp of a float32 rounding boundary."""
    m = _shr(bits(seed, stream, step, n), 12)
    u = (m * 2 + 1).to(torch.float64) * 2.0 ** -53
    return (-torch.log(-torch.log(u))).to(torch.float32)
