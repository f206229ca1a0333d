"""Block-FP8 weights: the fine-grained format (DeepSeek-V3, Qwen3-FP8, transformers' integration).

A quantized linear holds `weight` (float8_e4m3fn, [out, in]) and `weight_scale_inv` (float32,
[ceil(out/Br), ceil(in/Bc)]); the value of an element is `weight x weight_scale_inv` of its block
(despite the name the stored scale multiplies), the last block along an axis cut short. A merged
linear (q||k||v, gate||up: `layers.merged`) keeps each part's blocks: its scale rows are the parts'
scale grids stacked, so a part whose rows are not a multiple of Br starts a fresh block row.
Fused experts hold [E, 2I, H] / [E, H, I] float8 tensors with [E, 2*ceil(I/Br), ceil(H/Bc)] /
[E, ceil(H/Br), ceil(I/Bc)] scales (gate's blocks, then up's).

Weights stay FP8 in memory. Three compute paths (`--fp8-compute`):
- "dequant" expands a layer's weights to the activations' dtype at every call, so outputs equal a
  checkpoint holding the dequantized values exactly (the CPU's path);
- "triton": the block-FP8 Triton kernels (`layers.fp8_triton`: W8A8 with activations quantized per
  token and group of Bc, FP8 tensor cores; W8A16 where Bc is no power of two), one GEMM a linear and
  one grouped launch a projection of the experts. Outputs are close to, not equal to, dequant's;
- "auto" (the default): "triton" on a CUDA device with FP8 tensor cores (sm89+) where triton
  imports, else "dequant" (`kernel_unavailable` says why; the start-up line shows it).
A layer whose blocks do not line up with its rows (a merged part, or the experts' gate and up, whose
rows are no multiple of Br, so a part starts a fresh block row) always takes "dequant".
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from omnivox.engine.config import FP8_COMPUTE_PATHS as COMPUTE_PATHS
from omnivox.errors import CheckpointError
from omnivox.layers.merged import MergedLinear, Part
from omnivox.layers.moe import FusedExperts

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
ONLINE_BLOCK = (128, 128)  # `--quantization fp8`: the released checkpoints' block


@dataclass(frozen=True)
class FP8Config:
    """A `quantization_config` of quant_method "fp8" (or `--quantization fp8`)."""

    block: tuple[int, int] = ONLINE_BLOCK  # (rows, columns) of one scale's block
    modules_to_not_convert: tuple[str, ...] = ()
    compute: str = "auto"

    @classmethod
    def from_hf(cls, raw: dict | None, where: str = "config.json") -> FP8Config | None:
        """None when `raw` (the `quantization_config` object) is absent; one-line errors otherwise."""
        if raw is None:
            return None
        what = f"{where} quantization_config"
        if not isinstance(raw, dict):
            raise CheckpointError(f"{what}: expected an object, got {type(raw).__name__}")
        method = raw.get("quant_method")
        if method != "fp8":
            raise CheckpointError(f"{what}: quant_method {method!r} is not supported (omnivox loads 'fp8')")
        fmt = raw.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise CheckpointError(f"{what}: fmt {fmt!r} is not supported (omnivox loads 'e4m3')")
        scheme = raw.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise CheckpointError(f"{what}: activation_scheme {scheme!r} is not supported (omnivox loads 'dynamic')")
        block = raw.get("weight_block_size")
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise CheckpointError(f"{what}: weight_block_size {block!r} must be two positive integers "
                                  "(per-tensor FP8 is not supported)")
        skip = raw.get("modules_to_not_convert") or []
        if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
            raise CheckpointError(f"{what}: modules_to_not_convert must be a list of module names")
        return cls(block=(block[0], block[1]), modules_to_not_convert=tuple(skip))

    @classmethod
    def resolve(cls, raw: dict | None, quantization: str | None = None, compute: str = "auto",
                where: str = "config.json", devices: tuple = ()) -> FP8Config | None:
        """The checkpoint's `quantization_config` (`raw`), else `quantization="fp8"` online (128x128
        blocks), else None; `compute` the FP8 layers' compute path ("triton" is refused in one line
        where the kernels cannot run on one of `devices`)."""
        if quantization not in (None, "fp8"):
            raise CheckpointError(f"unknown quantization {quantization!r}; omnivox supports 'fp8'")
        if compute not in COMPUTE_PATHS:
            raise CheckpointError(f"unknown FP8 compute path {compute!r}; choose one of {', '.join(COMPUTE_PATHS)}")
        why = next((w for w in map(kernel_unavailable, devices) if w), None) if compute == "triton" else None
        if why:
            raise CheckpointError(f"--fp8-compute triton cannot run here: {why}; use auto or dequant")
        cfg = cls.from_hf(raw, where)
        if cfg is None and quantization == "fp8":
            cfg = cls()
        return None if cfg is None else replace(cfg, compute=compute)

    def converts(self, path: str) -> bool:
        """transformers' rule: a module is left alone when a listed name occurs in its path."""
        return not any(name in path for name in self.modules_to_not_convert)


@functools.lru_cache(maxsize=None)
def kernel_unavailable(device: str | torch.device) -> str | None:
    """None where the block-FP8 Triton kernels run on `device`, else why not (one phrase). On CPU
    they run under TRITON_INTERPRET=1 only (tests): "auto" never picks them there."""
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return f"{torch.cuda.get_device_name(device)} (sm{major}{minor}) has no FP8 tensor cores (sm89+)"
    elif device.type != "cpu" or os.environ.get("TRITON_INTERPRET") != "1":
        return f"no CUDA device ({device.type})"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


@functools.lru_cache(maxsize=None)
def compute_path(compute: str, device: str | torch.device) -> str:
    """"triton" or "dequant": what `compute` ("auto", "dequant", "triton") runs on `device`."""
    if compute == "dequant" or (compute == "auto" and torch.device(device).type != "cuda"):
        return "dequant"
    return "dequant" if kernel_unavailable(device) else "triton"


def describe_compute(compute: str, device: str, placement=None) -> str:
    """The start-up line's words on how the FP8 layers compute on `device`, or on the devices of
    `placement` (an engine.placement.Placement) where one is given."""
    devices = {device} if placement is None else {placement.default, *placement.devices.values()}
    paths = {str(d): compute_path(compute, d) for d in devices}
    if set(paths.values()) == {"triton"}:
        return f"compute {compute}: Triton block-FP8 kernels"
    def why(d: str) -> str:
        if compute == "dequant":
            return "asked"
        return f"no CUDA device ({d})" if torch.device(d).type != "cuda" else kernel_unavailable(d)
    reasons = sorted({why(d) for d, p in paths.items() if p == "dequant"})
    return f"compute {compute}: dequantize per layer ({'; '.join(reasons)})"


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale grid of a weight of `shape` ([..., rows, cols]): last blocks cut short."""
    return (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))


def _expand(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """[..., ceil(rows/Br), ceil(cols/Bc)] -> [..., rows, cols]: each block's scale on its elements."""
    return scale.repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)[..., :cols]


@torch.no_grad()
def quantize(weight: torch.Tensor, block: tuple[int, int] = ONLINE_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., R, C] -> (float8 [..., R, C], float32 scale_inv [..., ceil(R/Br), ceil(C/Bc)]) with
    scale = amax(|block|) / 448 (an all-zero block gets 1), so `dequantize` gives q x scale."""
    w = weight.float()
    rows, cols = w.shape[-2:]
    nr, nc = scale_shape(w.shape, block)[-2:]
    padded = F.pad(w.abs(), (0, nc * block[1] - cols, 0, nr * block[0] - rows))  # zeros leave amax alone
    amax = padded.unflatten(-1, (nc, block[1])).unflatten(-3, (nr, block[0])).amax(dim=(-3, -1))  # [..., nr, nc]
    scale = amax / FP8_MAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = (w / _expand(scale, rows, cols, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float8 [..., R, C] x its block scales -> [..., R, C] in `dtype` (the product is taken in fp32)."""
    return (q.float() * _expand(scale, q.shape[-2], q.shape[-1], block)).to(dtype)


def scale_parts(parts: tuple[Part, ...], cols: int, block: tuple[int, int]) -> tuple[Part, ...]:
    """The scale rows of each part of a merged weight: every part starts its own block row."""
    out, start = [], 0
    for p in parts:
        n = math.ceil((p.rows.stop - p.rows.start) / block[0])
        out.append(Part(p.name, slice(start, start + n), (n, math.ceil(cols / block[1]))))
        start += n
    return tuple(out)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, groups: tuple[int, ...], block: tuple[int, int],
                    dtype: torch.dtype) -> torch.Tensor:
    """Like `dequantize` for a weight whose rows (axis -2) are parts of `groups` rows, each blocked
    from its own first row (a merged linear's parts, fused experts' gate and up)."""
    if len(groups) == 1:
        return dequantize(q, scale, block, dtype)
    pieces, r, s = [], 0, 0
    for n in groups:
        ns = math.ceil(n / block[0])
        pieces.append(dequantize(q[..., r:r + n, :], scale[..., s:s + ns, :], block, dtype))
        r, s = r + n, s + ns
    return torch.cat(pieces, dim=-2)


def _fp8_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=FP8), requires_grad=False)


def _scale_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)


class FP8Linear(nn.Module):
    """A bias-free linear (optionally merged from `parts`) with block-FP8 weights."""

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int],
                 parts: tuple[Part, ...] = (), compute: str = "dequant"):
        super().__init__()
        self.in_features, self.out_features, self.block, self.compute = in_features, out_features, block, compute
        self.weight = _fp8_param(out_features, in_features)
        if parts:
            self.parts = parts
        self.weight_scale_inv = _scale_param(sum(p.shape[0] for p in self.scale_parts())
                                             if parts else math.ceil(out_features / block[0]),
                                             math.ceil(in_features / block[1]))

    def scale_parts(self) -> tuple[Part, ...]:
        return scale_parts(self.parts, self.in_features, self.block)

    def merged_tensors(self) -> dict[str, tuple[Part, ...]]:
        """`layers.merged`: the weight's parts and their scale rows, both under checkpoint names."""
        return {"weight": self.parts, "weight_scale_inv": self.scale_parts()}

    def groups(self) -> tuple[int, ...]:
        parts = getattr(self, "parts", ())
        return tuple(p.rows.stop - p.rows.start for p in parts) or (self.out_features,)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_rows(self.weight, self.weight_scale_inv, self.groups(), self.block, dtype)

    def aligned(self) -> bool:
        """Whether the stacked scale grid is the weight's own (every part a whole number of block rows)."""
        return all(n % self.block[0] == 0 for n in self.groups()[:-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if compute_path(self.compute, x.device) == "triton" and self.aligned():
            from omnivox.layers.fp8_triton import block_fp8_linear
            return block_fp8_linear(x, self.weight, self.weight_scale_inv, self.block)
        return F.linear(x, self.dequantized(x.dtype))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, block={self.block}, compute={self.compute}"


class FP8Experts(FusedExperts):
    """Fused experts with block-FP8 weights; `weights` hands the grouped/dense/loop paths their
    dequantized [E, 2I, H] / [E, H, I] tensors (one layer's, at compute time)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, block: tuple[int, int],
                 compute: str = "dequant"):
        nn.Module.__init__(self)
        self.block, self.compute = block, compute
        self.gate_up_proj = _fp8_param(num_experts, 2 * intermediate, hidden)
        self.down_proj = _fp8_param(num_experts, hidden, intermediate)
        nr, nc = scale_shape((intermediate, hidden), block)
        self.gate_up_proj_scale_inv = _scale_param(num_experts, 2 * nr, nc)
        self.down_proj_scale_inv = _scale_param(num_experts, *scale_shape((hidden, intermediate), block))

    def products(self, x: torch.Tensor, expert: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        """The grouped block-FP8 kernel (gate||up, then down: one launch each for every expert of
        the step) where the compute path is "triton" and gate's blocks end where up's begin."""
        if compute_path(self.compute, x.device) != "triton" or self.down_proj.shape[-1] % self.block[0]:
            return super().products(x, expert, tok)
        from omnivox.layers.fp8_triton import block_fp8_grouped
        ids = torch.arange(self.down_proj.shape[0], device=expert.device)
        ends = torch.searchsorted(expert, ids, right=True, out_int32=True)  # [E] end row of each group
        gate, up = block_fp8_grouped(x.index_select(0, tok), ends, self.gate_up_proj, self.gate_up_proj_scale_inv,
                                     self.block).chunk(2, dim=-1)
        return block_fp8_grouped(F.silu(gate) * up, ends, self.down_proj, self.down_proj_scale_inv, self.block)

    def weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inter = self.down_proj.shape[-1]
        gate_up = dequantize_rows(self.gate_up_proj, self.gate_up_proj_scale_inv, (inter, inter), self.block, dtype)
        return gate_up, dequantize(self.down_proj, self.down_proj_scale_inv, self.block, dtype)


def convert(root: nn.Module, prefixes: tuple[str, ...], cfg: FP8Config, keep: tuple[str, ...] = (),
            name_prefix: str = "") -> int:
    """Swap the bias-free linears and fused experts under `prefixes` (module paths in `root`, e.g.
    "thinker.model.layers.") for their FP8 forms, in place, on the meta device (no weights yet):
    not those whose checkpoint path (`name_prefix` + path, merged parts by their own names) holds a
    `keep` suffix (router and shared-expert gates) or a `cfg.modules_to_not_convert` name. Returns
    how many were converted."""
    count = 0
    for path, module in list(root.named_modules()):
        if not path.startswith(prefixes) or path.endswith(keep):
            continue
        names = [name_prefix + path]
        if getattr(module, "parts", None):
            parent = (name_prefix + path).rsplit(".", 1)[0]
            names = [f"{parent}.{p.name}" for p in module.parts]
        if not all(cfg.converts(n) for n in names):
            if any(cfg.converts(n) for n in names):
                raise CheckpointError(f"modules_to_not_convert lists some of {', '.join(names)} but not all: "
                                      "they load as one merged weight")
            continue
        if type(module) is FusedExperts:
            e, hidden, inter = module.down_proj.shape
            with torch.device(module.down_proj.device):
                new = FP8Experts(e, hidden, inter, cfg.block, cfg.compute)
        elif type(module) in (nn.Linear, MergedLinear) and module.bias is None:
            with torch.device(module.weight.device):
                new = FP8Linear(module.in_features, module.out_features, cfg.block, getattr(module, "parts", ()),
                                cfg.compute)
        else:
            continue
        parent, _, attr = path.rpartition(".")
        setattr(root.get_submodule(parent), attr, new)
        count += 1
    return count

