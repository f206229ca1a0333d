"""Seeded random weights that make every block of a tiny model matter.

Used for the built-in demo checkpoint and by the parity tests (applied to transformers'
model there): default inits leave MoE blocks, MLPs and the vocoder near-identity or dead
(spec section 13, pitfalls 14-15), which would make a parity check vacuous.
"""
from __future__ import annotations

import math

import torch


def _fan_in(name: str, shape: tuple[int, ...]) -> int:
    if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
        return shape[-1]  # fused experts [E, out, in]
    if len(shape) == 3 and (("upsample" in name and ".0.conv" in name) or "block.1.conv" in name):
        return shape[0]  # transposed conv [in, out, k]
    return math.prod(shape[1:]) if len(shape) >= 2 else 1


def seeded_value(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """A float32 tensor for parameter `name` (checkpoint or transformers naming)."""
    rnd = torch.randn(shape, generator=g, dtype=torch.float32)
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
