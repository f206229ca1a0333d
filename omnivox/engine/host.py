"""The one way a stage step reads the device from the host. A step of a stage reads at most once:
the ids it sampled (an AR stage), the audio it decoded (the vocoder), or the rows it encoded (the
encoder, kept on the host for the clip's later renders). Everything else in a
step stays on the device, so a step never stalls the stream it runs on and can be replayed from
a CUDA graph. `reading()` tells the tests' guards that a read is this helper's; `counts` lets a
benchmark tell ids from audio copies.
"""
from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager

import numpy as np
import torch

counts: Counter = Counter()  # reads by kind ("ids", "audio") since the process started
_local = threading.local()


def reading() -> bool:
    """True while this thread is inside `ids` or `audio` (the sanctioned reads)."""
    return getattr(_local, "depth", 0) > 0


@contextmanager
def _sanctioned(kind: str):
    counts[kind] += 1
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def ids(t: torch.Tensor) -> list:
    """The step's sampled ids (any shape) as nested Python lists."""
    with _sanctioned("ids"):
        return t.tolist()


def audio(t: torch.Tensor) -> np.ndarray:
    """The step's decoded audio as float32 numpy, owning its memory.
    NOTE: on CPU `.cpu().numpy()` would alias the tensor, and a graph's output buffer is
    overwritten by its next replay while the caller still holds the samples."""
    with _sanctioned("audio"):
        return np.array(t.float().cpu().numpy(), copy=True)


def rows(t: torch.Tensor) -> np.ndarray:
    """The encoder step's new rows as host arrays owning their memory, in their dtype where numpy
    has it (float32 for bfloat16: exact, and exact back)."""
    with _sanctioned("rows"):
        keep = t.dtype in (torch.float16, torch.float32, torch.float64)
        return np.array((t if keep else t.float()).cpu().numpy(), copy=True)
