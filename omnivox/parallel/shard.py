"""One rank's shard of the Thinker's text stack (Megatron-style cuts); everything else stays whole.

Per decoder layer, rank r of N keeps:
  self_attn  q/k/v rows of its heads: q heads [r*H/N, (r+1)*H/N), kv heads [r*Hkv/N, ...) (GQA
             pairs stay on one rank), the q/k norm rows alike; o_proj's input columns of those
             heads (row-parallel) + one all_reduce
  mlp        router whole (every rank routes alike); inside every expert, a shared expert and a
             dense SwiGLU: I/N rows of gate and of up, the matching I/N columns of down + one
             all_reduce of the MoE output
and lm_head keeps vocab rows [r*c, (r+1)*c), c = ceil(V/N), zero rows padding the last rank, the
logits gathered on every rank. A forward issues 2 all_reduce per layer and 1 all_gather (logits).

Every cut is an equal piece of one axis (`piece`), so `checkpoint_cut(name)` states the same cuts
on the checkpoint's tensor names: the loader reads a rank's pieces without the full tensors
(`weights.load_model(tp=...)`), and its result equals `shard_thinker` of the full model.

NOTE: the replicated parts (router, norms, sampling) stay in step only because every rank holds the
same bytes after each collective (gloo and NCCL hand every rank the same reduced values); a rank
that computed a replicated part differently (another kernel or dtype) could route a token to other
experts and diverge silently.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
from torch import nn

from omnivox.errors import OmnivoxError
from omnivox.layers.attention import DecoderAttention
from omnivox.layers.merged import row_parts
from omnivox.layers.mlp import SwiGLU
from omnivox.layers.moe import FusedExperts, SparseMoE
from omnivox.parallel.group import TPGroup

if TYPE_CHECKING:
    from omnivox.models.qwen3_omni.config import DecoderConfig
    from omnivox.models.qwen3_omni.model import Qwen3OmniModel

# checkpoint tensors split across ranks: o_proj and down_proj by columns (axis 1), the rest by rows
_CUT = re.compile(r"^thinker\.(lm_head|model\.layers\.\d+\.(self_attn\.[qkvo]_proj"
                  r"|mlp\.(experts\.\d+\.|shared_expert\.)?(gate|up|down)_proj))\.weight$")


def piece(n: int, tp: TPGroup) -> tuple[int, int, int]:
    """This rank's piece of an axis of length n: (start, stop, c) with c = ceil(n / N) its padded
    length; stop - start < c only at the end of an axis N does not divide (the vocab)."""
    c = -(-n // tp.size)
    start = min(tp.rank * c, n)
    return start, min(start + c, n), c


def checkpoint_cut(name: str) -> int | None:
    """The axis of on-disk tensor `name` a rank takes its `piece` of (None: every rank reads it whole)."""
    if not _CUT.match(name):
        return None
    return 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0


def check_divisible(cfg: DecoderConfig, size: int) -> None:
    """Every axis cut without padding must split into `size` equal pieces."""
    axes = {"attention heads": cfg.num_attention_heads, "kv heads": cfg.num_key_value_heads}
    if cfg.num_experts:
        axes["expert intermediate size"] = cfg.moe_intermediate_size
        if cfg.shared_expert_intermediate_size:
            axes["shared expert intermediate size"] = cfg.shared_expert_intermediate_size
    else:
        axes["intermediate size"] = cfg.intermediate_size
    bad = [f"{what} ({n})" for what, n in axes.items() if n % size]
    if bad:
        raise OmnivoxError(f"tensor parallel size {size} does not divide the Thinker's {', '.join(bad)}")


def shard_thinker(model: Qwen3OmniModel, tp: TPGroup) -> None:
    """Turn the Thinker's text layers and lm_head into rank `tp.rank`'s shard, in place: slices the
    parameters, makes the attention head counts local and hands `tp` to the modules that sum or
    gather. Works on a loaded model and on one still on the meta device (the loader's use)."""
    thinker = model.thinker
    if thinker.tp is not None:
        raise OmnivoxError("the Thinker is already sharded")
    check_divisible(model.cfg.thinker.text, tp.size)
    for layer in thinker.model.layers:
        shard_attention(layer.self_attn, tp)
        shard_mlp(layer.mlp, tp)
    _vocab_rows(thinker.lm_head, tp)
    thinker.tp = tp


def local_kv_heads(model: Qwen3OmniModel) -> int:
    """KV heads of the Thinker's attention on this rank (all of them when unsharded): a KV pool's width."""
    return model.thinker.model.layers[0].self_attn.kv_heads


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


def _experts(experts: FusedExperts, tp: TPGroup) -> None:
    gate_up, down = experts.gate_up_proj, experts.down_proj  # [E, 2I, H], [E, H, I]
    inter = down.shape[-1]
    start, stop, _ = piece(inter, tp)
    # [E, 2I/N, H]: this rank's gate rows, then its up rows
    experts.gate_up_proj = _param(gate_up.unflatten(1, (2, inter))[:, :, start:stop].flatten(1, 2), gate_up)
    experts.down_proj = _param(down[..., start:stop], down)  # [E, H, I/N]


def _part_rows(merged: nn.Module, tp: TPGroup) -> None:
    """This rank's rows of each part of a merged weight (`layers.merged`: q||k||v, gate||up, q/k norm)."""
    pieces, sizes = [], {}
    for part in merged.parts:
        start, stop, _ = piece(part.rows.stop - part.rows.start, tp)
        pieces.append(merged.weight[part.rows][start:stop])
        sizes[part.name] = stop - start
    first = merged.parts[0]  # every part has one row shape
    row_shape = first.shape if first.broadcast() else first.shape[1:]
    merged.parts = row_parts(sizes, row_shape, first.broadcast())
    merged.weight = _param(torch.cat(pieces), merged.weight)
    if isinstance(merged, nn.Linear):
        merged.out_features = merged.weight.shape[0]


def _columns(linear: nn.Linear, tp: TPGroup) -> None:
    start, stop, _ = piece(linear.in_features, tp)
    linear.weight = _param(linear.weight[:, start:stop], linear.weight)
    linear.in_features = stop - start


def _vocab_rows(linear: nn.Linear, tp: TPGroup) -> None:
    start, stop, c = piece(linear.out_features, tp)
    w = linear.weight.new_zeros(c, linear.in_features)  # [ceil(V/N), H], zero rows past the vocab
    w[:stop - start] = linear.weight[start:stop]
    linear.weight = _param(w, linear.weight)
    linear.out_features = c


def _param(t: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    """A parameter of its own storage (the full tensor is freed once the module lets go of it)."""
    return nn.Parameter(t.clone(memory_format=torch.contiguous_format), requires_grad=like.requires_grad)
