"""The model families omnivox serves: which family a `--model` value names (`detect`) and how it
loads (`load`). What a loaded model offers is `omnivox.serving` (the `ServedModel` protocol and
its capabilities, implemented in each family's `models/<family>/served.py`).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from omnivox.errors import CheckpointError, InputError
from omnivox.serving import Family

if TYPE_CHECKING:
    from omnivox.engine.config import EngineConfig
    from omnivox.engine.memory import DeviceMemory
    from omnivox.media_budget import MediaLimits
    from omnivox.serving import ServedModel


def _families() -> tuple[Family, ...]:
    from omnivox.models.fish_s2.family import FAMILY as FISH_S2
    from omnivox.models.moshi.family import FAMILY as MOSHI
    from omnivox.models.qwen3_omni.family import FAMILY as QWEN3_OMNI
    return QWEN3_OMNI, FISH_S2, MOSHI  # the first is the default (no --model)


FAMILIES = _families()


def detect(model: str | None, any_family: bool = False) -> tuple[Family, Path | None]:
    """(family, folder) for a --model value; folder None means the family's built-in demo. A
    family that generate / speak / bench do not take (`Family.unserved`) is refused with its
    reason unless `any_family` (`omnivox serve`, `omnivox duplex`)."""
    family, folder = _detect(model)
    if not any_family and family.unserved:
        raise CheckpointError(family.unserved)
    return family, folder


def _detect(model: str | None) -> tuple[Family, Path | None]:
    if model is None:
        return FAMILIES[0], None
    for fam in FAMILIES:
        if model == fam.demo:
            return fam, None
    folder = Path(model)
    if not folder.is_dir():
        demos = " / ".join(f.demo for f in FAMILIES)
        raise CheckpointError(f"model folder {folder} does not exist (or pass --model {demos})")
    config = folder / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        raw = json.loads(config.read_text())
        kind = raw.get("model_type")
    except (ValueError, AttributeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config} is not a valid JSON object ({type(e).__name__})") from None
    for fam in FAMILIES:
        if kind in fam.model_types:
            return fam, folder
    for fam in FAMILIES:
        if kind is None and any(k in raw for k in fam.config_keys):
            return fam, folder
    known = "; ".join(f"{' / '.join(f.model_types)} ({f.label})" for f in FAMILIES)
    raise CheckpointError(f"config.json model_type {kind!r} is not supported; omnivox serves {known}")


def load(model: str | None, *, dtype: str = "float32", device: str = "cpu", progress: bool = True,
         engine_config: "EngineConfig | None" = None, kv_cache_mb: "float | str | dict | None" = None,
         cpu_threads: int | None = None, media_limits: "MediaLimits | None" = None,
         placement: "str | dict | None" = None, tensor_parallel_size: int = 1, quantization: str | None = None,
         fp8_compute: str = "auto", gpu_memory_utilization: float = 0.9,
         device_memory: "DeviceMemory | None" = None, any_family: bool = False) -> "ServedModel":
    """The loaded model for a --model value. kv_cache_mb None: the family's default, a number: the
    total, "thinker=MB,talker=MB" (or a dict): each KV-caching stage's; placement: a device per
    stage (engine/placement.py), checked before any weight loads; tensor_parallel_size > 1: the
    Thinker over that many processes (Qwen3-Omni only); kv_cache_mb None with a KV stage on CUDA:
    the budget from the device's memory after a profiling run, under `gpu_memory_utilization`
    (engine/memory.py: `loaded.kv_budget` says how; `device_memory` replaces `torch.cuda`'s
    figures in tests); quantization "fp8": block-FP8 weights
    (layers/fp8.py), `fp8_compute` their compute path; on CPU the intra-op threads are set for it (`configure_cpu_threads`); media_limits None: the defaults; any_family: as `detect`'s."""
    from omnivox.engine.config import EngineConfig
    import torch

    from omnivox.engine.memory import CUDA, budget_after_warmup
    from omnivox.engine.placement import Placement, loop_groups, parse_kv_budget

    family, folder = detect(model, any_family)
    where = Placement.parse(placement, device).check(family.stages)
    budget = parse_kv_budget(kv_cache_mb, family.kv_stages)
    cfg = engine_config or EngineConfig()
    loop_groups(cfg.stage_loops, {s: torch.device("cpu") for s in family.stages})  # names, before any weight loads
    tp = {}
    if tensor_parallel_size > 1:
        if "thinker" not in family.stages:
            raise InputError(f"tensor parallelism shards Qwen3-Omni's Thinker; {family.label} runs in one process")
        tp = {"tensor_parallel_size": tensor_parallel_size}
    loaded = family.load(folder, dtype=dtype, device=device, progress=progress, engine_config=cfg, placement=where,
                         quantization=quantization, fp8_compute=fp8_compute, **tp)
    loaded.kv_budget = None
    if budget is None:  # from the devices' memory, when a KV stage is on CUDA
        try:
            loaded.kv_budget = budget_after_warmup(family, loaded, {s: where.device(s) for s in family.kv_stages},
                                                   gpu_memory_utilization, device_memory or CUDA)
        except BaseException:
            loaded.close()  # e.g. no room: its tensor-parallel workers stop too
            raise
        budget = loaded.kv_budget and loaded.kv_budget.stage_mb
    if isinstance(budget, dict):
        loaded.engine_config = replace(loaded.engine_config, kv_cache_mb=sum(budget.values()),
                                       kv_stage_mb=tuple(budget.items()))
    else:
        mb = budget if budget is not None else loaded.default_kv_mb()
        loaded.engine_config = replace(loaded.engine_config, kv_cache_mb=mb)  # the engine starts later, on first use
    if media_limits is not None:
        loaded.media_limits = media_limits
    if device == "cpu":
        configure_cpu_threads(loaded, cpu_threads)
    return loaded


def configure_cpu_threads(loaded: "ServedModel", threads: int | None = None) -> int:
    """Intra-op threads for CPU serving. None = auto: one thread for models under 100M
    parameters, whose steps are many tiny ops where thread hand-offs cost more than they
    save (measured on 2 cores: 3x the audio throughput of the default); torch's default
    otherwise. Process-wide: call it only in processes omnivox owns (serve, bench, speak)."""
    import torch

    if threads is None:
        threads = 1 if loaded.parameter_count() < 100_000_000 else torch.get_num_threads()
    torch.set_num_threads(max(1, int(threads)))
    return torch.get_num_threads()
