"""Phase probe: versions, the APIs omnivox relies on, and the two ceilings (copy, bf16 matmul)."""
from __future__ import annotations

import importlib
import importlib.util
import platform
import sys

import torch

from gpuverify.runner import Box, State
from gpuverify.timing import time_us

PACKAGES = ("torch", "triton", "transformers", "numpy", "safetensors", "tokenizers", "jinja2", "tqdm", "scipy",
            "PIL", "soundfile", "fastapi", "uvicorn", "pydantic")


def probe(box: Box, st: State) -> bool:
    r = box.results
    r["python"] = platform.python_version()
    r["packages"] = {name: _version(name) for name in PACKAGES}
    r["device"] = _device(st.device)
    r["apis"] = _apis(st.device)
    box.check("the copy ceiling")
    r["copy"] = _copy(st.device, st.sizes.probe_copy_bytes, st.sizes.timing_iters)
    box.check("the matmul ceiling")
    r["matmul"] = _matmul(st.device, st.sizes.probe_matmul, st.sizes.timing_iters)
    return all(v for k, v in r["apis"].items() if k in ("grouped_mm", "custom_op"))


def _version(name: str) -> str | None:
    if importlib.util.find_spec(name) is None:
        return None
    try:
        return str(getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as e:  # present but broken
        return f"import fails: {type(e).__name__}: {e}"


def _device(device: str) -> dict:
    out = {"torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(), "platform": sys.platform}
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        out.update(name=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                   memory_gib=round(total / 2**30, 1), free_gib=round(free / 2**30, 1),
                   l2_mib=round(getattr(p, "L2_cache_size", 0) / 2**20, 1),
                   tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    return out


def _apis(device: str) -> dict:
    from omnivox.attention.backends import default_backend
    from omnivox.layers.moe import experts_impl

    x = torch.zeros(4, 64, dtype=torch.bfloat16, device=device)
    out = {"grouped_mm": hasattr(torch, "_grouped_mm"), "custom_op": hasattr(torch.library, "custom_op"),
           "cuda_graph": hasattr(torch.cuda, "CUDAGraph"), "attention_backend": default_backend(device),
           "experts_impl_bf16": experts_impl(x, 64)}
    if out["grouped_mm"]:
        try:  # one tiny grouped product on the device, bf16 (the engine's MoE path)
            w = torch.randn(2, 64, 32, dtype=torch.bfloat16, device=device)
            offs = torch.tensor([2, 4], dtype=torch.int32, device=device)
            torch._grouped_mm(torch.randn(4, 64, dtype=torch.bfloat16, device=device), w, offs=offs)
            out["grouped_mm_runs"] = True
        except Exception as e:
            out["grouped_mm_runs"] = f"{type(e).__name__}: {e}"
    try:
        import triton  # noqa: F401
        out["triton_imports"] = True
    except Exception as e:
        out["triton_imports"] = f"{type(e).__name__}: {e}"
    return out


def _copy(device: str, nbytes: int, iters: int) -> dict:
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), device, iters)
    return {"bytes": nbytes, "us": round(us, 1), "tb_s": round(2 * nbytes / us / 1e6, 3)}  # read + write


def _matmul(device: str, n: int, iters: int) -> dict:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)  # random, never zeros (METHOD.md)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    us = time_us(lambda: a @ b, device, iters)
    return {"n": n, "us": round(us, 1), "tflop_s": round(2 * n ** 3 / us / 1e6, 1)}
