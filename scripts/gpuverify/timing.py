"""Timing on the device: CUDA events around each call after a warm-up, the median kept."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_us(fn: Callable[[], object], device: str, iters: int, warmup: int = 2) -> float:
    """Median microseconds of one `fn()` call."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    if device.startswith("cuda"):
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref|| in fp64 (NaN anywhere gives NaN)."""
    a, ref = a.double(), ref.double()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))
