"""Phase kernels: the paged-attention backends and the MoE experts at the models' real shapes.

Attention: `triton_paged` against `torch_ref` (the oracle) for one layer of the Thinker, the
Talker and S2's slow AR: decode steps of B rows with real context lengths, and one mixed batch
(decode rows, a chunk over a past, a fresh prefill); at the Thinker's shape that batch again under a
sliding window (AttentionMetadata.window, Moshi's ring) as short as the shortest past, whose
positions before each row's window hold NaN like a freed page. Pages are shuffled, every slot no row owns holds NaN,
errors are relative to torch_ref run in fp32 on the same inputs; time is µs per call
(= per layer; the per-step layout torch_ref derives once is cached in the metadata after the
warm-up, as in a real step). MoE: one Thinker and one Talker layer's routed experts (the
engine's grouped path) against the per-expert loop, µs per layer and the weight bytes it reads.
"""
from __future__ import annotations

import os
import random

import torch

from gpuverify.runner import Box, Skip, State
from gpuverify.timing import rel_err, time_us

PAGE = 16


def kernels(box: Box, st: State) -> bool:
    backends = _backends(st.device)
    shapes = attention_shapes(st.sizes)
    r = box.results
    r["attention"], ok = [], True
    for label, (heads, kv_heads, head_dim) in shapes.items():
        # the windowed batch at the first shape only (the kernel's window path does not depend on it)
        for past, new, what, window in _cases(st.sizes, sum(map(ord, label)), windowed=label == next(iter(shapes))):
            box.check(f"attention {label} {what}")
            case = _guarded(_attention_case, backends, past, new, heads, kv_heads, head_dim, st, window)
            case.update(shape=label, step=what, heads=f"{heads}/{kv_heads}x{head_dim}")
            ok &= case["ok"]
            r["attention"].append(case)
    r["moe"] = []
    for label, mlp in _moe_layers(st):
        for b in st.sizes.kernel_batches:
            box.check(f"moe {label} B={b}")
            case = _guarded(_moe_case, mlp, b, st)
            case.update(layer=label, batch=b)
            ok &= case["ok"]
            r["moe"].append(case)
    return ok


def _guarded(fn, *args) -> dict:
    """One case; its failure (e.g. a kernel that does not compile) is recorded, the next case runs."""
    try:
        return fn(*args)
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}


def _backends(device: str) -> dict:
    from omnivox.attention.torch_ref import TorchPagedAttention

    if not device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        raise Skip("no CUDA device and TRITON_INTERPRET is not 1: the Triton kernels cannot run here")
    try:
        from omnivox.attention.triton_paged import TritonPagedAttention, triton_available
    except ImportError as e:
        raise Skip(f"triton does not import: {e}") from None
    if not triton_available():
        raise Skip("triton_available() is false")
    return {"torch_ref": TorchPagedAttention(), "triton_paged": TritonPagedAttention()}


def attention_shapes(sizes) -> dict[str, tuple[int, int, int]]:
    """(q heads, kv heads, head_dim) of each paged stage."""
    from gpuverify.sizes import s2_configs
    from omnivox.models.qwen3_omni.config import Qwen3OmniConfig

    q = Qwen3OmniConfig.from_hf(sizes.qwen_config)
    s2 = s2_configs(sizes.s2_config)[0].text
    th, tk = q.thinker.text, q.talker.text
    return {"thinker": (th.num_attention_heads, th.num_key_value_heads, th.head_dim),
            "talker": (tk.num_attention_heads, tk.num_key_value_heads, tk.head_dim),
            "s2_slow_ar": (s2.n_head, s2.n_local_heads, s2.head_dim)}


def _cases(sizes, seed: int, windowed: bool):
    """(past, new, label, window): a decode step per batch size, then one mixed batch, unwindowed and
    (`windowed`) again under a window."""
    rng = random.Random(seed)
    lo, hi = sizes.kernel_context
    for b in sizes.kernel_batches:
        yield [rng.randint(lo, hi) for _ in range(b)], [1] * b, f"decode B={b}", None
    prefill, chunk_past = sizes.kernel_prefill
    past = [rng.randint(lo, hi) for _ in range(3)] + [chunk_past, 0]
    what = f"mixed (3 decode, chunk {prefill} over {chunk_past}, prefill {prefill})"
    yield past, [1, 1, 1, prefill, prefill], what, None
    window = min(lo, chunk_past)
    if windowed:
        yield past, [1, 1, 1, prefill, prefill], f"{what}, window {window}", window


@torch.no_grad()
def _attention_case(backends: dict, past, new, heads, kv_heads, head_dim, st: State, window: int | None) -> dict:
    from omnivox.attention.metadata import build_metadata

    dev, dtype = st.device, kernel_dtype(st.device)
    g = torch.Generator(device=dev).manual_seed(len(past) * 7919 + sum(past))
    need = [-(-(p + n) // PAGE) for p, n in zip(past, new)]
    blocks = sum(need) + 2  # two spare pages nobody owns
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(sum(need))).tolist()
    tables, at = [], 0
    for k in need:
        tables.append(order[at:at + k])
        at += k
    meta = build_metadata(tables, past, new, block_size=PAGE, dummy_slot=blocks * PAGE, device=dev, window=window)
    shape = ((blocks + 1) * PAGE, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=dev)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=dev)
    # windowed: a row's positions before its first new token's window stay NaN (as if freed)
    start = [0 if window is None else max(0, p - window + 1) for p in past]
    owned = torch.cat([_slots(t, p, dev)[s:] for t, p, s in zip(tables, past, start) if p])
    k_cache[owned] = torch.randn((owned.numel(), kv_heads, head_dim), generator=g, device=dev).to(dtype)
    v_cache[owned] = torch.randn((owned.numel(), kv_heads, head_dim), generator=g, device=dev).to(dtype)
    n = sum(new)
    q, k, v = (torch.randn((n, h, head_dim), generator=g, device=dev).to(dtype) for h in (heads, kv_heads, kv_heads))

    def run(backend, dt):
        kc, vc = k_cache.to(dt, copy=True), v_cache.to(dt, copy=True)  # a fresh copy per backend
        meta.derived.clear()
        return (lambda: backend.forward(q.to(dt), k.to(dt), v.to(dt), kc, vc, meta)), kc

    ref_fn, _ = run(backends["torch_ref"], torch.float32)
    ref = ref_fn()
    out = {"rows": len(past), "tokens": n, "max_context": max(p + m for p, m in zip(past, new)), "dtype": str(dtype),
           "window": window}
    ok = True
    for name, backend in backends.items():
        fn, _ = run(backend, dtype)
        got = fn()
        err = rel_err(got, ref)
        out[f"{name}_rel_err"] = err
        out[f"{name}_us"] = round(time_us(fn, dev, st.sizes.timing_iters), 1)
        ok &= bool(torch.isfinite(got).all()) and err <= 1e-2
    out["ok"] = ok
    return out


def kernel_dtype(device: str) -> torch.dtype:
    """bf16, as served; fp16 under Triton's CPU interpreter, which multiplies bf16 `tl.dot`
    operands as raw 16-bit integers (the attention tests skip bf16 there for the same reason)."""
    return torch.bfloat16 if device.startswith("cuda") else torch.float16


def _slots(table: list[int], length: int, device: str) -> torch.Tensor:
    pos = torch.arange(length)
    return (torch.tensor(table)[pos // PAGE] * PAGE + pos % PAGE).to(device)


def _moe_layers(st: State):
    """The first Thinker and Talker MoE blocks of the built model, else standalone ones at the
    configured sizes (random weights) when the build phase did not run."""
    if st.qwen is not None:
        yield "thinker", st.qwen.thinker.model.layers[0].mlp
        yield "talker", st.qwen.talker.model.layers[0].mlp
        return
    from omnivox.layers.moe import SparseMoE
    from omnivox.models.qwen3_omni.config import Qwen3OmniConfig

    cfg = Qwen3OmniConfig.from_hf(st.sizes.qwen_config)
    for label, c in (("thinker", cfg.thinker.text), ("talker", cfg.talker.text)):
        with torch.device(st.device):
            mlp = SparseMoE(c.hidden_size, c.num_experts, c.moe_intermediate_size, c.num_experts_per_tok,
                            c.norm_topk_prob, c.shared_expert_intermediate_size).to(torch.bfloat16)
        for p in mlp.parameters():
            p.data.normal_().mul_(p.shape[-1] ** -0.5)
        yield label, mlp


@torch.no_grad()
def _moe_case(mlp, batch: int, st: State) -> dict:
    from omnivox.layers.moe import experts_impl

    ex = mlp.experts
    w = next(mlp.parameters())
    g = torch.Generator(device=st.device).manual_seed(batch)
    x = torch.randn((batch, ex.gate_up_proj.shape[-1]), generator=g, device=st.device).to(w.dtype)
    top_idx, top_w = mlp.gate(x)
    fn = lambda: ex(x, top_idx, top_w)  # noqa: E731 - the engine's path: no host read
    got, ref = fn(), ex.forward_loop(x, top_idx, top_w)
    us = time_us(fn, st.device, st.sizes.timing_iters)
    hit = int(top_idx.unique().numel())
    per_expert = (ex.gate_up_proj[0].numel() + ex.down_proj[0].numel()) * ex.gate_up_proj.element_size()
    err = rel_err(got, ref)
    return {"impl": experts_impl(x, ex.down_proj.shape[-1]), "experts_hit": hit, "us": round(us, 1),
            "weight_gb": round(hit * per_expert / 1e9, 4), "gb_s": round(hit * per_expert / us / 1e3, 1),
            "rel_err_vs_loop": err, "ok": bool(torch.isfinite(got).all()) and err <= 2e-2}
