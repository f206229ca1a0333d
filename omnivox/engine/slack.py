"""Streaming-aware scheduling (`EngineConfig.scheduling`): which request steps, how much prefill a
step may carry, and which new request may start, decided by how close each listener is to a stall.

Two kinds of request (`Request.playing`, set at submission): a **playing** stream has a listener
who plays its audio as it arrives (a streamed spoken reply); everything else is **batch** (offline
calls, non-streamed replies, text only): nobody waits on its audio in real time, so it runs for
throughput in the time playing streams leave. The rules below pace playing streams; batch rows:
- are never gated nor paced: with no playing stream they step exactly as under `Fifo`;
- yield first: their rows skip a step while a playing stream needs the time (one is before its
  first audio, or has less slack than BATCH_FLOOR x `stream_lead_s` or than a step carrying the
  batch rows and the margin), come last in the order
  (a budget or a preemption hits them first), and take no capacity from playing streams (the
  capacity rule counts playing rows: batch rows yield when the time is needed);
- their prefill is capped by the smallest playing slack, as every prefill is.

A **live** playing request (`Request.live`: a full-duplex session) has no buffer to play from: its
prompt stream stays open for its whole life, and each output frame is due one frame after the
input frame whose step makes it arrived (`Request.frame_due`, `AudioChunk.due`). Its slack is
that of its next waiting frame (`deadline - now`; inf while no input waits for a step: it waits
on its user); it is never ahead (it cannot make a frame before its input), so it never yields;
it counts as a stream that presses as soon as its waiting frame is close to its deadline (less
than a step and the margin away), and it is admitted by frame deadline (below), never queued.

The state is one **slack table** shared by every stage of a graph (`SlackTable`), so the policy
holds whether the stages step in one loop or in several: per playing request the listener's
playback (`engine.playback`: the audio emitted so far, from its first chunk) and the frames its
speech stage has made; per stage a model of its step time (`StepCost`, measured on the graph's
clock) and the rows of each kind its next decode step would carry. From these:

- **slack** of a stream: seconds of audio its listener has left (`first + received - now`); before
  its first audio, what is left of the TTFA target (`ttfa_target_s - waited`); a live session's:
  until its waiting frame's deadline. The deadline of its next chunk is `now + slack`.
- **lead**: seconds of audio its speech stage has made beyond what the listener has played (frames
  made x seconds per frame, from the first audio). A stream whose lead is at least `stream_lead_s`
  is ahead: it yields its AR steps (every stage) until the lead falls back.

Each stage applies a policy (`Fifo` or `Slack`) to its own rows, reading the table:
- order: the most urgent (smallest slack) rows first, so a budget or a preemption hits the rest;
- yield: rows of a stream that is ahead are skipped while another stream needs the time (a
  stream is urgent: before its first audio, or with less slack than a step and the margin; a
  request waits for capacity; steps are slower than real time needs); then they are no work: the engine sleeps until the
  first of them is due (`SlackTable.next_due`). With nobody pressed, every stream runs at full speed;
  no row yields while the head of its stage's queue cannot start (engine/scheduler.py);
- prefill cap: the tokens of prefill (new prompts, chunks, streamed audio) one step may carry are
  those whose predicted time fits in the smallest slack among the streams that play, less the
  step's decode rows and a margin, and never fewer than one KV page (a prompt always progresses;
  until the stage's costs are measured, one page);
- capacity admission (`Slack.admits`, at the graph): a new playing request starts only when the step time
  predicted with one more row in each stage of its route stays within `HEADROOM` of a frame's
  audio, that is when the audio-seconds per second the engine can make still cover every admitted
  stream plus it (the prediction is never above the measured average step scaled by rows + 1 over
  its average rows: a step costs at most proportionally more), and while the measured steps (a moving
  average) are within it too; and at most max(1, rows / GROWTH) start in one step, so the batch grows through
  sizes that get measured. Until every stage has been measured it starts (within that growth; only
  --max-running bounds the total), and whenever no stream is playing it starts. A request with a
  streamed prompt still open (a realtime turn while its user speaks) is not gated: it listens, and
  counts once it speaks;
- admission by frame deadline (`Slack.admits_live`, in `Engine.submit` under its lock): a new live
  session opens only when every running one would still get its frames within HEADROOM of a
  frame with one more row, as measured and predicted by the table's `LiveCapacity`
  (engine/live.py); a live session is refused (Overloaded) or starts at once, never queued;
- first chunk: while requests wait for capacity, the vocoder's auto first chunk outlasts
  LOADED_FIRST_CHUNK times the longest of its measured step interval, the graph's and the step
  predicted at the rows admitted now (else its measured interval, as under fifo).

`Fifo` is the policy from before this module: arrival order, every row with work steps, prefill
chunks up to the token budget, no gate (live sessions: only the model's own bound on the sessions
its KV holds).
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np

from omnivox.engine.live import LiveCapacity
from omnivox.engine.request import Request

HEADROOM = 0.9  # admitted streams may take this share of real time: the rest absorbs jitter and builds leads
MARGIN_S = 0.04  # a prefill chunk leaves this much of the smallest slack unused (step-time jitter)
MIN_SAMPLES = 8  # steps a stage's cost model needs before it predicts
DECAY = 0.97  # the weight of a decode step's sample falls by this at each newer one (about 30 steps' memory)
LOADED_FIRST_CHUNK = 1.5  # under load a first chunk outlasts this many more steps (TTFA grows by a frame or so)
GROWTH = 8  # a graph step admits at most max(1, rows / GROWTH) new requests (the batch grows measured)
BATCH_FLOOR = 0.5  # batch rows step only while every playing stream has this share of stream_lead_s buffered


class StepCost:
    """One stage's step time, `t = a + c * rows + b * extra`: `rows` sequences each computing one
    input and sampling, `extra` inputs beyond one per row (prefill, drafts). Weighted least squares
    over the recent steps, the newer weighing more (`DECAY`: the load and the machine change). A
    term whose feature has not varied is left out: one batch size seen predicts the same time at
    any batch (admission grows the batch a few rows a step, `GROWTH`, so the next sizes get
    measured); no prefill seen leaves the per-token cost unknown (`per_token` None)."""

    def __init__(self, window: int = 128):
        self.samples: deque[tuple[int, int, float]] = deque(maxlen=window)  # (rows, extra, seconds)
        self._coef: tuple[float, float, float | None] | None = None

    def observe(self, tokens: int, rows: int, seconds: float) -> None:
        if rows > 0 and seconds >= 0:
            self.samples.append((rows, max(0, tokens - rows), seconds))
            self._coef = None

    def coef(self) -> tuple[float, float, float | None] | None:
        """(a, c, b), each >= 0 (b None: no prefill measured); None until MIN_SAMPLES steps."""
        if len(self.samples) < MIN_SAMPLES:
            return None
        if self._coef is None:
            x = np.array([(1.0, r, e) for r, e, _ in self.samples])
            t = np.array([s for _, _, s in self.samples])
            w = np.sqrt(DECAY ** np.arange(len(t))[::-1])
            varies = [0] + [j for j in (1, 2) if np.ptp(x[:, j]) > 0]
            fit = np.linalg.lstsq(x[:, varies] * w[:, None], t * w, rcond=None)[0]
            coef = dict(zip(varies, np.maximum(fit, 0.0)))
            self._coef = (float(coef[0]), float(coef.get(1, 0.0)), float(coef[2]) if 2 in coef else None)
        return self._coef

    def predict(self, tokens: int, rows: int) -> float | None:
        """A step of `rows` rows computing `tokens` inputs; None until measured."""
        if rows <= 0:
            return 0.0
        coef = self.coef()
        if coef is None:
            return None
        a, c, b = coef
        return a + c * rows + (b or 0.0) * max(0, tokens - rows)

    def per_token(self) -> float | None:
        """Seconds one more prefill token adds to a step (None: no prefill measured yet)."""
        coef = self.coef()
        return None if coef is None else coef[2]


class SlackTable:
    """The per-request and per-stage state every stage's policy reads (see the module docstring).
    The graph keeps it: requests in when admitted, out when removed; stage costs and rows after
    each stage's step; `frame_s` from the vocoder."""

    def __init__(self, ttfa_target_s: float, stream_lead_s: float):
        self.ttfa_target_s, self.stream_lead_s = ttfa_target_s, stream_lead_s
        self.frame_s: float | None = None  # seconds of audio per frame (the vocoder learns it)
        self.requests: dict[str, Request] = {}
        self.costs: dict[str, StepCost] = {}
        self.rows: dict[str, int] = {}  # per stage: playing rows its next decode step would carry
        self.batch_rows: dict[str, int] = {}  # ... and batch rows
        self.spare_s = math.inf  # this graph step's prefill time left (`begin_step`)
        self.entered = 0  # playing requests admitted since the graph step began
        self.queued = 0  # playing requests waiting for capacity (the graph's queue)
        self.pressed = False  # does any stream need the time a stream ahead would take (`begin_step`)
        self.batch_yields = False  # do batch rows skip this step (`begin_step`)
        self.batch_steps = False  # may this step carry batch rows (then it is not a playing step's sample)
        self.step_s: float | None = None  # a moving average of the graph's steps without batch rows ...
        self.step_rows = 0.0  # ... and of the most rows a stage computed in them
        self.live = LiveCapacity(self.cost, MIN_SAMPLES)  # admission by frame deadline (engine/live.py)

    # ---- per request -------------------------------------------------------------------------
    def slack(self, req: Request, now: float) -> float:
        """Seconds until the listener stalls (before the first audio: of the TTFA target left);
        inf for a batch request (no listener)."""
        if not req.playing:
            return math.inf
        if req.live:
            due = req.frame_due(len(req.frames))
            return math.inf if due is None else due - now
        if req.playback.first is None:
            return self.ttfa_target_s - (now - req.arrival)
        return req.playback.slack(now)

    def lead(self, req: Request, now: float) -> float:
        """Seconds of audio made beyond what the listener has played (-inf before its first audio)."""
        if not req.playing or req.live or req.playback.first is None or self.frame_s is None:
            return -math.inf  # a live session makes no frame before its input: it is never ahead
        return req.playback.first + len(req.frames) * self.frame_s - now

    def ahead(self, req: Request, now: float) -> bool:
        return not req.frames.final and self.lead(req, now) >= self.stream_lead_s

    def next_due(self, now: float) -> float | None:
        """When the first stream that is ahead now stops being ahead (None: none is ahead)."""
        due = [now + self.lead(r, now) - self.stream_lead_s for r in self.requests.values() if self.ahead(r, now)]
        return min(due) if due else None

    def playing(self) -> list[Request]:
        """The playing streams whose frames go on."""
        return [r for r in self.requests.values() if r.playing and not r.frames.final]

    def min_playing_slack(self, now: float) -> float:
        """The smallest slack among playing streams whose playback started (or live) and whose
        frames go on."""
        return min((self.slack(r, now) for r in self.playing() if r.live or r.playback.first is not None),
                   default=math.inf)

    def timed(self) -> list[Request]:
        """The playing streams a deadline holds now: live sessions, and replies no longer listening."""
        return [r for r in self.playing() if r.live or not r.listening]

    # ---- per stage ---------------------------------------------------------------------------
    def cost(self, stage: str) -> StepCost:
        return self.costs.setdefault(stage, StepCost())

    def decode_s(self, extra: dict[str, int] | None = None, batch: bool = False) -> float | None:
        """Predicted time of one decode step of every stage at its current playing rows (plus
        `extra`; `batch`: plus its batch rows); None while a stage with rows is not measured yet."""
        total = 0.0
        for name, rows in self.rows.items():
            rows += (extra or {}).get(name, 0) + (self.batch_rows.get(name, 0) if batch else 0)
            t = self.cost(name).predict(rows, rows) if rows else 0.0
            if t is None:
                return None
            total += t
        return total

    def begin_step(self, now: float) -> None:
        """At the start of a graph step: whether streams ahead and batch rows yield, and the
        prefill time it may spend."""
        self.entered = 0
        self.refresh(now)
        slack = self.min_playing_slack(now)
        if math.isinf(slack):
            self.spare_s = math.inf
            return
        decode = self.decode_s(batch=self.batch_steps)
        self.spare_s = 0.0 if decode is None else slack - MARGIN_S - decode  # unmeasured: the least

    def refresh(self, now: float) -> None:
        """Whether streams ahead and batch rows yield now (at a step's start, and whenever the graph
        asks whether it has work: a flag left from the last step, e.g. after the last playing stream
        ended, would hold batch rows back with nobody to wake them)."""
        self.pressed = self._pressed(now)
        self.batch_yields = self._batch_yields(now)
        self.batch_steps = not self.batch_yields and any(self.batch_rows.values())

    def _pressed(self, now: float) -> bool:
        """Does a stream need the time that streams ahead would take? A request waits for capacity,
        steps are slower than real time needs, or a stream is urgent: before its first audio, or
        with less slack than a step and the margin."""
        if self.queued > 0 or self.frame_s is not None and self.step_s is not None and self.step_s > HEADROOM * self.frame_s:
            return True
        step = self.decode_s() or 0.0
        return any(self.slack_below(r, now, step + MARGIN_S) for r in self.timed())

    def _batch_yields(self, now: float) -> bool:
        """Does a playing stream need the time batch rows would take? One (not listening) is
        before its first audio, or has less slack than BATCH_FLOOR x stream_lead_s or than a step
        carrying the batch rows and the margin (a live session: its waiting frame, less than that
        step). (Playing requests waiting for capacity do not make them yield: capacity counts
        playing rows only, and the time streams ahead leave is theirs.)"""
        playing = self.timed()
        if not playing:
            return False
        step = (self.decode_s(batch=True) or 0.0) + MARGIN_S
        floor = max(BATCH_FLOOR * self.stream_lead_s, step)  # a live frame has no buffer: only its deadline
        return any(self.slack_below(r, now, step if r.live else floor) for r in playing)

    def slack_below(self, req: Request, now: float, seconds: float) -> bool:
        if req.live:  # its waiting frame's deadline (none waiting: no hurry)
            return self.slack(req, now) < seconds
        return req.playback.first is None or req.playback.slack(now) < seconds

    # ---- live sessions -----------------------------------------------------------------------
    def observe_live(self, since: float) -> None:
        """After a graph step begun at `since`: its live frames' latency, and the live sessions in
        time within HEADROOM of a frame (`LiveCapacity`)."""
        self.live.observe(self.requests.values(), since)
        if self.frame_s is not None:
            self.live.update(HEADROOM * self.frame_s)

    def stepped(self, seconds: float, rows: int) -> None:
        """A graph step that computed something (at most `rows` rows in a stage) took `seconds`. The
        average is of the steps playing streams get when batch rows yield: a step that may carry
        batch rows (`batch_steps`) counts as its time scaled by the predicted step without them
        over the one with them, at the most playing rows of a stage (no sample while unmeasured)."""
        if self.batch_steps:
            alone, both = self.decode_s(), self.decode_s(batch=True)
            rows = max(self.rows.values(), default=0)
            if not alone or not both or not rows:
                return
            seconds *= alone / both
        if self.step_s is None:
            self.step_s, self.step_rows = seconds, float(rows)
        else:
            self.step_s, self.step_rows = 0.8 * self.step_s + 0.2 * seconds, 0.8 * self.step_rows + 0.2 * rows

    def spent(self, stage: str, tokens: int, rows: int, seconds: float) -> None:
        """A stage stepped: its cost sample, and the prefill time it took from the step's spare."""
        cost = self.cost(stage)
        if math.isfinite(self.spare_s):  # NOTE: the prediction before this sample (a fit per stage)
            self.spare_s -= max(0.0, seconds - (cost.predict(rows, rows) or 0.0))
        cost.observe(tokens, rows, seconds)


class Policy:
    """A scheduling policy's contract, with FIFO's answers: arrival order; every row with work steps;
    prefill up to the token budget; no gate."""

    name = "fifo"
    reads_table = False  # the graph keeps the table's costs, rows and steps only for a policy that reads them

    def __init__(self, table: SlackTable):
        self.table = table

    def urgency(self, req: Request, now: float) -> float | None:
        """Sort key of a row (smaller first); None: arrival order."""
        return None

    def yields(self, req: Request, now: float) -> bool:
        return False

    def prefill_tokens(self, stage: str, page: int) -> int | None:
        """The most prefill tokens this stage's step may carry (None: no cap)."""
        return None

    def admits(self, req: Request, now: float) -> bool:
        return True

    def admits_live(self, live: int) -> bool:
        """May one more live session open beside `live` (those in flight, under the engine's lock)?
        A live session is never queued: refused (Overloaded) or started at once."""
        return True

    def step_s(self, measured: float) -> float:
        """The time between two steps that a stream's first chunk must outlast, given the vocoder's
        own moving average of it (`stages.vocoder.auto_first_chunk`)."""
        return measured


class Fifo(Policy):
    """Arrival order; every row with work steps; prefill up to the token budget; no gate (the
    contract's defaults)."""

    name = "fifo"


class Slack(Policy):
    """Serve the stream closest to a stall first; streams ahead yield; prefill fits the smallest
    slack; a new request starts only when capacity covers it (module docstring)."""

    name = "slack"
    reads_table = True

    def urgency(self, req: Request, now: float) -> float | None:
        return self.table.slack(req, now) if req.playing else None  # batch: last, in arrival order

    def yields(self, req: Request, now: float) -> bool:
        if not req.playing:
            return self.table.batch_yields
        return self.table.pressed and self.table.ahead(req, now)

    def prefill_tokens(self, stage: str, page: int) -> int | None:
        spare = self.table.spare_s
        if math.isinf(spare):
            return None
        per_token = self.table.cost(stage).per_token()
        if per_token is None or spare <= 0:  # unmeasured: one page, which measures it
            return page
        return max(page, int(spare / per_token)) if per_token > 0 else None

    def step_s(self, measured: float) -> float:
        """While requests wait for capacity (the batch grows as they start, and the steps after a
        first chunk carry their prefills): the longest of the measured average, the graph's own and
        the step predicted at the rows admitted now, times LOADED_FIRST_CHUNK."""
        if not self.table.queued:
            return measured
        return LOADED_FIRST_CHUNK * max(measured, self.table.step_s or 0.0, self.table.decode_s() or 0.0)

    def admits(self, req: Request, now: float) -> bool:
        t = self.table
        if not req.playing or not t.playing():  # batch, or no stream plays: as fifo
            return True
        if t.entered >= max(1, max(t.rows.values(), default=0) // GROWTH):
            return False
        if t.frame_s is None:
            return True
        if t.step_s is not None and t.step_s > HEADROOM * t.frame_s:  # steps are slow already, whatever the model says
            return False
        step = t.decode_s({name: 1 for name in req.route})
        rows = max(t.rows.values(), default=0)
        if t.step_s is not None and t.step_rows >= 1:  # a step costs at most proportionally more rows: a
            bound = t.step_s * max(1.0, (rows + 1) / t.step_rows)  # bound on a model gone stale
            step = bound if step is None else min(step, bound)
        return step is None or step <= HEADROOM * t.frame_s

    def admits_live(self, live: int) -> bool:
        """Every live session's frames stay in time with one more row (`LiveCapacity.admits`)."""
        return self.table.live.admits(live)


POLICIES = {p.name: p for p in (Fifo, Slack)}
