"""The ingress deployment: every HTTP route, `/v1/realtime` and `/api/chat` of `omnivox serve`, with no model.
Each request is forwarded whole (method, path, query, headers, body) to an engine replica
(`engine.EngineReplica`) chosen by the router (`routing.choose`), whose own app answers it; the
response streams back as the replica sends it. So validation, errors and limits are the replica's,
the same code as `omnivox serve`; and before the ingress reads a body it makes `omnivox serve`'s
own checks (`guards.RequestGuard`: Host, draining, API key, Origin, Content-Type, Content-Length
against --max-body-mb, room in --max-pending-body-mb), then reads it within --body-timeout (408)
and --max-body-mb (413), with the same status codes and error bodies.
NOTE: a refused body is left unread: Serve's proxy (uvicorn) drops what the client still sends
once the answer is out; reading it to the end, as `omnivox serve` does, would only let more in.

- chat completions and speech carry a `prefix_digest` (`digest.request_digest`: a
  conversation's head, or its session key: `user`, `x-omnivox-session`); a request header
  `x-omnivox-replica: ID` sends a request to that replica (e.g. its /metrics).
- `/health`, `/health/live` and `/health/ready` are one replica's answer (any ready replica: 200),
  or 503 when no replica answers within `PROBE_TIMEOUT_S`; while the ingress drains, /health/ready
  is its own 503 (/health still 200: what runs finishes).
- a replica failing mid-response: an event stream ends with an `error` event (code
  `replica_failed`), any other body is cut; before the response starts: a 502.
- `/v1/realtime` and `/api/chat` (a full-duplex model's, binary messages): one function forwards
  both (`Sessions`): the WebSocket is accepted as the replica's app accepts it; one streaming call
  (`ws_open`) carries what the app sends (its close code and reason too), each client message is
  a call (`ws_send`), all pinned to one replica by `session_id`. A replica failing mid-session:
  close 1011 (a realtime session gets an `error` event first); the client going away: `ws_close`.
- drain (`drain`, `working`, `close_sessions`: the launcher's, on SIGTERM or SIGINT), as `omnivox
  serve` drains (api/lifecycle.py): new requests get its 503 `draining`, new sessions close with
  1013, /health/ready answers 503; running requests, realtime responses and `/api/chat` sessions
  go on (within --drain-timeout); then the open sessions close with 1012 ("service restart").
"""

# NOTE: no `from __future__ import annotations`: FastAPI must see the real Request/WebSocket types
# through the signatures Serve rewrites
import argparse
import asyncio
import uuid

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayError
from ray.serve.handle import DeploymentHandle
from starlette.requests import ClientDisconnect
from starlette.websockets import WebSocketDisconnect

from omnivox.api.errors import ApiError, error_body
from omnivox.api.guards import BodyBudget, HostPolicy, RequestGuard
from omnivox.api.lifecycle import Lifecycle
from omnivox.api.realtime.hub import close_reason
from omnivox.api.realtime.protocol import error_event
from omnivox.api.streaming import sse
from omnivox.api.timeouts import deadline_receive
from omnivox.replicas.bridge import REPLICA_HEADER, plain_scope
from omnivox.replicas.digest import SESSION_HEADER, request_digest

PROBES = ("/health", "/health/live", "/health/ready")
PROBE_TIMEOUT_S = 5.0
METHODS = ["GET", "POST", "DELETE", "PUT", "PATCH", "HEAD", "OPTIONS"]

app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
app.router.redirect_slashes = False


def replica_failed(e: Exception) -> str:
    return f"the engine replica serving this request failed ({type(e).__name__}); retry (another replica takes it)"


class Forwarded(StreamingResponse):
    """A replica's response streaming back to the client. However it ends (all sent, cut, or the
    client gone, even before its body started: Starlette then never iterates the body), the
    replica's call is cancelled unless it finished and `on_end` runs once."""

    def __init__(self, reply, start: dict, on_end):
        super().__init__(self._chunks(), status_code=start["status"])
        self.raw_headers = start["headers"]
        self.reply, self.on_end, self.finished = reply, on_end, False
        self.event_stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                for k, v in start["headers"])

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.finished:
                self.reply.cancel()  # the replica's app sees its client go (`bridge.http_exchange`)
            self.on_end()

    async def _chunks(self):
        try:
            async for chunk in self.reply:
                yield chunk
        except (ActorDiedError, ActorUnavailableError) as e:
            if not self.event_stream:
                raise  # the body is cut: the client's read fails
            yield sse(error_body(502, replica_failed(e), code="replica_failed"))
        # any other failure (the replica's app cut its own response) propagates: the body is cut
        self.finished = True


class Sessions:
    """The WebSocket sessions of the ingress, `/v1/realtime` and `/api/chat` (a full-duplex model's,
    moshi's binary protocol) alike: each is accepted as the replica's app accepts it and forwarded
    whole to one engine replica, pinned by a session id (`engine.options(session_id=...)`): one
    streaming call (`ws_open`) carries what the app sends (text or binary messages, then its close
    code and reason), each client message is a call (`ws_send`), the client going away `ws_close`.
    A replica failing mid-session: an `error` event, then close 1011. What a drain waits for
    (`busy`): a realtime session while its response runs (from its server events), an `/api/chat`
    session for as long as it lasts (a live conversation). `engine`: the replicas' handle."""

    def __init__(self, engine, lifecycle: Lifecycle):
        self.engine, self.lifecycle = engine, lifecycle
        self.sockets: dict[str, WebSocket] = {}  # open sessions
        self.busy: set[str] = set()  # ... whose work a drain waits for

    async def forward(self, ws: WebSocket) -> None:
        if self.lifecycle.draining:
            offered = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",")]
            await ws.accept(subprotocol="realtime" if "realtime" in offered else None)
            return await ws.close(1013, close_reason(self.lifecycle.unavailable().message))
        session = uuid.uuid4().hex
        pinned = self.engine.options(session_id=session)
        events = pinned.options(stream=True).ws_open.remote(session, plain_scope(ws.scope))
        try:
            first = await events.__anext__()
        except RayError as e:
            await ws.accept()
            return await self._fail(ws, e)
        if first["type"] != "websocket.accept":
            return await ws.close(first.get("code", 1000), first.get("reason", ""))
        await ws.accept(subprotocol=first.get("subprotocol"), headers=first.get("headers"))
        self.sockets[session] = ws
        if ws.scope["path"] == "/api/chat":
            self.busy.add(session)
        down = asyncio.create_task(self._down(ws, events, session))
        up = asyncio.create_task(self._up(ws, pinned, session))
        try:
            await asyncio.wait({down, up}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (down, up):
                task.cancel()
            await asyncio.gather(down, up, return_exceptions=True)
            self.sockets.pop(session, None)
            self.busy.discard(session)

    async def close_all(self, reason: str) -> None:
        """The end of a drain: every open session closes with 1012, "service restart"."""
        for ws in list(self.sockets.values()):
            try:
                await ws.close(1012, close_reason(reason))
            except (RuntimeError, OSError):
                pass

    async def _down(self, ws: WebSocket, events, session: str) -> None:
        """The replica's messages to the client, until the replica's app closes the socket."""
        try:
            async for msg in events:
                self._track(session, msg.get("text"))
                await ws.send(msg)
                if msg["type"] == "websocket.close":
                    return
        except RayError as e:
            await self._fail(ws, e)

    def _track(self, session: str, text: str | None) -> None:
        """Whether a realtime session's response runs, from its server events.
        NOTE: an event's JSON starts with its type (`RealtimeSession.send`): no parse of audio deltas."""
        if text is None:
            return
        if text.startswith('{"type": "response.created"'):
            self.busy.add(session)
        elif text.startswith('{"type": "response.done"'):
            self.busy.discard(session)

    @staticmethod
    async def _up(ws: WebSocket, pinned: DeploymentHandle, session: str) -> None:
        """The client's messages to the replica, until the client goes away."""
        try:
            while True:
                msg = await ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                if not await pinned.ws_send.remote(session, {k: msg.get(k) for k in ("type", "text", "bytes")}):
                    return
        except (WebSocketDisconnect, RuntimeError):
            pass
        try:
            await pinned.ws_close.remote(session)
        except RayError:
            pass  # the replica is gone, and its session with it

    @staticmethod
    async def _fail(ws: WebSocket, e: Exception) -> None:
        try:
            if ws.scope["path"] == "/v1/realtime":  # moshi's protocol has no error message
                await ws.send_json(error_event(replica_failed(e), code="replica_failed", kind="server_error"))
            await ws.close(1011, close_reason("engine replica failed"))
        except (RuntimeError, OSError):
            pass


@serve.ingress(app)
class Ingress:
    def __init__(self, engine: DeploymentHandle, args: argparse.Namespace, api_key: str | None):
        self.engine = engine
        self.lifecycle = Lifecycle()  # no model: its drain state and refusals, the same as `omnivox serve`'s
        self.lifecycle.phase = "serving"
        limit = int(args.max_body_mb * 2**20)
        pending = int(args.max_pending_body_mb * 2**20) if args.max_pending_body_mb is not None else 4 * limit
        self.guard = RequestGuard(api_key=api_key, max_body_bytes=limit, hosts=HostPolicy.from_flags(args),
                                  bodies=BodyBudget(pending), lifecycle=self.lifecycle)
        self.body_timeout = args.body_timeout
        self.requests = 0  # HTTP requests being answered
        self.sessions = Sessions(engine, self.lifecycle)  # WebSocket sessions

    # ---- drain (the launcher's calls) -----------------------------------------------------------
    async def drain(self) -> None:
        self.lifecycle.draining = True

    async def working(self) -> int:
        """What the drain waits for: requests being answered, realtime responses being generated,
        `/api/chat` sessions."""
        return self.requests + len(self.sessions.busy)

    async def close_sessions(self) -> None:
        """The end of a drain: every open session closes with 1012, "service restart"."""
        await self.sessions.close_all("server restarting")

    # ---- HTTP -------------------------------------------------------------------------------------
    @app.api_route("/{path:path}", methods=METHODS)
    async def forward(self, request: Request):
        scope = plain_scope(request.scope)
        if self.lifecycle.draining and scope["path"] == "/health/ready":
            return JSONResponse(self.lifecycle.report(), status_code=503)
        refusal, reserved = self.guard.admit(request.scope)  # Host, draining, API key, ..., pending bodies
        if refusal is not None:
            return refusal.response()  # the body unread (NOTE above)
        self.requests += 1
        try:
            response = await self._forward(request, scope)
        except BaseException:
            self.requests -= 1
            raise
        finally:
            self.guard.bodies.release(reserved)  # the replica holds the body now (or nobody does)
        if not isinstance(response, Forwarded):
            self.requests -= 1
        return response

    def _answered(self) -> None:
        self.requests -= 1

    async def _forward(self, request: Request, scope: dict):
        try:
            body = await self._body(request)
        except ApiError as e:  # 408 past --body-timeout, 413 past --max-body-mb
            return e.response()
        except ClientDisconnect:
            return Response(status_code=499)  # nobody reads it, as in `omnivox serve`
        digest = request_digest(scope["path"], body, request.headers.get(SESSION_HEADER)) \
            if scope["method"] == "POST" else None
        options = {"prefix_digest": digest, "replica": request.headers.get(REPLICA_HEADER)}
        reply = self.engine.options(stream=True).http.remote(scope, body, **options)
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S if scope["path"] in PROBES else None):
                start = await reply.__anext__()
        except asyncio.TimeoutError:
            reply.cancel()
            return JSONResponse({"ready": False, "state": "no engine replica answered"}, status_code=503)
        except RayError as e:
            return JSONResponse(error_body(502, replica_failed(e), code="replica_failed"), status_code=502)
        except BaseException:  # the client went away before the replica answered
            reply.cancel()
            raise
        return Forwarded(reply, start, self._answered)

    async def _body(self, request: Request) -> bytes:
        """The whole body, due --body-timeout after the headers (408) and within --max-body-mb (413)."""
        receive = self.guard.limited(deadline_receive(request.receive, self.body_timeout), discard=False)
        return b"".join([chunk async for chunk in Request(request.scope, receive).stream()])

    # ---- WebSocket sessions -------------------------------------------------------------------------
    @app.websocket("/v1/realtime")
    @app.websocket("/api/chat")
    async def session(self, ws: WebSocket):
        await self.sessions.forward(ws)
