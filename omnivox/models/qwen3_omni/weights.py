"""Loading and writing Qwen3-Omni checkpoints (Hugging Face folders).

Module names equal the on-disk tensor names, so almost everything loads by identity. The
fusions: per-expert `mlp.experts.E.{gate,up,down}_proj.weight` tensors are copied into
the fused `[E, 2I, H]` / `[E, H, I]` parameters, and the merged parameters of
`omnivox.layers.merged` (q/k/v -> qkv_proj, gate/up -> gate_up_proj, q_norm/k_norm -> qk_norm)
are filled by row slices from their separate on-disk tensors. The model is built on the meta device,
materialised empty once, and tensors are streamed in shard by shard, so peak memory stays
near one copy of the weights.

Tensor parallel (`tp`): the model is sharded while still on the meta device (local shapes) and
each rank reads only its pieces of the cut tensors (`sharding.checkpoint_cut`): a
row piece as its byte range, a column piece by reading the tensor into a staging buffer.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from tqdm import tqdm

from omnivox.errors import CheckpointError
from omnivox.layers.fp8 import FP8, FP8Config, convert, quantize
from omnivox.layers.merged import Part, checkpoint_parts
from omnivox.models.qwen3_omni.config import Qwen3OmniConfig
from omnivox.models.qwen3_omni.sharding import checkpoint_cut, shard_thinker
from omnivox.parallel.shard import piece

if TYPE_CHECKING:
    from omnivox.engine.placement import Placement
    from omnivox.models.qwen3_omni.model import Qwen3OmniModel
    from omnivox.parallel.group import TPGroup

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight(_scale_inv)?$")
# the decoder layers whose linears and experts hold block-FP8 weights under a quantization config
# (not their router gates, nor the shared expert's gate: `layers.fp8.convert`)
FP8_LAYERS = ("thinker.model.layers.", "talker.model.layers.", "talker.code_predictor.model.layers.")
FP8_KEEP = (".shared_expert_gate",)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def read_config(folder: Path) -> tuple[dict, Qwen3OmniConfig]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: no config.json (is this a Hugging Face model folder?)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    return raw, Qwen3OmniConfig.from_hf(raw)


def shard_files(folder: Path) -> list[Path]:
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: malformed index ({e})") from None
        files = [folder / f for f in dict.fromkeys(weight_map.values())]
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{folder}: shard(s) listed in the index are missing: {', '.join(missing)}")
    return files


def _target(params: dict[str, torch.Tensor], name: str, merged: dict[str, tuple[str, Part]] | None = None,
            ) -> tuple[str, torch.Tensor, tuple[int, ...]] | None:
    """Where an on-disk tensor goes: (param name, destination view, on-disk shape) or None if unknown.
    `merged` is `checkpoint_parts(model)`; a broadcast part's [D] fills every row of its view."""
    if name in params:
        return name, params[name], tuple(params[name].shape)
    if merged and name in merged:
        key, part = merged[name]
        return key, params[key][part.rows], part.shape
    m = _EXPERT.match(name)
    if m is None:
        return None
    prefix, e, kind, scale = m.group(1), int(m.group(2)), m.group(3), m.group(4) or ""
    if kind == "down_proj":
        key = f"{prefix}.down_proj{scale}"
        return (key, params[key][e], tuple(params[key][e].shape)) if key in params else None
    key = f"{prefix}.gate_up_proj{scale}"
    if key not in params:
        return None
    inter = params[key].shape[1] // 2  # gate's rows (or scale rows), then up's
    rows = slice(0, inter) if kind == "gate_proj" else slice(inter, 2 * inter)
    return key, params[key][e, rows], (inter, params[key].shape[2])


def reset_buffers(model: torch.nn.Module) -> None:
    """Recompute every non-persistent table (rotary inv_freq, sinusoids, code offsets).

    NOTE: after `to_empty` these buffers hold garbage, so every module that owns one must
    define `reset_buffers()`; a module that does not is a bug caught here, not a wrong answer.
    """
    for name, module in model.named_modules():
        if getattr(module, "_non_persistent_buffers_set", None) and not hasattr(module, "reset_buffers"):
            raise RuntimeError(f"{name or type(module).__name__} has non-persistent buffers but no reset_buffers()")
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()


# safetensors dtype names -> torch (the ones a checkpoint of this family can hold)
_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": FP8}
_READ_CHUNK = 256 << 20


class _Shard:
    """One safetensors file read with plain sequential reads, straight into the destination
    tensor when its dtype and layout match (else into one staging tensor, then cast/copied).

    NOTE: not through safetensors' mmap: copying from the mapping faults its pages in 4 KiB steps,
    and torch's multi-threaded copy faults them out of order, which defeats the kernel's readahead:
    that loaded a 16 GB checkpoint at ~20 % of the disk's sequential speed (benchmarks/load_throughput.py).
    The header is still validated by safetensors (`safe_open`) before anything is read."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                names = list(f.keys())
            with open(path, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n))
        except Exception as e:  # safetensors raises several types for corrupt headers
            raise CheckpointError(f"{path.name}: cannot read safetensors file ({e})") from None
        base = 8 + n
        # name -> (dtype name, shape, first byte, end byte) in the file; names in file order
        self.entries = {k: (header[k]["dtype"], tuple(header[k]["shape"]), base + header[k]["data_offsets"][0],
                            base + header[k]["data_offsets"][1]) for k in names}
        self.names = sorted(names, key=lambda k: self.entries[k][2])

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def read_into(self, fh, name: str, dest: torch.Tensor, rows: slice | None = None) -> None:
        """Copy tensor `name`, or only its `rows` (one byte range: tensors are stored row-major), into
        `dest` (that shape, or broadcastable from it), cast to dest's dtype."""
        kind, shape, start, end = self.entries[name]
        dtype = _ST_DTYPES.get(kind)
        if dtype is None:  # a dtype not read here: through safetensors
            with safe_open(str(self.path), framework="pt", device="cpu") as f:
                t = f.get_tensor(name)
            dest.copy_((t if rows is None else t[rows]).to(dest.dtype))
            return
        if end - start != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"{self.path.name}: tensor {name} holds {end - start} bytes, not {shape} x {kind}")
        if rows is not None:
            row_bytes = math.prod(shape[1:]) * dtype.itemsize
            start, end = start + rows.start * row_bytes, start + rows.stop * row_bytes
            shape = (rows.stop - rows.start, *shape[1:])
        direct = (dest.device.type == "cpu" and dest.dtype == dtype and dest.is_contiguous()
                  and tuple(dest.shape) == shape)
        out = dest if direct else torch.empty(shape, dtype=dtype)
        nbytes = end - start
        if nbytes:
            view = memoryview(out.detach().view(-1).view(torch.uint8).numpy())
            fh.seek(start)
            done = 0
            while done < nbytes:
                got = fh.readinto(view[done:min(nbytes, done + _READ_CHUNK)])
                if not got:
                    raise CheckpointError(f"{self.path.name}: tensor {name} is unreadable (the file ends early)")
                done += got
        if not direct:
            dest.copy_(out)  # casts, broadcasts and crosses devices as needed

    def read_piece(self, fh, name: str, dest: torch.Tensor, axis: int, tp: TPGroup) -> None:
        """This rank's `piece` of tensor `name` along `axis` into dest: rows straight from their byte
        range (zeros in the padding rows past the end), columns through a whole-tensor staging buffer."""
        start, stop, _ = piece(self.shape(name)[axis], tp)
        if axis == 0:
            self.read_into(fh, name, dest[:stop - start], rows=slice(start, stop))
            dest[stop - start:].zero_()
            return
        whole = torch.empty(self.shape(name), dtype=_ST_DTYPES.get(self.entries[name][0], dest.dtype))
        self.read_into(fh, name, whole)
        dest.copy_(whole.narrow(axis, start, stop - start))

    def local_shape(self, name: str, axis: int | None, tp: TPGroup | None) -> tuple[int, ...]:
        """The shape of what this rank reads of tensor `name` (padded to the piece length)."""
        shape = self.shape(name)
        if axis is None:
            return shape
        return shape[:axis] + (piece(shape[axis], tp)[2],) + shape[axis + 1:]


def _read(sh: _Shard, fh, name: str, dest: torch.Tensor, axis: int | None, tp: TPGroup | None) -> None:
    if axis is None:
        sh.read_into(fh, name, dest)
    else:
        sh.read_piece(fh, name, dest, axis, tp)


class _Fill:
    """What the loader has filled: fused-expert parameters count their per-expert tensors."""

    def __init__(self, params: dict[str, torch.Tensor], merged: dict[str, tuple[str, Part]]):
        self.params, self.merged = params, merged
        self.filled: dict[str, int] = {}
        self.seen: set[str] = set()

    def add(self, key: str, name: str) -> None:
        self.filled[key] = self.filled.get(key, 0) + 1
        self.seen.add(name)

    def missing(self, skip: tuple[str, ...]) -> list[tuple[str, tuple[int, ...]]]:
        """(on-disk tensor, expected shape) of each parameter, per-expert tensor or merged part nothing filled."""
        merged_keys = {key for key, _ in self.merged.values()}
        out = []
        for k, p in self.params.items():
            m = re.match(r"^(.*\.mlp\.experts)\.(gate_up|down)_proj(_scale_inv)?$", k)
            if m is None:
                if k not in merged_keys and k not in self.filled:
                    out.append((k, tuple(p.shape)))
                continue
            kinds = ("gate_proj", "up_proj") if m.group(2) == "gate_up" else ("down_proj",)
            rows = p.shape[1] // len(kinds)
            out += [(name, (rows, p.shape[2])) for e in range(p.shape[0]) for kind in kinds
                    if (name := f"{m.group(1)}.{e}.{kind}.weight{m.group(3) or ''}") not in self.seen]
        out += [(name, part.shape) for name, (key, part) in self.merged.items()
                if name not in self.seen and not key.startswith(skip)]
        return out


def _load_tensor(sh: _Shard, fh, name: str, hit, fill: _Fill, tp: TPGroup | None, fp8: FP8Config | None) -> None:
    """Tensor `name` of shard `sh` into its destination; a float tensor bound for a float8 parameter
    is quantized on the way (`--quantization fp8`: this tensor only, its scales filled alongside)."""
    key, dest, shape = hit
    axis = None if tp is None else checkpoint_cut(name)
    if sh.local_shape(name, axis, tp) != shape:
        piece_of = "" if axis is None else f" (rank {tp.rank}'s piece of {tp.size} along axis {axis})"
        blocks = f" and weight_block_size {list(fp8.block)}" if fp8 and name.endswith("_scale_inv") else ""
        raise CheckpointError(f"{name}: shape {sh.shape(name)} in the checkpoint, "
                              f"{shape}{piece_of} expected from config.json{blocks}")
    on_disk_fp8 = sh.entries[name][0] == "F8_E4M3"
    if on_disk_fp8 and dest.dtype != FP8:
        why = "config.json has no quantization_config" if fp8 is None else "omnivox keeps this layer unquantized"
        raise CheckpointError(f"{name}: float8 in the checkpoint, but it loads into a {str(dest.dtype)[6:]} "
                              f"parameter ({why})")
    if dest.dtype == FP8 and not on_disk_fp8:
        staged = torch.empty(shape, dtype=torch.float32)
        _read(sh, fh, name, staged, axis, tp)
        q, scale = quantize(staged, fp8.block)
        dest.copy_(q)
        skey, sdest, _ = _target(fill.params, name + "_scale_inv", fill.merged)
        sdest.copy_(scale)
        fill.add(skey, name + "_scale_inv")
    else:
        _read(sh, fh, name, dest, axis, tp)
    fill.add(key, name)


def build_on_meta(raw: dict, cfg: Qwen3OmniConfig, dtype: torch.dtype, tp: TPGroup | None = None,
                  quantization: str | None = None, fp8_compute: str = "auto", devices: tuple = (),
                  ) -> tuple[Qwen3OmniModel, FP8Config | None]:
    """The model as the loader fills it, on the meta device: in `dtype`, FP8 layers where the checkpoint's
    quantization_config or `quantization` asks, this rank's shard under `tp`. Refuses (one line) a
    tensor-parallel size that does not divide the Thinker or cuts FP8 blocks."""
    from omnivox.models.qwen3_omni.model import Qwen3OmniModel

    fp8 = FP8Config.resolve(raw.get("quantization_config"), quantization, fp8_compute, devices=devices)
    with torch.device("meta"):
        model = Qwen3OmniModel(cfg).to(dtype)  # cast on meta (free); allocated per stage, on its device, later
    if fp8 is not None:
        convert(model, FP8_LAYERS, fp8, keep=FP8_KEEP)
    if tp is not None:
        shard_thinker(model, tp)  # local shapes, still on meta
    return model, fp8


def check_shardable(folder: str | Path, size: int, quantization: str | None = None) -> None:
    """What `load_model(tp=...)` would refuse for a group of `size`, before any rank starts."""
    from omnivox.parallel.group import TPGroup

    raw, cfg = read_config(Path(folder))
    build_on_meta(raw, cfg, torch.float32, TPGroup(rank=0, size=size, group=None), quantization)


@torch.no_grad()
def load_model(folder: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
               progress: bool = True, placement: Placement | None = None, tp: TPGroup | None = None,
               only: tuple[str, ...] | None = None, quantization: str | None = None,
               fp8_compute: str = "auto") -> Qwen3OmniModel:
    """`placement`: each stage's modules on its device (None: all on `device`). `tp`: load only this
    rank's shard of the Thinker's text stack (equal to `shard_thinker` of the full model). `only`:
    load these stages' weights, leave the others on the meta device, unread (a tensor-parallel
    worker: ("thinker",)). A checkpoint with an FP8 `quantization_config`, or `quantization="fp8"`
    (online, 128x128 blocks), puts the AR stages' decoder linears and experts in block FP8
    (`layers.fp8`; `FP8_LAYERS`), computed by `fp8_compute`."""
    from omnivox.engine.placement import Placement
    from omnivox.models.qwen3_omni.family import FAMILY

    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"model folder not found: {folder}")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise CheckpointError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    raw, cfg = read_config(folder)
    files = shard_files(folder)
    placement = (placement or Placement(default=str(device))).check(FAMILY.stages)
    model, fp8 = build_on_meta(raw, cfg, dtype, tp, quantization, fp8_compute,
                               devices=tuple(placement.device(s) for s in ("thinker", "talker")))
    skip = () if cfg.has_audio_output else ("talker.", "code2wav.")
    for stage, modules in model.stage_modules().items():
        if only is not None and stage not in only:
            skip += model.stage_prefixes()[stage]
            continue
        for module in modules:
            module.to_empty(device=placement.device(stage))
    fill = _Fill({k: p for k, p in model.named_parameters() if not k.startswith(skip)}, checkpoint_parts(model))
    unknown: list[str] = []
    shards = [_Shard(path) for path in files]  # validates every header before any work
    bar = tqdm(total=sum(len(sh.names) for sh in shards), desc="loading weights", unit="tensor",
               disable=not progress, leave=False)
    try:
        for sh in shards:
            with open(sh.path, "rb", buffering=0) as fh:
                for name in sh.names:  # in file order: one sequential pass over the shard
                    bar.update(1)
                    if name.startswith(skip):
                        continue
                    hit = _target(fill.params, name, fill.merged)
                    if hit is None:
                        unknown.append(name)
                    else:
                        _load_tensor(sh, fh, name, hit, fill, tp, fp8)
    finally:
        bar.close()
    if unknown:
        raise CheckpointError(f"checkpoint has {len(unknown)} tensor(s) this model does not know, "
                              f"e.g. {unknown[0]} (does config.json match the weights?)")
    missing = fill.missing(skip)
    if missing:
        name, shape = missing[0]
        what = (f"the float32 block scales {list(shape)} of a float8 weight, weight_block_size {list(fp8.block)}"
                if name.endswith("_scale_inv") else f"shape {list(shape)}")
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {name} ({what})")
    reset_buffers(model)
    return model.eval()


def to_disk_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A `model.state_dict()` (merged parameters already shown as their parts) with the fused
    expert tensors (and block-FP8 scales) split back into the per-expert on-disk names; every
    tensor its own copy."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = re.match(r"^(.*\.experts)\.(gate_up|down)_proj(_scale_inv)?$", name)
        if m is None:
            out[name] = t.clone()  # merged parts are views of one tensor: safetensors wants them apart
            continue
        prefix, suffix = m.group(1), ".weight" + (m.group(3) or "")
        kinds = ("gate_proj", "up_proj") if m.group(2) == "gate_up" else ("down_proj",)
        for e in range(t.shape[0]):
            for kind, piece_ in zip(kinds, t[e].chunk(len(kinds))):
                out[f"{prefix}.{e}.{kind}{suffix}"] = piece_.clone()
    return out


@torch.no_grad()
def load_submodule(module: torch.nn.Module, tensors: dict[str, torch.Tensor], prefix: str) -> None:
    """Fill `module` from on-disk tensors under `prefix` (e.g. "talker.model."); strict."""
    params = dict(module.named_parameters())
    merged = checkpoint_parts(module)
    filled, seen = set(), set()
    for name, t in tensors.items():
        if not name.startswith(prefix):
            continue
        hit = _target(params, name[len(prefix):], merged)
        if hit is None:
            raise CheckpointError(f"unexpected tensor {name}")
        hit[1].copy_(t.to(hit[1].dtype))
        filled.add(hit[0])
        seen.add(name[len(prefix):])
    missing = (set(params) - filled - {key for key, _ in merged.values()}) | (set(merged) - seen)
    if missing:
        raise CheckpointError(f"missing tensors under {prefix}: {sorted(missing)[:5]}")
