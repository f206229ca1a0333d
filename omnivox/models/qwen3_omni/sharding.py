"""The Qwen3-Omni Thinker's tensor-parallel shard (the cuts: `omnivox/parallel/shard.py`), and the
same cuts stated on its checkpoint's tensor names, which the loader reads by (`weights.py`).

NOTE: the replicated parts (router, norms, sampling) stay in step only because every rank holds the
same bytes after each collective (gloo and NCCL hand every rank the same reduced values); a rank
that computed a replicated part differently (another kernel or dtype) could route a token to other
experts and diverge silently.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

from omnivox.errors import OmnivoxError
from omnivox.models.qwen3_omni.config import DecoderConfig
from omnivox.parallel.group import TPGroup
from omnivox.parallel.shard import shard_attention, shard_mlp, shard_vocab

if TYPE_CHECKING:
    from omnivox.models.qwen3_omni.model import Qwen3OmniModel

# checkpoint tensors split across ranks: o_proj and down_proj by columns (axis 1), the rest by rows;
# a block-FP8 weight's scales (`weight_scale_inv`) along the same axis (`parallel.shard`: whole blocks)
_CUT = re.compile(r"^thinker\.(lm_head|model\.layers\.\d+\.(self_attn\.[qkvo]_proj"
                  r"|mlp\.(experts\.\d+\.|shared_expert\.)?(gate|up|down)_proj))\.weight(_scale_inv)?$")


def checkpoint_cut(name: str) -> int | None:
    """The axis of on-disk tensor `name` a rank takes its `piece` of (None: every rank reads it whole)."""
    if not _CUT.match(name):
        return None
    return 1 if name.endswith(("o_proj.weight", "down_proj.weight", "o_proj.weight_scale_inv",
                               "down_proj.weight_scale_inv")) else 0


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
    shard_vocab(thinker.lm_head, tp)
    thinker.tp = tp


def local_kv_heads(model: Qwen3OmniModel) -> int:
    """KV heads of the Thinker's attention on this rank (all of them when unsharded): a KV pool's width."""
    return model.thinker.model.layers[0].self_attn.kv_heads


