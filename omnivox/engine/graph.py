"""A model's stage graph as the engine drives it: named stages in step order, and the requests
in flight through them. Each request's `route` names the stages it passes; it is admitted to
all of them at once (a stage holds it without work until its inputs exist) and finishes when
every stage on its route is done with it.

`step()` is the engine's per-step entry point: one batched step of every stage with work, in
order, so a token sampled by the Thinker reaches the Talker and a frame the vocoder within the
same step. A request fails in exactly one way, `fail`: every stage forgets it, then its caller
gets `Failed` with the error's status; no other request is touched.

Loops (`set_loops`, engine/placement.py): the stages of each device step in their own thread, all
devices at once, joined before `step` returns; admission, aborts and failures stay on the caller's
thread, between steps, so the typed per-request streams (voiced text, frames) are the only state
two loops share. One loop (one device) steps the stages in order, as above.

Scheduling (`set_scheduling`): under `slack` the graph keeps the slack table its stages' policy reads
(`engine/slack.py`): the requests in flight, each stage's step time against the rows and tokens it
computed (measured on the graph's clock), the rows of each kind (playing, batch) each stage's next
step would carry. Under `slack`, a new playing request waits in `queued` (admitted to no stage)
until the policy admits it; a batch request is never queued (it yields its steps instead).
"""
from __future__ import annotations

import contextlib
import itertools
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor, wait
import torch

from omnivox.engine.clock import Clock
from omnivox.engine.events import EngineStats
from omnivox.engine.placement import loop_groups
from omnivox.engine.request import Request, RequestFactory
from omnivox.engine.slack import POLICIES, Policy, SlackTable
from omnivox.engine.stage import Failures, Stage
from omnivox.errors import OmnivoxError, code_of, message_of, status_of


def on_device(device: torch.device):
    """Run a stage's work under its CUDA device (kernels, graph capture and replay); a no-op elsewhere."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class StageGraph:
    def __init__(self, stages: list[Stage], requests: RequestFactory):
        self.stages = {s.name: s for s in stages}
        self.order = [s.name for s in stages]
        self.requests = requests
        self._arrivals = itertools.count()  # NOTE: next() on a count is atomic: any thread may draw
        vocoder = self.stages.get("vocoder")
        self.sample_rate: int = vocoder.adapter.sample_rate if vocoder is not None else 0
        self.active: dict[str, Request] = {}
        self.queued: list[Request] = []  # waiting for capacity: in `active`, in no stage yet
        self.set_clock(Clock())
        self.set_scheduling("fifo")
        self._threads: ThreadPoolExecutor | None = None
        self.set_loops("device")

    def set_clock(self, clock: Clock) -> None:
        """The one clock the stages and new requests read (tests: a `ManualClock`)."""
        self.clock = clock
        for stage in self.stages.values():
            stage.clock = clock

    def set_scheduling(self, policy: str, stream_lead_s: float = 1.0, ttfa_target_s: float = 1.0) -> None:
        """The policy every stage applies (`fifo` | `slack`), over one new slack table."""
        if policy not in POLICIES:
            raise ValueError(f"scheduling must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.table = SlackTable(ttfa_target_s, stream_lead_s)
        self.table.requests = {r.rid: r for r in self.active.values() if r not in self.queued}
        self.scheduling: Policy = POLICIES[policy](self.table)
        for stage in self.stages.values():
            stage.scheduling = self.scheduling

    def set_loops(self, spec: str) -> None:
        """Which stages step in which thread: "device" (a loop per device), "one", or an explicit
        split such as "thinker,talker+vocoder" (`placement.loop_groups`). A stage that passes its
        input on (`Stage.passes_input`: the encoder) is never named: it steps first in the loop of
        a stage on its device."""
        computing = [n for n in self.order if not self.stages[n].passes_input]
        self.loops = [list(self.order)] if spec == "one" else \
            loop_groups(spec, {name: self.stages[name].device for name in computing})
        for name in reversed([n for n in self.order if n not in computing and spec != "one"]):
            # a stage that only feeds the next (the encoder) steps first in that stage's loop on its device
            dev = self.stages[name].device
            loop = next((g for g in self.loops if self.stages[g[0]].device == dev), None)
            loop.insert(0, name) if loop is not None else self.loops.insert(0, [name])
        self.close()
        if len(self.loops) > 1:
            self._threads = ThreadPoolExecutor(len(self.loops) - 1, thread_name_prefix="omnivox-loop")

    def close(self) -> None:
        """Stop the loop threads (the engine's end)."""
        if self._threads is not None:
            self._threads.shutdown(wait=True)
            self._threads = None

    def new_request(self, prompt, options, *, request_id: str | None = None, **family) -> Request:
        """The family's typed request for `prompt` and `options` (its route set), built and
        validated on the caller's thread by the family's factory: raises its error (InputError: a
        400) for one the family cannot serve. Not queued: hand it to `Engine.submit`. `family`:
        the factory's own keywords (Qwen: `hook`, `stream`)."""
        return self.requests(prompt, options, rid=request_id or uuid.uuid4().hex, order=next(self._arrivals),
                             clock=self.clock, sample_rate=self.sample_rate, **family)

    def admit(self, req: Request, gate: bool = True) -> None:
        """Admit to every stage of the route, or queue it for capacity (`gate`: the policy decides;
        False: never queued, e.g. a realtime turn whose user still speaks); raises (the request is
        then not in flight)."""
        self.active[req.rid] = req
        if gate and req.playing and (self.queued or not self.scheduling.admits(req, self.clock.now())):
            self.queued.append(req)
            return
        self._enter(req)

    def _enter(self, req: Request) -> None:
        try:
            for name in req.route:
                self.stages[name].admit(req)
        except BaseException:
            self.remove(req)
            raise
        self.table.requests[req.rid] = req
        self.table.entered += req.playing
        if req.live:
            self.table.live.route = req.route
        if self.scheduling.reads_table:
            for name in req.route:  # until the next step counts them
                self._count_rows(name)

    def _count_rows(self, name: str) -> None:
        stage = self.stages[name]
        self.table.rows[name], self.table.batch_rows[name] = stage.running_rows(True), stage.running_rows(False)

    def _admit_queued(self) -> None:
        """Start queued requests, in order, while the policy admits the next one."""
        while self.queued and self.scheduling.admits(self.queued[0], self.clock.now()):
            req = self.queued.pop(0)
            try:
                self._enter(req)
            except Exception as e:  # this request only (413 CannotFit, 400, ...)
                self.fail(req, e)

    def has_work(self) -> bool:
        if self.scheduling.reads_table:
            self.table.refresh(self.clock.now())
        return (any(s.has_work() for s in self.stages.values())
                or bool(self.queued) and self.scheduling.admits(self.queued[0], self.clock.now()))

    def next_due(self) -> float | None:
        """When a stream that yields now will have work again (None: none yields)."""
        return self.table.next_due(self.clock.now()) if self.scheduling.reads_table else None

    def step(self) -> list[Request]:
        """One step of every stage with work; returns the requests that finished (removed already)."""
        measure = self.scheduling.reads_table  # fifo decides nothing from the table: no bookkeeping
        if measure:
            self.table.queued = len(self.queued)
            began = self.clock.now()
            self.table.begin_step(began)
            self._admit_queued()
        if self._threads is None:  # one loop: a stage's failures settle before the next stage steps
            stepped = self._run_loop(self.order, measure, settle=True)
        else:
            stepped = self._run_loops(measure)
            for name, failures, seconds in stepped:
                self._settle(name, failures, seconds, measure)
        if measure:  # the most rows a stage computed
            computed = max((self.stages[name].last_step[1] for name, _, s in stepped if s is not None), default=0)
            if computed:
                self.table.stepped(self.clock.now() - began, computed)
            self.table.observe_live(began)
        done = [r for r in self.active.values()
                if not r.done and r not in self.queued and all(self.stages[n].done(r) for n in r.route)]
        for req in done:
            self.remove(req)
        return done

    def _run_loop(self, names: list[str], measure: bool, settle: bool) -> list[tuple[str, Failures, float | None]]:
        """Step `names` in order: (name, failures, seconds or None when it had no work) each;
        `settle`: apply each stage's failures before the next steps (on the graph's thread only)."""
        out = []
        for name in names:
            stage, seconds, failures = self.stages[name], None, []
            if stage.has_work():
                start = self.clock.now() if measure else 0.0
                with on_device(stage.device):
                    failures = stage.step()
                seconds = self.clock.now() - start if measure else 0.0
            if settle:
                self._settle(name, failures, seconds, measure)
            out.append((name, failures, seconds))
        return out

    def _run_loops(self, measure: bool) -> list[tuple[str, Failures, float | None]]:
        """Every loop at once (the first on this thread), joined; a loop's exception is raised
        once all have stopped, so no loop still steps when the caller handles it."""
        futures = [self._threads.submit(self._run_loop, names, measure, False) for names in self.loops[1:]]
        try:
            first = self._run_loop(self.loops[0], measure, settle=False)
        finally:
            wait(futures)
        ran = {name: item for part in [first] + [f.result() for f in futures] for name, *item in part}
        return [(name, *ran[name]) for name in self.order]

    def _settle(self, name: str, failures: Failures, seconds: float | None, measure: bool) -> None:
        stage = self.stages[name]
        if measure and seconds is not None:
            self.table.spent(name, *stage.last_step, seconds)
        for req, error in failures:
            self.fail(req, error)
        if measure:
            self._count_rows(name)

    def fail(self, req: Request, error: BaseException) -> None:
        """The one way a request fails: freed everywhere, then `Failed` with the error's status."""
        if not isinstance(error, OmnivoxError):
            traceback.print_exception(error)
        self.remove(req)
        req.fail(message_of(error), status_of(error), code_of(error))

    def remove(self, req: Request) -> None:
        """Free every stage's pages and state of a request (finished, failed or aborted)."""
        for name in req.route:
            self.stages[name].remove(req)
        self.active.pop(req.rid, None)
        self.table.requests.pop(req.rid, None)
        if req in self.queued:
            self.queued.remove(req)

    def warmup(self) -> str | None:
        """Capture every stage's CUDA graphs now (at start-up); a line saying what it cost, or
        None when no stage uses graphs."""
        import time

        import torch
        cuda = torch.cuda.is_available()
        # wall time for the log line, not a decision: not the graph's clock
        before, start = (torch.cuda.memory_allocated() if cuda else 0), time.perf_counter()
        captured = {}
        for name, stage in self.stages.items():
            with on_device(stage.device):
                if n := stage.warmup():
                    captured[name] = n
        if not captured:
            return None
        mem = ((torch.cuda.memory_allocated() - before) / 2**20) if cuda else 0.0
        return (f"cuda graphs: {sum(captured.values())} captured for {', '.join(captured)} in "
                f"{time.perf_counter() - start:.1f} s, {mem:.0f} MiB")

    def fill_stats(self, s: EngineStats) -> None:
        for stage in self.stages.values():
            s.stages.update(stage.stats())
            kv = stage.kv_stats()
            if kv is not None:
                s.kv_pages_total[stage.name], s.kv_pages_free[stage.name] = kv.pages_total, kv.pages_free
                s.preemptions += kv.preemptions
                s.prefix_hit_tokens += kv.prefix_hit_tokens
        s.running_by_kind, s.waiting_by_kind = {"playing": 0, "batch": 0}, {"playing": 0, "batch": 0}
        for r in self.active.values():
            (s.waiting_by_kind if self.is_waiting(r) else s.running_by_kind)[r.kind] += 1
        s.waiting, s.running = sum(s.waiting_by_kind.values()), sum(s.running_by_kind.values())
        s.waiting_capacity = len(self.queued)
        s.live_capacity = self.table.live.capacity if self.scheduling.reads_table else None

    def is_waiting(self, req: Request) -> bool:
        """Not running yet: queued for capacity, or waiting in its first stage that computes more than
        its input (for a slot or pages)."""
        first = next((n for n in req.route if not self.stages[n].passes_input), None)
        return req in self.queued or first is not None and self.stages[first].is_waiting(req)
