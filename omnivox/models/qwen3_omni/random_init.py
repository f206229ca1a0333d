"""Seeded random weights that make every block of a model matter.

Used for the built-in demo checkpoint and by the parity tests (applied to transformers'
model there): default inits leave MoE blocks, MLPs and the vocoder near-identity or dead
(spec section 13, pitfalls 14-15), which would make a parity check vacuous. The full-size model
of `scripts/gpu_verify.py` is filled on its own device (`randomize_on_device_`): no host copy, no disk.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from omnivox.layers.merged import checkpoint_parts
from omnivox.models.qwen3_omni.config import Qwen3OmniConfig
from omnivox.models.qwen3_omni.weights import _target, to_disk_layout


def _fan_in(name: str, shape: tuple[int, ...]) -> int:
    if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
        return shape[-1]  # fused experts [E, out, in]
    if len(shape) == 3 and (("upsample" in name and ".0.conv" in name) or "block.1.conv" in name):
        return shape[0]  # transposed conv [in, out, k]
    return math.prod(shape[1:]) if len(shape) >= 2 else 1


def seeded_value(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """A float32 tensor for parameter `name` (checkpoint or transformers naming)."""
    return scaled(name, shape, torch.randn(shape, generator=g, dtype=torch.float32))


def scaled(name: str, shape: tuple[int, ...], rnd: torch.Tensor) -> torch.Tensor:
    """The value of parameter `name` from a standard-normal draw `rnd` of its shape (any device)."""
    if name.endswith("alpha") or name.endswith("beta"):  # SnakeBeta, log space
        return 0.3 * rnd
    if "layer_scale" in name or name.endswith("gamma"):
        return 0.5 + 0.2 * rnd
    if len(shape) == 1 and ("norm" in name or "ln_" in name or "layernorm" in name):
        return (1.0 + 0.2 * rnd) if name.endswith("weight") else 0.1 * rnd
    if len(shape) == 1:  # biases
        return 0.1 * rnd
    if "embed" in name and "patch" not in name:
        return rnd
    val = rnd / math.sqrt(_fan_in(name, shape))
    if name.endswith("mlp.gate.weight"):
        val = val * 3.0  # decisive, varied routing
    # Code2Wav's decoder grows the signal ~200x at fan-in scaling: damp the residual units
    # and the upsamplers so the waveform is O(0.5) and mostly unclamped.
    if "code2wav.decoder" in name and name.endswith("conv2.conv.weight"):
        val = val * 0.2
    if "code2wav.decoder" in name and "block.1.conv.weight" in name:
        val = val * 0.5
    return val


@torch.no_grad()
def randomize_(named_params, seed: int = 0) -> None:
    """Overwrite every parameter of `named_params` (name, tensor) in sorted-name order."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(named_params, key=lambda kv: kv[0]):
        p.copy_(seeded_value(name, tuple(p.shape), g).to(p.dtype))


@torch.no_grad()
def randomize_on_device_(model: torch.nn.Module, seed: int = 0) -> int:
    """Fill every parameter of an omnivox Qwen3-Omni module tree with seeded values drawn on its
    own device, per checkpoint tensor in sorted-name order: a merged parameter through its parts
    (a per-head norm part drawn once and broadcast over its rows, as the loader fills it), fused
    experts whole. Returns the number of tensors drawn. The values differ from `randomize_`'s
    (another generator), the scaling is the same."""
    params = dict(model.named_parameters())
    merged = checkpoint_parts(model)
    merged_keys = {key for key, _ in merged.values()}
    names = sorted([k for k in params if k not in merged_keys] + list(merged))
    device = next(iter(params.values())).device
    g = torch.Generator(device=device).manual_seed(seed)
    for name in names:
        _, dest, shape = _target(params, name, merged)
        rnd = torch.empty(shape, dtype=torch.float32, device=device).normal_(generator=g)
        dest.copy_(scaled(name, shape, rnd))  # a broadcast part's [D] fills every row of its view
    return len(names)


@torch.no_grad()
def save_random_checkpoint(config: dict, folder: str | Path, seed: int = 0) -> None:
    """Write config.json and a model.safetensors of seeded random weights (the demo model)."""
    from omnivox.models.qwen3_omni.model import Qwen3OmniModel

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = Qwen3OmniModel(Qwen3OmniConfig.from_hf(config))
    buffers = dict(model.named_buffers())
    state = {k: v for k, v in model.state_dict().items() if k not in buffers}  # checkpoint names
    randomize_(state.items(), seed)  # drawn per checkpoint tensor, as before any merging
    save_file(to_disk_layout(state), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
