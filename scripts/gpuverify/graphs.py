"""Phase graphs: CUDA-graph replay equals eager, for every batch-size bucket.

The graph runner is not in this checkout yet. When a module below exists, this phase calls its

    check_replay(model, device: str, buckets: tuple[int, ...]) -> dict[str, dict]

(one entry per captured step, e.g. "thinker B=8": {"max_abs_diff": float, "ok": bool, ...}): capture
each bucket, replay it on fresh inputs, run the same step eagerly, compare. Until then the phase
records that it was skipped.
"""
from __future__ import annotations

import importlib
import importlib.util

from gpuverify.runner import Box, Skip, State

RUNNER_MODULES = ("omnivox.stages.graphs", "omnivox.engine.graphs")
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def graphs(box: Box, st: State) -> bool:
    name = next((m for m in RUNNER_MODULES if importlib.util.find_spec(m) is not None), None)
    if name is None:
        raise Skip("no graph runner in this checkout")
    check = getattr(importlib.import_module(name), "check_replay", None)
    if check is None:
        raise Skip(f"{name} has no check_replay(model, device, buckets)")
    if st.qwen is None:
        raise Skip("no model: the build phase did not finish")
    box.results.update(check(st.qwen, st.device, BUCKETS))
    return all(v.get("ok") for v in box.results.values() if isinstance(v, dict))
