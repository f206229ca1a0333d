"""Megatron-style cuts of the decoder layers, in place: one rank's piece of each weight.

Rank r of N keeps:
  attention  q/k/v rows of its heads: q heads [r*H/N, (r+1)*H/N), kv heads [r*Hkv/N, ...) (GQA
             pairs stay on one rank), the q/k norm rows alike; o_proj's input columns of those
             heads (row-parallel) + one all_reduce
  mlp        a MoE's router whole (every rank routes alike); inside every expert, a shared expert
             and a dense SwiGLU: I/N rows of gate and of up, the matching I/N columns of down + one
             all_reduce of the output
  vocab      an output head's rows [r*c, (r+1)*c), c = ceil(V/N), zero rows padding the last rank,
             the logits gathered on every rank
Every cut is an equal piece of one axis (`piece`), so a family can state the same cuts on its
checkpoint's tensor names and read only a rank's pieces (Qwen3-Omni: models/qwen3_omni/sharding.py).
Each function works on a loaded module and on one still on the meta device (the loader's use).
Block-FP8 weights (`layers.fp8`) take their scales' matching rows/columns along; a cut that would
split a block (a piece not a multiple of the block size) is refused.
"""
from __future__ import annotations

import torch
from torch import nn

from omnivox.errors import OmnivoxError
from omnivox.layers.attention import DecoderAttention
from omnivox.layers.fp8 import FP8Experts, FP8Linear
from omnivox.layers.merged import row_parts
from omnivox.layers.mlp import SwiGLU
from omnivox.layers.moe import FusedExperts, SparseMoE
from omnivox.parallel.group import TPGroup


def piece(n: int, tp: TPGroup) -> tuple[int, int, int]:
    """This rank's piece of an axis of length n: (start, stop, c) with c = ceil(n / N) its padded
    length; stop - start < c only at the end of an axis N does not divide (the vocab)."""
    c = -(-n // tp.size)
    start = min(tp.rank * c, n)
    return start, min(start + c, n), c


def shard_attention(attn: DecoderAttention, tp: TPGroup) -> None:
    attn.heads //= tp.size
    attn.kv_heads //= tp.size
    _part_rows(attn.qkv_proj, tp)
    _part_rows(attn.qk_norm, tp)
    _columns(attn.o_proj, tp)
    attn.tp = tp


def shard_mlp(mlp: SwiGLU | SparseMoE, tp: TPGroup) -> None:
    """A SwiGLU, or a MoE with its experts (and shared expert) cut inside; `mlp` sums the partials."""
    if isinstance(mlp, SparseMoE):
        _experts(mlp.experts, tp)
        if hasattr(mlp, "shared_expert"):
            _swiglu(mlp.shared_expert, tp)
    else:
        _swiglu(mlp, tp)
    mlp.tp = tp


def _swiglu(mlp: SwiGLU, tp: TPGroup) -> None:
    _part_rows(mlp.gate_up_proj, tp)
    _columns(mlp.down_proj, tp)


def _block_piece(n: int, block: int, tp: TPGroup, what: str) -> tuple[slice, slice]:
    """This rank's piece of an FP8 weight's axis of length n and of its scales' axis."""
    start, stop, c = piece(n, tp)
    if tp.size > 1 and c % block:
        raise OmnivoxError(f"tensor parallel size {tp.size} would cut the FP8 blocks of {what}: a rank's "
                           f"{c} of {n} is not a multiple of the block size {block}")
    return slice(start, stop), slice(start // block, -(-stop // block))


def _experts(experts: FusedExperts, tp: TPGroup) -> None:
    gate_up, down = experts.gate_up_proj, experts.down_proj  # [E, 2I, H], [E, H, I]
    inter = down.shape[-1]
    start, stop, _ = piece(inter, tp)
    if isinstance(experts, FP8Experts):
        rows, srows = _block_piece(inter, experts.block[0], tp, "the experts' gate/up")
        _, scols = _block_piece(inter, experts.block[1], tp, "the experts' down_proj")
        su, sd = experts.gate_up_proj_scale_inv, experts.down_proj_scale_inv
        experts.gate_up_proj_scale_inv = _param(su.unflatten(1, (2, su.shape[1] // 2))[:, :, srows].flatten(1, 2), su)
        experts.down_proj_scale_inv = _param(sd[..., scols], sd)
    # [E, 2I/N, H]: this rank's gate rows, then its up rows
    experts.gate_up_proj = _param(gate_up.unflatten(1, (2, inter))[:, :, start:stop].flatten(1, 2), gate_up)
    experts.down_proj = _param(down[..., start:stop], down)  # [E, H, I/N]


def _part_rows(merged: nn.Module, tp: TPGroup) -> None:
    """This rank's rows of each part of a merged weight (`layers.merged`: q||k||v, gate||up, q/k norm)."""
    pieces, sizes, scales = [], {}, []
    fp8 = isinstance(merged, FP8Linear)
    for part, sp in zip(merged.parts, merged.scale_parts() if fp8 else merged.parts):
        n = part.rows.stop - part.rows.start
        start, stop, _ = piece(n, tp)
        if fp8:
            _, srows = _block_piece(n, merged.block[0], tp, part.name)
            scales.append(merged.weight_scale_inv[sp.rows][srows])
        pieces.append(merged.weight[part.rows][start:stop])
        sizes[part.name] = stop - start
    if fp8:
        merged.weight_scale_inv = _param(torch.cat(scales), merged.weight_scale_inv)
    first = merged.parts[0]  # every part has one row shape
    row_shape = first.shape if first.broadcast() else first.shape[1:]
    merged.parts = row_parts(sizes, row_shape, first.broadcast())
    merged.weight = _param(torch.cat(pieces), merged.weight)
    if isinstance(merged, (nn.Linear, FP8Linear)):
        merged.out_features = merged.weight.shape[0]


def _columns(linear: nn.Linear | FP8Linear, tp: TPGroup) -> None:
    start, stop, _ = piece(linear.in_features, tp)
    if isinstance(linear, FP8Linear):
        _, scols = _block_piece(linear.in_features, linear.block[1], tp, "o_proj/down_proj columns")
        linear.weight_scale_inv = _param(linear.weight_scale_inv[:, scols], linear.weight_scale_inv)
    linear.weight = _param(linear.weight[:, start:stop], linear.weight)
    linear.in_features = stop - start


def shard_vocab(linear: nn.Linear, tp: TPGroup) -> None:
    """Vocab-parallel rows [r*c, (r+1)*c), c = ceil(V/N), zero rows padding the last rank."""
    start, stop, c = piece(linear.out_features, tp)
    w = linear.weight.new_zeros(c, linear.in_features)  # [ceil(V/N), H], zero rows past the vocab
    w[:stop - start] = linear.weight[start:stop]
    linear.weight = _param(w, linear.weight)
    linear.out_features = c


def _param(t: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    """A parameter of its own storage (the full tensor is freed once the module lets go of it)."""
    return nn.Parameter(t.clone(memory_format=torch.contiguous_format), requires_grad=like.requires_grad)
