"""Full-size models made on the device, with no checkpoint and no disk round trip.

omnivox's Qwen3-Omni is built on the meta device, materialised once on the target device and filled
with seeded random values drawn there (`random_init.randomize_on_device_`, scaled so every block
matters). transformers' `Qwen3OmniMoeForConditionalGeneration` is built on the meta device too and
each of its parameters becomes a view of omnivox's tensor of the same checkpoint name: omnivox's
fused q/k/v, gate/up and q/k-norm parameters are row blocks (views), its fused experts have
transformers' v5 layout. What cannot be a view is copied, and reported. Non-persistent buffers
are recomputed on the device by each library's own code. S2 Pro is built the same way (no
transformers model exists for it).
"""
from __future__ import annotations

import contextlib
import time

import torch
from torch import nn

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}

# transformers' in-memory prefixes -> checkpoint prefixes (5.24 nests the Thinker; 5.17 does not)
HF_PREFIXES = (("thinker.model.language_model.", "thinker.model."), ("thinker.model.audio_tower.", "thinker.audio_tower."),
               ("thinker.model.visual.", "thinker.visual."))


def gib(nbytes: int) -> float:
    return round(nbytes / 2**30, 2)


def tensor_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@torch.no_grad()
def build_qwen(config: dict, dtype: torch.dtype, device: str, seed: int = 0):
    """-> (omnivox Qwen3OmniModel on `device`, report)."""
    from omnivox.models.qwen3_omni.config import Qwen3OmniConfig
    from omnivox.models.qwen3_omni.model import Qwen3OmniModel
    from omnivox.models.qwen3_omni.random_init import randomize_on_device_
    from omnivox.models.qwen3_omni.weights import reset_buffers

    t0 = time.monotonic()
    with torch.device("meta"):
        model = Qwen3OmniModel(Qwen3OmniConfig.from_hf(config))
    model = model.to(dtype).to_empty(device=device)
    t1 = time.monotonic()
    drawn = randomize_on_device_(model, seed)
    reset_buffers(model)
    _sync(device)
    report = {"params": sum(p.numel() for p in model.parameters()), "gib": gib(tensor_bytes(model)),
              "tensors_drawn": drawn, "alloc_s": round(t1 - t0, 2), "fill_s": round(time.monotonic() - t1, 2)}
    return model.eval(), report


def _candidates(name: str) -> list[str]:
    return [name] + [ckpt + name[len(mem):] for mem, ckpt in HF_PREFIXES if name.startswith(mem)]


@torch.no_grad()
def transformers_twin(model: nn.Module, config: dict, device: str):
    """-> (transformers' model whose parameters are omnivox's tensors, report)."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    from omnivox.layers.merged import checkpoint_parts
    from omnivox.models.qwen3_omni.weights import _target

    t0 = time.monotonic()
    with torch.device("meta"):
        hf = Qwen3OmniMoeForConditionalGeneration(Qwen3OmniMoeConfig(**config))
    params, merged = dict(model.named_parameters()), checkpoint_parts(model)
    shared, copied, unmatched = 0, 0, []
    for name, p in list(hf.named_parameters(remove_duplicate=False)):
        hit = next((h for h in (_target(params, c, merged) for c in _candidates(name)) if h is not None), None)
        if hit is None:
            unmatched.append(name)
            continue
        view = hit[1]
        if view.dim() == p.dim() + 1 and view.shape[1:] == p.shape:  # a broadcast part (per-head norm): one row
            view = view[0]
        if view.shape == p.shape:
            shared += view.numel() * view.element_size()
        elif view.numel() == p.numel():
            view = view.reshape(p.shape).clone()
            copied += view.numel() * view.element_size()
        else:
            unmatched.append(name)
            continue
        owner, leaf = _owner(hf, name)
        owner._parameters[leaf] = nn.Parameter(view, requires_grad=False)
    buffers = _materialise_buffers(hf, device)
    left = [n for n, t in list(hf.named_parameters()) + list(hf.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"transformers' model still has {len(left)} meta tensors, e.g. {left[0]}")
    report = {"transformers": _hf_version(), "shared_gib": gib(shared), "copied_gib": gib(copied),
              "unmatched": unmatched[:10], "n_unmatched": len(unmatched), "buffers_recomputed": buffers,
              "experts_implementation": getattr(hf.config, "_experts_implementation", None),
              "attn_implementation": getattr(hf.config, "_attn_implementation", None),
              "seconds": round(time.monotonic() - t0, 2)}
    return hf.eval(), report


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (root.get_submodule(path) if path else root), leaf


def _materialise_buffers(hf: nn.Module, device: str) -> int:
    """Meta buffers -> device tensors filled by transformers' own `_init_weights` for their module
    (rotary inv_freq, the audio sinusoids, code2wav's code offsets)."""
    n = 0
    for module in hf.modules():
        metas = [k for k, b in module._buffers.items() if b is not None and b.is_meta]
        if not metas:
            continue
        for k in metas:
            module._buffers[k] = torch.empty_like(module._buffers[k], device=device)
        hf._init_weights(module)
        n += len(metas)
    return n


def _hf_version() -> str:
    import transformers
    return transformers.__version__


@torch.no_grad()
def build_s2(s2: dict, dtype: torch.dtype, device: str, seed: int = 0):
    """-> (FishConfig, slow AR, fast AR, codec (fp32, as FishTTS keeps it), report)."""
    from gpuverify.sizes import s2_configs
    from omnivox.models.fish_s2.codec import FishCodec
    from omnivox.models.fish_s2.fast_ar import FastAR
    from omnivox.models.fish_s2.slow_ar import SlowAR
    from omnivox.models.fish_s2.tiny import randomize

    t0 = time.monotonic()
    cfg, codec_cfg = s2_configs(s2)
    with torch.device("meta"):
        slow, fast, codec = SlowAR(cfg), FastAR(cfg), FishCodec(codec_cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for m, dt in ((slow, dtype), (fast, dtype), (codec, torch.float32)):
        m = m.to(dt).to_empty(device=device)
        randomize(m, gen)  # values drawn on the device
        m.reset_buffers()
        out.append(m.eval())
    _sync(device)
    report = {"params": sum(p.numel() for m in out for p in m.parameters()),
              "gib": gib(sum(tensor_bytes(m) for m in out)), "seconds": round(time.monotonic() - t0, 2)}
    return (cfg, *out, report)


@contextlib.contextmanager
def upcast(root: nn.Module, dtype: torch.dtype = torch.float32):
    """Run `root` with every module's own parameters cast to `dtype` for the span of that module's
    forward only (one module's copy alive at a time): a full-size fp32 forward without an fp32
    copy of the model. NOTE: parameters read without calling their module (e.g. `emb.weight[i]`)
    stay in their dtype; the Thinker, Talker and Code2Wav forwards call every module."""
    saved: dict[nn.Module, dict[str, torch.Tensor]] = {}

    def pre(mod, args):
        keep = {}
        for k, p in mod._parameters.items():
            if p is not None and p.dtype != dtype and p.is_floating_point():
                keep[k] = p.data
                p.data = p.data.to(dtype)
        saved[mod] = keep

    def post(mod, args, out):
        for k, data in saved.pop(mod, {}).items():
            mod._parameters[k].data = data

    handles = []
    for m in root.modules():
        if any(True for _ in m.parameters(recurse=False)):
            handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for mod, keep in saved.items():  # a forward that raised left these cast
            for k, data in keep.items():
                mod._parameters[k].data = data


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build(box, st) -> bool:
    """Phase build: omnivox's Qwen3-Omni at `st.sizes`, then transformers' twin over its tensors."""
    r = box.results
    dtype = DTYPES[st.sizes.dtype]
    st.qwen, r["omnivox"] = build_qwen(st.sizes.qwen_config, dtype, st.device)
    r["memory"] = _memory(st.device)
    box.check("transformers' twin")
    try:
        st.hf, r["transformers"] = transformers_twin(st.qwen, st.sizes.qwen_config, st.device)
    except ImportError as e:
        st.hf_error = f"transformers is not importable: {e}"
        r["transformers"] = {"skipped": st.hf_error}
    r["memory_with_twin"] = _memory(st.device)
    return st.hf is not None or st.hf_error is not None


def _memory(device: str) -> dict:
    if not device.startswith("cuda"):
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"allocated_gib": gib(torch.cuda.memory_allocated()), "free_gib": gib(free), "total_gib": gib(total)}
