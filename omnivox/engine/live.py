"""Admission by frame deadline (`--scheduling slack`): how many full-duplex sessions the engine keeps
in time (`LiveCapacity`, part of the slack table; read by `Slack.admits_live`).

A live session (`Request.live`) has no buffer to play from: each output frame is due one frame
after the input frame whose step makes it arrived. A new one opens only when every running one
would still get its frames within HEADROOM of a frame with one more row (`Engine.submit` decides,
under its lock, atomically with the submission: refused, Overloaded, or started at once; never
queued).

The worst frame latency at `rows` live rows (`worst_latency`): a frame that arrives as a step
starts waits for it, then for its own step, both at `rows` rows (the stage costs of the live
route, 2 x the predicted step); once measured, the measured latency (the LATENCY_QUANTILE of the
steps' worst live frame latencies over the last LATENCY_WINDOW_S, each from the input frame's
arrival or from the session's previous frame if later: a client ahead of real time queues its own
frames; a tail, not a mean: frames are late on the tail) plus what the stage costs add from its
rows to `rows`, never above it scaled by `rows` over its rows. After each step the graph turns
this into `capacity`, the most rows in time (0 while the measured latency is over it already);
before anything is measured, and with no live session running, a session is admitted.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np

from omnivox.engine.request import Request

if TYPE_CHECKING:
    from omnivox.engine.slack import StepCost

LATENCY_WINDOW_S = 2.0  # live frame latencies measured over this much of the recent past ...
LATENCY_QUANTILE = 0.95  # ... bound by this quantile of the steps' worst ones


class LiveCapacity:
    """The live sessions' measured frame latency and the most of them in time. `cost`: a stage's
    step-time model (`SlackTable.cost`); `min_samples`: the steps measured before the latency is."""

    def __init__(self, cost: Callable[[str], StepCost], min_samples: int):
        self.cost, self.min_samples = cost, min_samples
        self.route: tuple[str, ...] = ()  # the stages a live session passes (the first one admitted sets it)
        # (when, worst live frame latency, live rows) of the steps in the last LATENCY_WINDOW_S ...
        self.latencies: deque[tuple[float, float, int]] = deque()
        # ... their LATENCY_QUANTILE (None: fewer than min_samples steps there) and their mean live rows
        self.measured_latency: float | None = None
        self.latency_rows = 0.0
        self.capacity: int | None = None  # the most live rows whose frames stay in time (None: unmeasured)

    def observe(self, requests: Iterable[Request], since: float) -> None:
        """After a graph step begun at `since`: the worst latency of the live frames it emitted
        (`Request.latest`: from the input frame's arrival, or from the session's previous frame if
        later: a client that sends faster than real time queues its own frames, which says
        nothing of the load), into the window, with the live rows."""
        if not self.route:  # no live session ever: nothing to measure (no work per step)
            return
        live = [r for r in requests if r.live]
        worst = max((r.latest[1] for r in live if r.latest is not None and r.latest[0] >= since), default=None)
        if worst is not None:
            self.latencies.append((since, worst, len(live)))
        while self.latencies and self.latencies[0][0] < since - LATENCY_WINDOW_S:
            self.latencies.popleft()
        if len(self.latencies) < self.min_samples:
            self.measured_latency, self.latency_rows = None, 0.0
            return
        self.measured_latency = float(np.quantile([w for _, w, _ in self.latencies], LATENCY_QUANTILE))
        self.latency_rows = sum(n for _, _, n in self.latencies) / len(self.latencies)

    def worst_latency(self, rows: int) -> float | None:
        """The predicted worst frame latency of a live session at `rows` live rows. From the stage
        costs of a live route: a frame that arrives as a step starts waits for it, then for its own
        step, both at `rows` rows (2 x the predicted step). Once latencies are measured: the
        measured one (it holds what the stage costs do not: the engine loop, the other requests'
        stages, the machine) plus what the costs add from its rows to `rows`, never above it scaled
        by `rows` over its rows (a step costs at most proportionally more). None: nothing measured."""
        steps = [self.cost(name).predict(rows, rows) for name in self.route]
        model = None if not steps or None in steps else 2 * sum(steps)
        measured = self.measured_latency
        if measured is None or self.latency_rows < 1:
            return model
        bound = measured * max(1.0, rows / self.latency_rows)
        if model is None:
            return bound
        now = round(self.latency_rows)
        return min(bound, measured + model - 2 * sum(self.cost(n).predict(now, now) for n in self.route))

    def update(self, limit_s: float) -> None:
        """`capacity`: the most live rows whose worst frame latency stays within `limit_s` (0 while
        the measured latency is over it already, whatever the model says); None until something
        is measured. Read by `Slack.admits_live` on a caller's thread (an int)."""
        if not self.route:
            return
        if self.measured_latency is not None and self.measured_latency > limit_s:
            self.capacity = 0
            return
        if self.worst_latency(1) is None:
            self.capacity = None
            return
        lo, hi = 0, 1  # the largest rows in time: worst_latency grows with rows
        while hi < 1 << 16 and (self.worst_latency(hi) or 0.0) <= limit_s:
            lo, hi = hi, 2 * hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if (self.worst_latency(mid) or 0.0) <= limit_s else (lo, mid)
        self.capacity = lo

    def admits(self, live: int) -> bool:
        """May one more live session open beside `live` running ones? Yes with none running and
        before anything is measured; else while `live + 1` rows stay in time."""
        return live == 0 or self.capacity is None or live + 1 <= self.capacity
