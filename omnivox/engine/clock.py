"""Time, through one seam: the engine's stages and requests read the time only from their graph's
`Clock` (`StageGraph.set_clock`), never from `time` directly, so a time-based decision (the
vocoder's auto first chunk, the times on events) can be tested on a `ManualClock` that a test
moves on, and processes that must agree can share one source.

`Clock` reads `time.monotonic()`: the times on engine events compare with what the API layer
measures (arrival, time to first audio)."""
from __future__ import annotations

import threading
import time


class Clock:
    """Monotonic seconds."""

    def now(self) -> float:
        return time.monotonic()


class ManualClock(Clock):
    """A clock that moves only when told (`advance`); any thread may read or move it."""

    def __init__(self, start: float = 0.0):
        self._t, self._lock = start, threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._t

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._t += seconds
