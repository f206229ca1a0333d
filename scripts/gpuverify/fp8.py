"""Phase fp8: the block-FP8 Triton kernels (omnivox/layers/fp8_triton.py) at the Thinker's shapes.

For decode batches B = 1, 8, 32 (--tiny: its kernel batches): the fused q/k/v projection and one
MoE layer's routed experts (gate||up then down, the experts of the step in one launch each), with
weights quantized to 128 x 128 blocks. Each against bf16 on the dequantized weights (the part-1
path: dequantize then matmul): relative error against fp32 on the dequantized weights, and µs per
call of the FP8 kernel and of bf16 (torch's matmul / grouped_mm). ok: relative error below 5e-2
(a linear) and 1e-1 (the experts: two GEMMs with the activations quantized before each). Where torch offers block-scaled
`torch._scaled_mm` (sm90, B = 128), it is timed beside the Triton GEMM; a failure is recorded.
Then the engine: the real-depth narrow Qwen3-Omni (`sizes.narrow`; --tiny: the tiny config), its
checkpoint written once, and a block-FP8 copy of it in 16 x 16 blocks (the narrow widths, 16-64, are
below 128: in 128-blocks the merged q/k/v parts and the 16-wide experts would not line up with their
blocks and would keep dequantizing), loaded in bf16 (fp32 on CPU) and FP8 (compute "auto": the
kernels on sm89+, dequantize elsewhere), ms per Thinker decode step at
B = 1, 8, 32 for text-only greedy requests (the device synchronized around each step), and how
many of the FP8 run's greedy ids equal the bf16 run's (W8A8 rounds differently: not all need to).
"""
from __future__ import annotations

import os

import torch

from gpuverify.runner import Box, Skip, State
from gpuverify.timing import rel_err, time_us

BLOCK = 128
DECODE_BLOCK = 16


def fp8(box: Box, st: State) -> bool:
    if not st.device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        raise Skip("no CUDA device and TRITON_INTERPRET is not 1: the Triton kernels cannot run here")
    if st.device.startswith("cuda") and torch.cuda.get_device_capability() < (8, 9):
        raise Skip(f"FP8 tensor cores need sm89+, this device is sm{''.join(map(str, torch.cuda.get_device_capability()))}")
    from omnivox.layers import fp8_triton as ft
    from omnivox.models.qwen3_omni.config import Qwen3OmniConfig

    t = Qwen3OmniConfig.from_hf(st.sizes.qwen_config).thinker.text
    h, inter = t.hidden_size, t.moe_intermediate_size
    qkv = (t.num_attention_heads + 2 * t.num_key_value_heads) * t.head_dim
    g = torch.Generator(device=st.device).manual_seed(0)
    r = box.results
    r["block"], r["shapes"] = BLOCK, {"qkv": [qkv, h], "gate_up": [t.num_experts, 2 * inter, h],
                                      "down": [t.num_experts, h, inter], "top_k": t.num_experts_per_tok}
    w_qkv = _quantized(torch.randn(qkv, h, device=st.device, generator=g) * 0.02, ft)
    experts = [_quantized(torch.randn(t.num_experts, 2 * inter, h, device=st.device, generator=g) * 0.02, ft),
               _quantized(torch.randn(t.num_experts, h, inter, device=st.device, generator=g) * 0.02, ft)]
    iters = st.sizes.timing_iters
    ok = True
    r["linear"], r["moe"] = [], []
    batches = (1, 8, 32) if st.sizes.name != "tiny" else st.sizes.kernel_batches
    for b in batches:
        box.check(f"linear B={b}")
        x = torch.randn(b, h, device=st.device, generator=g).to(torch.bfloat16)
        case = _linear_case(x, w_qkv, ft, st.device, iters)
        case["batch"] = b
        ok &= case["ok"]
        r["linear"].append(case)
        box.check(f"moe B={b}")
        case = _moe_case(x, experts, t.num_experts_per_tok, ft, st.device, iters, g)
        case["batch"] = b
        ok &= case["ok"]
        r["moe"].append(case)
    box.check("decode steps")
    r["decode"] = _decode_steps(box, st)
    return ok


def _decode_steps(box: Box, st: State) -> dict:
    from gpuverify import sizes
    from gpuverify.spec import decode_run, text_prompts
    from omnivox.models.qwen3_omni.random_init import save_random_checkpoint
    from omnivox.models.qwen3_omni.weights import load_model

    config = sizes.narrow().qwen_config if st.sizes.name == "full" else st.sizes.qwen_config
    folder = st.out / "fp8_narrow"
    save_random_checkpoint(config, folder, seed=3)
    fp8_folder = _fp8_copy(folder, st.out / "fp8_narrow_b16", DECODE_BLOCK)
    dtype = "bfloat16" if st.device.startswith("cuda") else "float32"
    batches = [b for b in (1, 8, 32) if b <= max(st.sizes.work.loop_concurrency, 1)] or [1]
    tokens = 24 if st.sizes.name == "full" else 4
    out: dict = {"dtype": dtype, "tokens": tokens, "block": DECODE_BLOCK}
    ids = {}
    for label, path in ((dtype, folder), ("fp8", fp8_folder)):
        box.check(f"decode {label}")
        model = load_model(path, dtype, st.device, progress=False)
        out[f"{label}_thinker_float8_bytes"] = sum(p.numel() for p in model.thinker.parameters()
                                                   if p.dtype == torch.float8_e4m3fn)
        vocab = model.cfg.thinker.text.vocab_size
        for b in batches:
            outs, ms, _, _ = decode_run(model, st, text_prompts(vocab, b), tokens, scheduling="fifo")
            out.setdefault(f"B={b}", {})[f"{label}_ms_per_step"] = ms
            ids[label, b] = [o.text_ids for o in outs]
        del model
    for b in batches:
        a, f = ids[dtype, b], ids["fp8", b]
        same = sum(x == y for ra, rf in zip(a, f) for x, y in zip(ra, rf))
        out[f"B={b}"]["ids_equal_share"] = round(same / max(sum(map(len, a)), 1), 3)
    return out


def _fp8_copy(src, dst, block: int):
    """A block-FP8 copy of checkpoint folder `src`: the AR stages' decoder projections float8 with
    their `weight_scale_inv`, config.json with the quantization_config that says so."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from omnivox.layers.fp8 import quantize

    layers = ("thinker.model.layers.", "talker.model.layers.", "talker.code_predictor.model.layers.")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    out = {}
    for name, t in load_file(str(dst / "model.safetensors")).items():
        if name.startswith(layers) and name.endswith("_proj.weight"):
            out[name], out[name + "_scale_inv"] = quantize(t, (block, block))
        else:
            out[name] = t
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [block, block]}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _quantized(w: torch.Tensor, ft) -> dict:
    """Block-quantize w [..., N, K] (128 x 128, amax / 448): the FP8 tensors and the bf16 dequantized twin."""
    n, k = w.shape[-2:]
    pad = torch.nn.functional.pad(w, (0, -k % BLOCK, 0, -n % BLOCK))
    blocks = pad.unflatten(-2, (-1, BLOCK)).unflatten(-1, (-1, BLOCK))
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / ft.FP8_MAX, torch.ones_like(amax)).float()
    q = (blocks / scale[..., :, None, :, None]).clamp(-ft.FP8_MAX, ft.FP8_MAX).to(torch.float8_e4m3fn)
    q = q.flatten(-4, -3).flatten(-2, -1)[..., :n, :k].contiguous()
    deq = q.float() * scale.repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)[..., :n, :k]
    return {"q": q, "scale": scale, "fp32": deq, "bf16": deq.to(torch.bfloat16)}


def _linear_case(x, w, ft, device, iters) -> dict:
    try:
        ref = x.float() @ w["fp32"].T
        got = ft.block_fp8_linear(x, w["q"], w["scale"], (BLOCK, BLOCK))
        bf16 = x @ w["bf16"].T
        case = {"rel_err_fp8": rel_err(got, ref), "rel_err_bf16": rel_err(bf16, ref),
                "us_fp8": time_us(lambda: ft.block_fp8_linear(x, w["q"], w["scale"], (BLOCK, BLOCK)), device, iters),
                "us_bf16": time_us(lambda: x @ w["bf16"].T, device, iters)}
        case["scaled_mm"] = _scaled_mm_case(x, w, ft, device, iters, ref)
        case["ok"] = case["rel_err_fp8"] < 5e-2
        return case
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}


def _scaled_mm_case(x, w, ft, device, iters, ref) -> dict:
    """torch's block-scaled FP8 GEMM (1 x 128 activation groups, 128 x 128 weight blocks), where it runs."""
    if not device.startswith("cuda"):
        return {"skipped": "CUDA only"}
    try:
        def run():
            xq, xs = ft.quantize_groups(x, BLOCK)
            return torch._scaled_mm(xq, w["q"].T, scale_a=xs, scale_b=w["scale"].T, out_dtype=torch.bfloat16)
        got = run()
        return {"rel_err": rel_err(got, ref), "us": time_us(run, device, iters)}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:500]}


def _moe_case(x, experts, top_k, ft, device, iters, g) -> dict:
    try:
        gate_up, down = experts
        e = gate_up["q"].shape[0]
        scores = torch.rand(x.shape[0], e, device=device, generator=g)
        top_idx = scores.topk(top_k, dim=-1).indices
        expert, order = torch.sort(top_idx.flatten(), stable=True)
        xs = x.index_select(0, order // top_k)  # [P, H] rows grouped by expert
        ends = torch.searchsorted(expert, torch.arange(e, device=device), right=True, out_int32=True)

        def fp8_path():
            gu = ft.block_fp8_grouped(xs, ends, gate_up["q"], gate_up["scale"], (BLOCK, BLOCK))
            a, b = gu.chunk(2, dim=-1)
            return ft.block_fp8_grouped(torch.nn.functional.silu(a) * b, ends, down["q"], down["scale"], (BLOCK, BLOCK))

        def dense_path(wgu, wd, rows):
            out = []
            for i in range(rows.shape[0]):  # the reference: each row through its own expert
                a, b = (rows[i] @ wgu[expert[i]].T).chunk(2, dim=-1)
                out.append((torch.nn.functional.silu(a) * b) @ wd[expert[i]].T)
            return torch.stack(out)

        ref = dense_path(gate_up["fp32"], down["fp32"], xs.float())
        got = fp8_path()
        case = {"rows": int(xs.shape[0]), "rel_err_fp8": rel_err(got, ref), "us_fp8": time_us(fp8_path, device, iters)}
        if hasattr(torch, "_grouped_mm") and device.startswith("cuda"):
            def bf16_path():
                a, b = torch._grouped_mm(xs, gate_up["bf16"].transpose(1, 2), offs=ends).chunk(2, dim=-1)
                return torch._grouped_mm(torch.nn.functional.silu(a) * b, down["bf16"].transpose(1, 2), offs=ends)
            case["rel_err_bf16"] = rel_err(bf16_path(), ref)
            case["us_bf16"] = time_us(bf16_path, device, iters)
        case["ok"] = case["rel_err_fp8"] < 1e-1  # two W8A8 GEMMs in a row, the intermediate quantized too
        return case
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
