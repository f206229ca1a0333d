"""Checkpoint loading in GB/s beside the disk's raw read speed of the same files.

A synthetic sharded safetensors checkpoint of Qwen3-Omni's shape is written once (cached): the
released configuration and its on-disk names (per-expert tensors, q/k/v apart), bf16, with the
Thinker's depth cut so the files total about `--size-gb`; the values come from a 64 MiB random
pool (incompressible, cheap to write). Then, each run with the files' pages dropped from the page
cache first (fsync, then `posix_fadvise(DONTNEED)` per file, no root needed; the resident fraction
is read back with `mincore` to show the drop worked):
  raw     every file read sequentially with 64 MiB `readinto`s into one buffer (the disk's speed)
  warm    the same right after (the page cache's speed: the drop's control)
  fresh   (CPU) the same reads into newly allocated memory of the files' size, kept: the disk plus
          the cost of materialising the weights' memory, which every loader pays too
  loader  `omnivox.models.qwen3_omni.weights.load_model(folder, dtype, device)`
GB/s = file bytes / seconds (1 GB = 1e9 bytes). Goal: loader >= 80 % of raw.

    python benchmarks/load_throughput.py [--size-gb 16] [--folder DIR] [--dtype bfloat16] [--device cpu]
                                         [--repeat 1] [--baseline-ref REF] [--profile] [--json PATH]
"""
from __future__ import annotations

import argparse
import copy
import ctypes
import hashlib
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
RELEASED = HERE / "qwen3_omni_released_config.json"
LAYOUT_VERSION = 1
CHUNK = 64 << 20


# ---- the synthetic checkpoint -----------------------------------------------------------------
def config_for(size_gb: float) -> dict:
    """The released configuration with as many Thinker layers as fit in `size_gb` (at least 3:
    deepstack adds after layers 0-2), the Talker's accept layer inside them."""
    base = json.loads(RELEASED.read_text())
    fixed = checkpoint_bytes(with_depth(base, 3)) - 3 * layer_bytes(base)
    layers = max(3, int((size_gb * 1e9 - fixed) // layer_bytes(base)))
    return with_depth(base, layers)


def with_depth(cfg: dict, layers: int) -> dict:
    cfg = copy.deepcopy(cfg)
    cfg["thinker_config"]["text_config"]["num_hidden_layers"] = layers
    cfg["talker_config"]["accept_hidden_layer"] = min(cfg["talker_config"]["accept_hidden_layer"], layers)
    return cfg


def layer_bytes(cfg: dict) -> int:
    return checkpoint_bytes(with_depth(cfg, 4)) - checkpoint_bytes(with_depth(cfg, 3))


def checkpoint_bytes(cfg: dict, itemsize: int = 2) -> int:
    return sum(itemsize * _numel(shape) for _, shape in disk_layout(cfg))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def disk_layout(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(on-disk name, shape) of every tensor of a checkpoint for `cfg`, in the released layout
    (per-expert gate/up/down, merged parameters as their parts), from the model on the meta device."""
    from omnivox.layers.merged import checkpoint_parts
    from omnivox.models.qwen3_omni.config import Qwen3OmniConfig
    from omnivox.models.qwen3_omni.model import Qwen3OmniModel

    with torch.device("meta"):
        model = Qwen3OmniModel(Qwen3OmniConfig.from_hf(cfg))
    params, merged = dict(model.named_parameters()), checkpoint_parts(model)
    merged_keys = {key for key, _ in merged.values()}
    out = [(name, part.shape) for name, (_, part) in merged.items()]
    for name, p in params.items():
        if name in merged_keys:
            continue
        if name.endswith("experts.gate_up_proj"):
            e, two_i, h = p.shape
            prefix = name[: -len(".gate_up_proj")]
            out += [(f"{prefix}.{i}.{kind}.weight", (two_i // 2, h)) for i in range(e) for kind in ("gate_proj", "up_proj")]
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            out += [(f"{prefix}.{i}.down_proj.weight", tuple(p.shape[1:])) for i in range(p.shape[0])]
        else:
            out.append((name, tuple(p.shape)))
    return sorted(out)


def ensure_checkpoint(size_gb: float, root: Path, shard_gb: float = 4.0) -> Path:
    """The cached folder for `size_gb`, written on first use (marker file last)."""
    cfg = config_for(size_gb)
    key = hashlib.sha256(json.dumps([LAYOUT_VERSION, cfg, shard_gb], sort_keys=True).encode()).hexdigest()[:10]
    folder = root / f"omnivox-load-throughput-{size_gb:g}gb-{key}"
    if (folder / "COMPLETE").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    layout = disk_layout(cfg)
    pool = torch.randn(CHUNK // 2, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    shards, current, size = [], [], 0
    for name, shape in layout:
        current.append((name, shape))
        size += 2 * _numel(shape)
        if size >= shard_gb * 1e9:
            shards.append(current)
            current, size = [], 0
    if current:
        shards.append(current)
    weight_map = {}
    t0 = time.monotonic()
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(folder / fname, shard, pool)
        weight_map.update({name: fname for name, _ in shard})
        print(f"  wrote {fname} ({i + 1}/{len(shards)}, {time.monotonic() - t0:.0f} s)", flush=True)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    (folder / "COMPLETE").write_text("")
    return folder


def _write_shard(path: Path, shard: list, pool: torch.Tensor) -> None:
    from safetensors.torch import save_file

    tensors, at = {}, 0
    for name, shape in shard:
        n = _numel(shape)
        if at + n <= pool.numel():
            values = pool[at:at + n].clone()
        else:  # the pool tiled (a large tensor)
            values = pool.repeat(-(-(at + n) // pool.numel()))[at:at + n]
        tensors[name] = values.view(shape)
        at = (at + n) % pool.numel()
    save_file(tensors, str(path), metadata={"format": "pt"})
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- the page cache ---------------------------------------------------------------------------
def drop_cache(files: list[Path]) -> None:
    """Evict the files' pages (clean once fsynced) without root: posix_fadvise DONTNEED."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(files: list[Path]) -> float:
    """Fraction of the files' pages in the page cache (mincore on a private mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    total = resident = 0
    for f in files:
        size = f.stat().st_size
        with open(f, "rb") as fh, mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY) as mm:
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
            if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
                return float("nan")
            resident += sum(v & 1 for v in vec)
            total += pages
            del addr
    return resident / max(total, 1)


# ---- the measurements ---------------------------------------------------------------------------
def read_raw(files: list[Path]) -> float:
    """Seconds to read every file sequentially in CHUNK-sized readinto calls."""
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    t0 = time.monotonic()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(view):
                pass
    return time.monotonic() - t0


def read_fresh(files: list[Path]) -> float:
    """Seconds to read every file sequentially into newly allocated memory of its size, all of it
    kept until the end: the disk plus what any loader pays to materialise the weights' memory
    (on a VM whose memory is backed lazily by the host, first touches are most of it)."""
    keep = []
    t0 = time.monotonic()
    for f in files:
        size = f.stat().st_size
        buf = torch.empty(size, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        with open(f, "rb", buffering=0) as fh:
            done = 0
            while done < size:
                done += fh.readinto(view[done:done + CHUNK])
        keep.append(buf)
    seconds = time.monotonic() - t0
    del keep
    return seconds


def load(folder: Path, dtype: str, device: str, loader=None) -> float:
    if loader is None:
        from omnivox.models.qwen3_omni.weights import load_model as loader

    t0 = time.monotonic()
    model = loader(folder, dtype=dtype, device=device, progress=False)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.monotonic() - t0
    del model
    return seconds


def loader_at(ref: str):
    """`load_model` of `weights.py` as it is at git `ref` (the same run measures old beside new)."""
    import importlib.util
    import subprocess

    code = subprocess.run(["git", "-C", str(HERE.parent), "show", f"{ref}:omnivox/models/qwen3_omni/weights.py"],
                          check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="omnivox-weights-")) / "weights_baseline.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location("weights_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load_model


def measure(folder: Path, dtype: str, device: str, repeat: int, profile: bool, baseline: str | None = None,
            fresh: bool = True) -> dict:
    """Each repeat, every read cold (page cache dropped first) except `warm`, back to back, so a
    disk shared with other work slows all of one repeat alike: the ratios are per repeat."""
    from omnivox.models.qwen3_omni.weights import shard_files

    files = shard_files(folder)
    nbytes = sum(f.stat().st_size for f in files)
    old = loader_at(baseline) if baseline else None
    steps = [("raw", lambda: read_raw(files)), ("warm", lambda: read_raw(files))]
    if device == "cpu" and fresh:
        steps.append(("fresh", lambda: read_fresh(files)))
    steps.append(("loader", lambda: load(folder, dtype, device)))
    if old is not None:
        steps.append(("baseline", lambda: load(folder, dtype, device, old)))
    runs: dict[str, list[float]] = {k: [] for k, _ in steps}
    resident: list[float] = []
    for _ in range(repeat):
        for key, fn in steps:
            if key != "warm":
                drop_cache(files)
            if key == "raw":
                resident.append(round(resident_fraction(files), 3))
            runs[key].append(fn())
    out = {"bytes": nbytes, "files": len(files), "dtype": dtype, "device": device, "repeat": repeat,
           "baseline_ref": baseline, "resident_after_drop": resident}
    for k, secs in runs.items():
        s = statistics.median(secs)
        out[k] = {"seconds": round(s, 2), "gb_s": round(nbytes / s / 1e9, 3), "all_seconds": [round(x, 2) for x in secs]}
    for k in ("raw", "fresh"):
        if k in runs:  # loader GB/s over k's GB/s, per repeat
            ratios = [b / a for a, b in zip(runs["loader"], runs[k])]
            out[f"loader_over_{k}"] = {"median": round(statistics.median(ratios), 3),
                                       "each": [round(x, 3) for x in ratios]}
    if profile:
        out["profile"] = profile_load(folder, files, dtype, device)
    return out


def profile_load(folder: Path, files: list[Path], dtype: str, device: str, top: int = 12) -> list[str]:
    """cProfile of one cold load: where the time goes (safetensors reads, casts, copies)."""
    import cProfile
    import io
    import pstats

    drop_cache(files)
    prof = cProfile.Profile()
    prof.enable()
    load(folder, dtype, device)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return [line for line in s.getvalue().splitlines() if line.strip()][:top + 8]


def report(r: dict) -> str:
    gb = r["bytes"] / 1e9
    lines = [f"Loader throughput: {gb:.2f} GB in {r['files']} shards, load into {r['dtype']} on {r['device']}, "
             f"median of {r['repeat']}; page cache dropped before each cold read (posix_fadvise DONTNEED; "
             f"resident after the drop: {r['resident_after_drop']})", "",
             f"{'read':<38} {'seconds':>8} {'GB/s':>8}   each run (s)"]
    names = (("raw", "raw sequential read (cold)"), ("warm", "raw sequential read (page cache)"),
             ("fresh", "raw read into new memory (cold)"), ("loader", "load_model (cold)"),
             ("baseline", f"load_model at {r.get('baseline_ref')} (cold)"))
    for key, what in names:
        if key in r:
            lines.append(f"{what:<38} {r[key]['seconds']:>8.2f} {r[key]['gb_s']:>8.3f}   {r[key]['all_seconds']}")
    ratio = r["loader_over_raw"]["median"]
    lines += ["", f"loader / raw disk: {ratio:.0%} per run {r['loader_over_raw']['each']} "
                  f"(goal >= 80 %: {'met' if ratio >= 0.8 else 'NOT met'})"]
    if "loader_over_fresh" in r:
        lines.append(f"loader / raw read into new memory: {r['loader_over_fresh']['median']:.0%} "
                     f"per run {r['loader_over_fresh']['each']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gb", type=float, default=16.0, help="checkpoint size to write and load (default 16)")
    p.add_argument("--folder", type=Path, help="an existing checkpoint folder (default: the synthetic one)")
    p.add_argument("--root", type=Path, help="where the synthetic checkpoint is cached (default $OMNIVOX_CACHE or tmp)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--profile", action="store_true", help="also cProfile one cold load")
    p.add_argument("--baseline-ref", help="also time weights.py's load_model as it is at this git ref")
    p.add_argument("--no-fresh", action="store_true", help="skip the read into new memory (needs the checkpoint's size in RAM)")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    root = a.root or Path(os.environ.get("OMNIVOX_CACHE") or tempfile.gettempdir())
    folder = a.folder or ensure_checkpoint(a.size_gb, root)
    print(f"checkpoint: {folder}", flush=True)
    r = measure(folder, a.dtype, a.device, a.repeat, a.profile, a.baseline_ref, not a.no_fresh)
    text = report(r)
    print("\n" + text)
    if a.profile:
        print("\n" + "\n".join(r["profile"]))
    if a.json:
        a.json.write_text(json.dumps({**r, "table": text}, indent=1))


if __name__ == "__main__":
    main()
