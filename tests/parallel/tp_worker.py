"""One rank of tests/parallel/test_tp_shard.py: loads each checkpoint whole and as its shard, runs
both, and puts (rank, findings) on the queue; the assertions live in the test."""
from __future__ import annotations

import copy
import hashlib
import traceback
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from omnivox.layers.attention import DenseKVCache
from omnivox.layers.mlp import SwiGLU
from omnivox.layers.moe import SparseMoE
from omnivox.models.qwen3_omni.sharding import checkpoint_cut, local_kv_heads, shard_thinker
from omnivox.models.qwen3_omni.weights import load_model, shard_files, to_disk_layout
from omnivox.parallel.group import TPGroup, init_group
from omnivox.parallel.shard import piece, shard_mlp

PROMPT = [151644, 8948, 198, 100, 101, 151645, 198, 151644, 872, 198, 102, 103, 104, 151645, 198, 151644, 77091, 198]
DECODE_STEPS = 4


def run(rank: int, size: int, port: int, folders: list[str], queue) -> None:
    try:
        torch.set_num_threads(1)
        tp = init_group(rank, size, port, timeout_s=30)
        try:
            found = {Path(f).name: check_checkpoint(tp, Path(f)) for f in folders}
            queue.put((rank, found | {"mlp": check_mlps(tp)}))
        finally:
            tp.close()
    except BaseException:
        queue.put((rank, traceback.format_exc()))


@contextmanager
def counting(tp: TPGroup):
    """Count tp's collectives inside the block (the sharded modules hold this very object)."""
    counts = Counter()
    for name in ("all_reduce", "all_gather"):
        def wrapped(*args, _fn=getattr(tp, name), _name=name, **kwargs):
            counts[_name] += 1
            return _fn(*args, **kwargs)
        setattr(tp, name, wrapped)
    try:
        yield counts
    finally:
        del tp.all_reduce, tp.all_gather  # back to the class's methods


def check_checkpoint(tp: TPGroup, folder: Path) -> dict:
    full = load_model(folder, progress=False)
    loaded = load_model(folder, progress=False, tp=tp)
    sharded = load_model(folder, progress=False)
    shard_thinker(sharded, tp)
    with counting(tp) as counts:
        got_ids, got, collectives = greedy(loaded, counts)
    want_ids, want, _ = greedy(full, Counter())
    return {"slice_mismatches": slice_mismatches(folder, loaded, tp),
            "cut_tensors": sum(checkpoint_cut(n) is not None for n in thinker_tensors(folder)),
            "load_vs_shard": state_mismatches(loaded, sharded),
            "kv_heads": (local_kv_heads(loaded), local_kv_heads(sharded), local_kv_heads(full)),
            "lm_head_rows": (loaded.thinker.lm_head.weight.shape[0], full.cfg.thinker.text.vocab_size),
            "max_logit_diff": (got - want).abs().max().item(), "logit_scale": want.abs().max().item(),
            "ids": (got_ids, want_ids), "logits_sha": hashlib.sha256(got.numpy().tobytes()).hexdigest(),
            "collectives": collectives, "layers": len(full.thinker.model.layers)}


@torch.no_grad()
def greedy(model, counts: Counter) -> tuple[list[int], torch.Tensor, list[dict]]:
    """Prefill PROMPT with a DenseKVCache, then DECODE_STEPS greedy steps -> (ids, logits [steps+1, V],
    the collectives of each forward)."""
    thinker, cache, n = model.thinker, DenseKVCache(), len(PROMPT)
    ids, logits, collectives = [], [], []
    x, pos = torch.tensor([PROMPT]), torch.arange(n).expand(3, 1, n)  # [1, S], [3, 1, S]
    for step in range(DECODE_STEPS + 1):
        counts.clear()
        h, _, _ = thinker(thinker.embed(x)[0], pos, cache)  # [1, S, H]
        logits.append(thinker.logits(h[0, -1]))  # [V]
        collectives.append(dict(counts))
        ids.append(int(logits[-1].argmax()))
        x, pos = torch.tensor([[ids[-1]]]), torch.full((3, 1, 1), n + step)
    return ids, torch.stack(logits), collectives


def thinker_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's Thinker text-stack tensors (the ones sharding may touch)."""
    out = {}
    for path in shard_files(folder):
        with safe_open(str(path), framework="pt") as f:
            out |= {k: f.get_tensor(k) for k in f.keys() if k.startswith(("thinker.model.", "thinker.lm_head."))}
    return out


def slice_mismatches(folder: Path, loaded, tp: TPGroup) -> list[str]:
    """Tensors of the sharded model (in checkpoint names) that differ from the rank's piece of the file's."""
    have = to_disk_layout(loaded.state_dict())
    bad = []
    for name, t in thinker_tensors(folder).items():
        axis = checkpoint_cut(name)
        if axis is not None:
            start, stop, c = piece(t.shape[axis], tp)
            pad = list(t.shape)
            pad[axis] = c - (stop - start)
            t = torch.cat((t.narrow(axis, start, stop - start), t.new_zeros(pad)), dim=axis)
        if name not in have or not torch.equal(have[name], t):
            bad.append(name)
    return bad


def state_mismatches(a, b) -> list[str]:
    """Tensors (and attention head counts and merged parts) that differ between two models."""
    sa, sb = a.state_dict(), b.state_dict()
    bad = [k for k in sa.keys() | sb.keys() if k not in sa or k not in sb or not torch.equal(sa[k], sb[k])]
    return bad + (["attention heads/parts"] if attention_layout(a) != attention_layout(b) else [])


def attention_layout(model) -> list[tuple]:
    return [(layer.self_attn.heads, layer.self_attn.kv_heads, layer.self_attn.qkv_proj.parts,
             layer.self_attn.qk_norm.parts) for layer in model.thinker.model.layers]


@torch.no_grad()
def check_mlps(tp: TPGroup) -> dict:
    """A dense SwiGLU and a MoE with a shared expert (the tiny Thinker has neither) against their shards:
    (max difference, collectives)."""
    torch.manual_seed(0)  # the same weights and input on every rank
    x = torch.randn(5, 32)
    out = {}
    for name, mlp in (("swiglu", SwiGLU(32, 64)), ("moe_shared", SparseMoE(32, 4, 16, 2, True, 32))):
        for p in mlp.parameters():
            p.normal_(0, 0.3)
        part = copy.deepcopy(mlp)
        shard_mlp(part, tp)
        with counting(tp) as counts:
            diff = (part(x) - mlp(x)).abs().max().item()
        out[name] = (diff, dict(counts))
    return out
