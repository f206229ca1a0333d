"""The engine: one background thread stepping a model's stage graph (`engine.graph.StageGraph`).

Request lifecycle:
0. The caller builds a typed request on its own thread (`stages.new_request`: the family's
   factory validates it there; an invalid one raises its error to the caller).
1. `submit` checks capacity, creates a `RequestHandle` and queues the request.
2. At the start of the next step the engine admits it to every stage of its route (a stage
   may refuse it: it alone fails, e.g. 413 when it could never fit the KV cache).
3. Every step runs `stages.step()`: one batched step of each stage with work; stages push
   events (text deltas, audio chunks) to the handle as they happen.
4. When every stage is done with it, the request's pages and state are freed and a final
   `Finished` event is pushed. `abort` does the same within one step, with reason "abort".

Draining (a server's SIGTERM): `drain` fails every request that has not started (nothing sent to
its caller yet: it waits for capacity or for its first stage) and every later one with the
server's 503 `draining`, while running requests go on; `cut`, at the drain's timeout, fails what
still runs. Realtime turns still listening to their user are left to their sessions.

One owner of each device: only the engine thread, and the loops it starts for stages on other
devices (engine/graph.py: they step while it waits), run model code. A realtime turn's audio is a
stage on its request's route (`stages/encoder.py`): the API appends host audio to the request's
prompt stream and never waits. Work outside any request (an S2 reference's codec encoding) is
submitted to `engine.encoder` (engine/off_route.py) from any thread; the engine thread steps it
before the request stages and the caller waits for its result. So nothing launches kernels while a
step runs or a CUDA graph is captured.
"""
from __future__ import annotations

import asyncio
import atexit
import functools
import threading
import traceback
import weakref
from dataclasses import replace

from omnivox.engine.config import EngineConfig
from omnivox.engine.events import EngineStats, Failed, Finished
from omnivox.engine.graph import StageGraph
from omnivox.engine.handle import RequestHandle
from omnivox.engine.prompt import PromptStream
from omnivox.engine.request import Request
from omnivox.errors import (Draining, EngineFailed, InputError, OmnivoxError, Overloaded, code_of, message_of,
                            status_of)
from omnivox.engine.off_route import OffRouteQueue

__all__ = ["Engine", "Overloaded"]


class EngineFailure(OmnivoxError):
    """The engine could not go on with a request (shut down, or a bug in a step)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def _shutdown_at_exit(ref: "weakref.ref[Engine]") -> None:
    engine = ref()
    if engine is not None:
        engine.shutdown()


class Engine:
    def __init__(self, stages: StageGraph, config: EngineConfig):
        self.stages, self.config = stages, config
        stages.set_scheduling(config.scheduling, config.stream_lead_s, config.ttfa_target_s)
        stages.set_loops(config.stage_loops)
        self._lock = threading.Condition()
        self._incoming: list = []
        self._aborts: set[str] = set()
        self._handles: dict[str, RequestHandle] = {}
        self._streams: dict[str, PromptStream] = {}  # rid -> its prompt stream (a realtime turn), while in flight
        self._live: set[str] = set()  # live requests (duplex sessions) in flight: `submit`'s admission counts them
        self._stop = False
        self._broken: EngineFailed | None = None  # `break_down`: every request fails with it, the loop stops
        self._refusal: Draining | None = None  # `drain`: what requests that have not started fail with
        self._cutting: Draining | None = None  # `cut`: what every running request fails with, next step
        self._sweep = False  # `drain` was called: fail what waits at the next step, even with no other work
        self._thread = threading.Thread(target=self._loop, name="omnivox-engine", daemon=True)
        self.encoder = OffRouteQueue(wake=self.wake, owner=self._thread)  # model work outside requests (S2 references)
        self._stats = EngineStats()
        self._publish_stats(finished=0)  # gauges exist before the first request
        self._thread.start()
        # NOTE: a script that exits without shutdown() would leave the thread inside torch while the
        # interpreter finalizes, which aborts ("terminate called without an active exception")
        self._at_exit = functools.partial(_shutdown_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)

    # ---- public API (any thread) ----------------------------------------------------------
    def submit(self, req: Request, *, loop: asyncio.AbstractEventLoop | None = None,
               limit: int | None = None) -> RequestHandle:
        """Queue a typed request (built by `stages.new_request`, validated there) and return its
        handle; raises only what the engine's state decides (shut down, overloaded, a request id
        in use). `loop`: the caller's asyncio loop, for `async for` over the handle. `limit`: also
        refuse (Overloaded) when that many requests are in flight, open streams included (a
        duplex session's input is open for its whole life, so `busy` never counts it). A live
        request (`Request.live`, a duplex session) is also refused unless the scheduling policy
        admits one more beside the live requests in flight (`Policy.admits_live`: under slack,
        while every running session still gets its frames in time), decided here, atomically with
        its submission: a live session is never queued."""
        rid = req.rid
        with self._lock:
            if self._broken is not None:
                raise self._broken
            if self._stop:
                raise Overloaded("the engine is shutting down")
            over = self.overload()
            if over is not None:
                raise over
            if limit is not None and len(self._handles) >= limit:
                raise Overloaded(f"server busy: {len(self._handles)} sessions in flight, the most it runs at once ({limit})")
            if rid in self._handles:
                raise InputError(f"request id {rid!r} is already in use")
            if req.live and not self.stages.scheduling.admits_live(len(self._live)):
                raise Overloaded(f"server busy: {len(self._live)} live sessions take what the engine makes in real "
                                 f"time; one more would make their frames late")
            handle = RequestHandle(rid, self.abort, loop)
            self._handles[rid] = handle
            if req.live:
                self._live.add(rid)
            req.push = self._pusher(rid, handle)
            if req.stream is not None:
                self._streams[rid] = req.stream
            self._incoming.append(req)
            self._lock.notify()
        return handle

    def wake(self) -> None:
        """New input for a running request (a streamed prompt grew): step soon."""
        with self._lock:
            self._lock.notify()

    def break_down(self, error: EngineFailed) -> None:
        """The engine can compute no more (any thread; e.g. a tensor-parallel rank died): every
        request fails with `error` (503 `engine_failed`) and the loop stops (`alive` turns False)."""
        with self._lock:
            if self._broken is None:
                self._broken = error
            self._lock.notify()

    def drain(self, error: Draining) -> None:
        """Take no more work (any thread): from the next step, every request that has not started
        and every one submitted later fails with `error`; running requests go on."""
        with self._lock:
            self._refusal, self._sweep = error, True
            self._lock.notify()

    def cut(self, error: Draining) -> None:
        """The end of a drain (any thread): every request still running fails with `error` within a
        step, so a stream ends with an error event instead of a cut connection."""
        with self._lock:
            self._refusal = self._refusal or error
            self._cutting = error
            self._lock.notify()

    @property
    def draining(self) -> bool:
        """Whether `drain` was called: the engine takes no new work."""
        return self._refusal is not None

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._handles:
                self._aborts.add(request_id)
                self._lock.notify()

    def stats(self) -> EngineStats:
        with self._lock:
            s = replace(self._stats, stages=dict(self._stats.stages), kv_pages_total=dict(self._stats.kv_pages_total),
                        kv_pages_free=dict(self._stats.kv_pages_free),
                        running_by_kind=dict(self._stats.running_by_kind),
                        waiting_by_kind=dict(self._stats.waiting_by_kind))
            s.in_flight = len(self._handles)
            return s

    def shutdown(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()
        self._thread.join(timeout=10)
        atexit.unregister(self._at_exit)

    @property
    def busy(self) -> int:
        """What admission counts against max_running + max_queue: requests in flight, less those
        whose streamed prompt is still open (a realtime turn waiting for the user: it answers,
        and counts, once its stream closes)."""
        with self._lock:
            return len(self._handles) - sum(1 for s in self._streams.values() if not s.closed)

    def overload(self) -> Overloaded | None:
        """The capacity rule, the one place it is written: an Overloaded to raise when the requests
        admission counts (`busy`) fill max_running + max_queue, else None. `submit` applies it
        under its lock (NOTE: a reentrant lock: `busy` takes it again); a route asks first, to
        refuse cheaply before it decodes any media."""
        with self._lock:
            busy, cfg = self.busy, self.config
            if busy < cfg.max_running + cfg.max_queue:
                return None
            return Overloaded(f"server busy: {busy} requests in flight "
                              f"(max_running {cfg.max_running} + max_queue {cfg.max_queue})")

    @property
    def alive(self) -> bool:
        """False once the engine thread has stopped (shut down or died)."""
        return self._thread.is_alive()

    # ---- the loop (engine thread) -----------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._stop or self._broken or self._incoming or self._aborts or self._sweep
                           or self._cutting or self.encoder.has_work() or self.stages.has_work()):
                    self._lock.wait(timeout=self._idle_wait())
                if self._stop or self._broken:
                    break
                incoming, self._incoming = self._incoming, []
                aborts, self._aborts = self._aborts, set()
                refusal, cutting, self._cutting, self._sweep = self._refusal, self._cutting, None, False
            try:
                self.encoder.step()
                if refusal is not None:
                    incoming = self._refuse(incoming, refusal, cutting)
                self._iterate(incoming, aborts)
            except EngineFailed as e:  # for good: the loop ends after failing everything below
                self.break_down(e)
            except Exception:  # a bug must not kill the engine: fail what was running, go on
                traceback.print_exc()
                self._fail_all(EngineFailure("internal error in an engine step; see the server log", 500))
        with self._lock:
            self._stop = True  # also when broken down: nothing may queue for a loop that has ended
            incoming, self._incoming = self._incoming, []
        ending = self._broken or EngineFailure("the engine shut down", 503)
        self.encoder.close(self._broken or Overloaded("the engine is shutting down"))
        for req in incoming:  # NOTE: never leave a caller waiting on a handle nobody will fill
            self._forget(req.rid)
            req.fail(message_of(ending), status_of(ending), code_of(ending))
        self._fail_all(ending)
        self.stages.close()

    def _idle_wait(self) -> float:
        """How long the loop may sleep with no work: until a yielding stream is due, at most 0.5 s."""
        due = self.stages.next_due()
        return 0.5 if due is None else min(0.5, max(0.001, due - self.stages.clock.now()))

    def _iterate(self, incoming: list, aborts: set[str]) -> None:
        """Admit, abort, then one step of every stage with work; publish what finished."""
        for req in incoming:
            self._admit(req)
        for rid in aborts:
            self._abort_now(rid)
        done = self.stages.step()
        # stats first, so a caller that sees Finished also sees its pages freed
        self._publish_stats(finished=len(done))
        for req in done:
            self._forget(req.rid)  # likewise: no longer in flight once Finished is seen
            req.finish()

    def _refuse(self, incoming: list, refusal: Draining, cutting: Draining | None) -> list:
        """Draining: fail what has not started (new requests, and those waiting with nothing sent
        to their caller) with `refusal`, or with `cutting` everything but listening turns; returns
        the incoming requests still to admit (realtime turns whose user speaks)."""
        for req in incoming:
            if not req.listening:
                self._forget(req.rid)
                req.fail(message_of(refusal), status_of(refusal), code_of(refusal))
        if cutting is not None:
            self._fail_all(cutting, [r for r in self.stages.active.values() if not r.listening])
        else:
            self._fail_all(refusal, [r for r in self.stages.active.values()
                                     if not (r.started or r.listening) and self.stages.is_waiting(r)])
        return [req for req in incoming if req.listening]

    def _fail_all(self, error: OmnivoxError, failed: list | None = None) -> None:
        """Free every request (or those `failed`), publish the gauges, then fail them: a client
        that sees its error sees the pages it held free."""
        if failed is None:
            failed = list(self.stages.active.values())
        elif not failed:
            return
        for req in failed:
            self._forget(req.rid)
            self.stages.remove(req)
        self._publish_stats(finished=0)
        for req in failed:
            req.fail(message_of(error), status_of(error), code_of(error))

    def _admit(self, req) -> None:
        try:
            # a realtime turn is admitted at once: it listens while its user speaks (it counts
            # against capacity once it speaks)
            self.stages.admit(req, gate=req.stream is None)
        except Exception as e:  # this request only, with its error's status (413 CannotFit, 400, ...)
            self._forget(req.rid)
            self.stages.fail(req, e)

    def _abort_now(self, rid: str) -> None:
        req = self.stages.active.get(rid)
        if req is not None:
            self.stages.remove(req)
            self._stats.aborted += 1
            self._publish_stats(finished=0)  # before the event: its pages are already free
        self._forget(rid)
        if req is not None:
            req.finish("abort")

    def _pusher(self, rid: str, handle: RequestHandle):
        """The push function a request's stages use: a final event (Finished or Failed), from
        wherever it comes, first takes the request out of flight, then reaches the caller."""
        def push(ev) -> None:
            if isinstance(ev, (Finished, Failed)):
                self._forget(rid)
            handle.push(ev)
        return push

    def _forget(self, rid: str) -> None:
        with self._lock:
            self._handles.pop(rid, None)
            self._streams.pop(rid, None)
            self._live.discard(rid)

    def _publish_stats(self, finished: int) -> None:
        s = EngineStats(finished=self._stats.finished + finished, aborted=self._stats.aborted)
        self.stages.fill_stats(s)
        s.stages.update(self.encoder.stats())
        with self._lock:
            self._stats = s
