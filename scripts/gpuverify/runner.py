"""Phases with time boxes, and the JSON written after each one.

A phase is `fn(box, state) -> bool | None` (None = ok). It fills `box.results` as it goes and
calls `box.check("what comes next")` between sub-steps: past its deadline that raises
`OutOfTime`, the phase ends with what it has (`ok: false`, `results["out_of_time"]`), and the
run goes on with the next phase. `Skip(reason)` ends a phase that cannot run here
(`ok: false, results: {"skipped": reason}`); any other exception is recorded with its traceback.
"""
from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


class OutOfTime(Exception):
    pass


class Skip(Exception):
    pass


@dataclass
class Box:
    """One phase's time box and results."""

    name: str
    deadline: float  # time.monotonic()
    results: dict[str, Any] = field(default_factory=dict)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def check(self, next_step: str) -> None:
        """Between sub-steps: stop here if the box is spent."""
        if self.left() <= 0:
            raise OutOfTime(next_step)


@dataclass
class State:
    """What phases hand on to later phases (the built models, the device)."""

    sizes: Any
    device: str
    out: Path
    qwen: Any = None  # omnivox Qwen3OmniModel
    hf: Any = None  # transformers' twin, sharing its tensors
    hf_error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def run_phase(name: str, fn: Callable[[Box, State], bool | None], state: State, box_s: float) -> dict:
    box = Box(name, time.monotonic() + box_s)
    t0 = time.monotonic()
    ok = False
    try:
        ok = fn(box, state) is not False
    except OutOfTime as e:
        box.results["out_of_time"] = f"{box_s:.0f} s box spent before: {e}"
    except Skip as e:
        box.results = {"skipped": str(e)}
    except Exception as e:  # record, go on with the next phase
        box.results["error"] = f"{type(e).__name__}: {e}"
        box.results["traceback"] = traceback.format_exc()[-4000:]
    return {"name": name, "ok": bool(ok), "seconds": round(time.monotonic() - t0, 2), "results": box.results}


def write_json(path: Path, data: dict) -> None:
    """Atomically: a reader (or a killed run) sees the previous file or this one, never half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=_plain) + "\n")
    os.replace(tmp, path)


def _plain(x: Any) -> Any:
    if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)
