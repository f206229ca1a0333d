"""The KV budget from the device's memory (`--gpu-memory-utilization`, the peers' convention), used
when `--kv-cache-mb` is left out and a KV-caching stage runs on CUDA.

On each CUDA device this process may use `utilization x total` bytes; what it already holds there
after loading (weights, allocator cache: `torch.cuda.memory_reserved`) comes off, and the rest is
the KV of the stages on that device, shared equally (Qwen3-Omni's Thinker and Talker on one GPU:
half each; under `--placement` each device budgets its own stages). Only this process's own
memory is counted, never another's: two servers (or replicas) on one GPU share it honestly when
their utilizations add up to at most 1 (e.g. 0.45 each). A tensor-parallel rank holds the same
shard shapes as rank 0, so rank 0's budget is every rank's. Stages on the CPU keep the family's
default share. NOTE: activations are not profiled: the `1 - utilization` left over is their room.
"""
from __future__ import annotations

from typing import Callable

import torch

from omnivox.errors import OmnivoxError

MemoryInfo = Callable[[torch.device], tuple[int, int]]  # device -> (total bytes, bytes this process holds)


def cuda_memory(device: torch.device) -> tuple[int, int]:
    return torch.cuda.mem_get_info(device)[1], torch.cuda.memory_reserved(device)


def kv_budget_from_memory(stage_devices: dict[str, torch.device], utilization: float, default_mb: float,
                          memory: MemoryInfo = cuda_memory) -> dict[str, float] | None:
    """MB of KV per KV-caching stage (`stage_devices`: each one's device), or None when none is on
    CUDA (the caller keeps its default). `default_mb`: the family's total default, shared equally
    by the stages off CUDA. One-line error when a device has no room left at `utilization`."""
    if not 0 < utilization <= 1:
        raise OmnivoxError(f"--gpu-memory-utilization {utilization:g} must be in (0, 1]")
    if not any(d.type == "cuda" for d in stage_devices.values()):
        return None
    on: dict[torch.device, list[str]] = {}
    for stage, device in stage_devices.items():
        on.setdefault(device, []).append(stage)
    out: dict[str, float] = {}
    for device, stages in on.items():
        if device.type != "cuda":
            out.update({s: default_mb / len(stage_devices) for s in stages})
            continue
        total, held = memory(device)
        room = utilization * total - held
        if room < 2**20 * len(stages):
            raise OmnivoxError(f"--gpu-memory-utilization {utilization:g} of {device} ({total / 2**30:.1f} GiB) "
                               f"leaves no KV room: this process already holds {held / 2**30:.1f} GiB there (raise "
                               "it, or try --quantization fp8, --placement or --kv-cache-mb)")
        out.update({s: room / 2**20 / len(stages) for s in stages})
    return out
