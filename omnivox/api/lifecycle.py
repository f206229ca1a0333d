"""A server's life as a load balancer sees it: loading (the model) -> warming_up (CUDA graphs) ->
serving -> draining (after SIGTERM or SIGINT) -> gone.

`omnivox serve` answers HTTP before it loads the model: uvicorn runs `Front` from the start, and
the model's app (`create_app`) takes over once it is loaded and warmed up. Meanwhile
`/health/live` (liveness) answers 200 at once, `/health` and every other route a 503 `loading`
with Retry-After, `/health/ready` (readiness) 503 with its report: never a connection hanging in
the listen backlog. `/health` answers 200 once the server serves (as vLLM's and SGLang's do),
and while it drains (what runs still finishes); `/health` and `/health/live` answer 503 once the
engine has died.

Draining (`DrainingServer`): the first SIGTERM or SIGINT makes every new request and realtime
session a 503 `draining` with Retry-After (a WebSocket, `/api/chat`'s too: closed with 1013; a
realtime response asked for meanwhile: an `error` event, code `draining`), and so are requests
that wait for capacity, at once (`Engine.drain`); requests already running, realtime responses and
full-duplex `/api/chat` sessions (live conversations) go on. Once none is left, or at
--drain-timeout, when each one still running fails with `draining` (`Engine.cut`: an event stream
ends with an `error` event; an `/api/chat` session is closed with 1012) and the server waits up to
GRACE_S for them to end, uvicorn's own shutdown closes the listener and the idle connections
(realtime sessions with 1012, "service restart"; what is still open gets GRACE_S more), the engine stops
after its current step (`omnivox serve` waits at most STOP_S for it) and the process exits 0: at
most --drain-timeout + 2 x GRACE_S + STOP_S after the signal (`exit_bound`). A second signal exits
at once. Probes (/health, /health/live, /health/ready, /metrics) are answered throughout.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import uvicorn
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from omnivox.api.errors import ApiError, draining_error
from omnivox.api.guards import HostPolicy, discard_body
from omnivox.errors import Draining

PROBES = ("/health", "/health/live", "/health/ready", "/metrics")
LOADING_RETRY_S = 5
# after the drain's timeout: the wait for cut streams to send their error event, then uvicorn's
# wait for connections still open before it cancels them
GRACE_S = 2.0
STOP_S = 10.0  # then the most `omnivox serve` waits for the engine's current step to end
DRAINING = ("server draining: it is shutting down and takes no new work; retry (a load balancer sends the retry "
            "to another server)")


def exit_bound(drain_timeout: float) -> float:
    """The most seconds from SIGTERM to the exit of a server that drains (this module's doc)."""
    return drain_timeout + 2 * GRACE_S + STOP_S


class Lifecycle:
    """Where one server is in its life, what its probes answer, and why a request is refused while
    it cannot take work. `phase` is moved on by the thread that loads the model; `draining` is set
    by the first signal; everything else is read and written on the event loop."""

    def __init__(self, phase: str = "loading"):
        self.phase = phase  # "loading" | "warming_up" | "serving"
        self.draining = False
        self.error: BaseException | None = None  # why loading failed
        self.app: ASGIApp | None = None  # the model's app, once it serves
        self.requests = 0  # HTTP requests the model's app is answering, probes not counted
        self.model: Any = None  # the served model, the realtime hub and /api/chat (`attach`): what readiness
        self.realtime: Any = None  # reports and a drain waits for
        self.duplex: Any = None  # a full-duplex model's /api/chat (`moshi_chat.MoshiChat`), else None

    def attach(self, model, realtime, duplex=None) -> None:
        self.model, self.realtime, self.duplex = model, realtime, duplex

    def serve(self, app: ASGIApp) -> None:
        """The model is loaded and warm: `app` answers from now on. NOTE: the phase first, so a
        request `app` takes is never refused as loading."""
        self.phase = "serving"
        self.app = app

    def drain(self) -> None:
        """The first signal, on the event loop: requests waiting for capacity fail with 503
        `draining` now, and any submitted later (a request in a worker pool meanwhile)."""
        if self.model is not None:
            self.model.engine.drain(Draining(DRAINING))

    def cut(self, drain_timeout: float) -> None:
        """The drain's timeout: every request still running fails with `draining`; full-duplex
        sessions (live: the engine's cut leaves their open input running) are closed with 1012,
        on /v1/realtime after an `error` event."""
        if self.model is not None:
            self.model.engine.cut(Draining(f"server draining: this request was still running at the drain's "
                                           f"timeout ({drain_timeout:g} s, --drain-timeout) and is cut; retry"))
        reason = f"server restarting: the drain's timeout ({drain_timeout:g} s, --drain-timeout) passed; reconnect"
        if self.duplex is not None:
            self.duplex.cut(reason)
        if self.realtime is not None:
            self.realtime.cut(reason)  # a duplex session on /v1/realtime: an `error` (draining), then 1012

    @property
    def state(self) -> str:
        return "draining" if self.draining else self.phase

    def refusal(self, path: str) -> ApiError | None:
        """The 503 a request gets while this server takes no new work; None for probes."""
        return None if path in PROBES or self.state == "serving" else self.unavailable()

    def unavailable(self) -> ApiError:
        if self.draining:
            return draining_error(DRAINING)
        return ApiError(503, f"server starting: the model is {self.phase.replace('_', ' ')}; retry shortly "
                             "(GET /health/ready answers 200 once it serves)", code="loading",
                        headers={"Retry-After": str(LOADING_RETRY_S)})

    def report(self) -> dict:
        """GET /health/ready's body: `ready` (200) only while serving with a live engine."""
        body = {"ready": False, "state": self.state, "draining": self.draining, "running": 0, "waiting": 0,
                "kv_free_ratio": {}, "realtime_sessions": 0}
        if self.model is None or self.state == "loading":
            return body
        engine = self.model.engine
        s = engine.stats()
        body.update(ready=self.state == "serving" and engine.alive, running=s.running, waiting=s.waiting,
                    kv_free_ratio={stage: round(s.kv_pages_free[stage] / total, 4) if total else 0.0
                                   for stage, total in s.kv_pages_total.items()},
                    realtime_sessions=self.realtime.live_sessions if self.realtime is not None else 0)
        if not engine.alive:
            body["state"] = "engine stopped"
        return body

    def working(self) -> int:
        """What a drain waits for, 0 when idle: HTTP requests being answered, realtime responses
        being generated or sent and /api/chat sessions (live conversations), or the engine's
        requests if more (a realtime response just submitted; never an open realtime turn waiting
        for its user: `Engine.busy`)."""
        n = self.requests
        if self.realtime is not None:
            n += sum(1 for s in list(self.realtime.sessions.values()) if s.working)
            n += self.realtime.chat_sessions
        return max(n, self.model.engine.busy) if self.model is not None else n


async def refuse_socket(scope: Scope, receive: Receive, send: Send, error: ApiError) -> None:
    """Accept a WebSocket, then close it at once with 1013 ("try again later") and the reason, as
    the realtime hub refuses a busy server (a client reads a close reason, not an HTTP status)."""
    from omnivox.api.realtime.hub import close_reason

    if (await receive())["type"] != "websocket.connect":
        return
    offered = dict(scope["headers"]).get(b"sec-websocket-protocol", b"").decode("latin-1")
    accept = {"type": "websocket.accept"}
    if "realtime" in [p.strip() for p in offered.split(",")]:
        accept["subprotocol"] = "realtime"
    await send(accept)
    await send({"type": "websocket.close", "code": 1013, "reason": close_reason(error.message)})


class Front:
    """The ASGI app uvicorn serves from the start: the model's app once `lifecycle` serves; until
    then /health/live (200), /health/ready (503 with its report), and a 503 `loading` for
    everything else, /health included (after the Host check every route makes, `guards.HostPolicy`)."""

    def __init__(self, lifecycle: Lifecycle, hosts: HostPolicy):
        self.lifecycle, self.hosts = lifecycle, hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        app = self.lifecycle.app
        if app is not None:
            return await app(scope, receive, send)
        if scope["type"] == "websocket":
            return await refuse_socket(scope, receive, send, self.lifecycle.unavailable())
        if scope["type"] != "http":
            return
        path, error = scope["path"], self.hosts.check(dict(scope["headers"]))
        if error is None and path in ("/health", "/health/live"):  # alive, not serving yet
            body = {"status": self.lifecycle.state, "in_flight": 0, "running": 0, "waiting": 0}
            response = JSONResponse(body) if path == "/health/live" else \
                JSONResponse(body, status_code=503, headers={"Retry-After": str(LOADING_RETRY_S)})
        elif error is None and path == "/health/ready":
            response = JSONResponse(self.lifecycle.report(), status_code=503)
        else:
            error = error or self.lifecycle.unavailable()
            if not await discard_body(receive):
                error.headers = {**(error.headers or {}), "Connection": "close"}
            response = error.response()
        await response(scope, receive, send)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, stopped by a drain: the first SIGTERM or SIGINT starts draining
    `lifecycle`; each tick (0.1 s) checks whether anything is left running, and once nothing is
    (or loading failed, or GRACE_S after `drain_timeout` cut what still ran) uvicorn's own
    shutdown runs. A second signal exits at once. NOTE: uvicorn re-raises a signal it handled once
    it has shut down (exit status 143 for SIGTERM); this server records none, so a drained server
    exits 0."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, drain_timeout: float):
        super().__init__(config)
        self.lifecycle, self.drain_timeout = lifecycle, drain_timeout
        self.deadline: float | None = None
        self.cut = False  # the timeout has cut what ran: the deadline is GRACE_S on
        self.signal: int | None = None

    def handle_exit(self, sig: int, frame) -> None:  # a signal handler: flags and one raw write, no print
        if self.signal is not None:
            os.write(2, b"omnivox serve: a second signal: exiting now, cutting what still runs\n")
            os._exit(128 + sig)
        self.signal = sig
        self.lifecycle.draining = True

    async def on_tick(self, counter: int) -> bool:
        life = self.lifecycle
        if life.error is not None:
            self.should_exit = True
        elif self.signal is not None and not self.should_exit:
            left = life.working()
            if self.deadline is None:
                self.deadline = time.monotonic() + self.drain_timeout
                life.drain()
                self._say(f"{signal.Signals(self.signal).name}: draining, {left} request(s) running; exiting when "
                          f"they finish or in {self.drain_timeout:g} s (--drain-timeout; a second signal exits now)")
            if left == 0 or (self.cut and time.monotonic() >= self.deadline):
                self.should_exit = True
            elif time.monotonic() >= self.deadline:
                self._say(f"drain timeout: {left} request(s) still running are cut (an event stream ends with an "
                          "`error` event, code draining)")
                life.cut(self.drain_timeout)
                self.cut, self.deadline = True, time.monotonic() + GRACE_S
        return await super().on_tick(counter)

    @staticmethod
    def _say(text: str) -> None:
        print(f"omnivox serve: {text}", file=sys.stderr, flush=True)
