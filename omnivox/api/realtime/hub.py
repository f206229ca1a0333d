"""`/v1/realtime` (WebSocket) and `/playground`: the upgrade's checks, the session registry, the
socket's reader loop.

A refused connection is accepted and closed at once with a close code and a reason (at most 123
bytes): what a client shows (the official `openai` client's exception, a browser's close event),
where an HTTP refusal of the upgrade would show a bare status. The codes are 4000 + the HTTP
status the refusal would have had, but 1013 ("try again later") when busy:
  - 4400 for a `Host` the server does not answer (`api/guards.HostPolicy`, as every HTTP route);
  - 4401 without the server's --api-key: `Authorization: Bearer KEY`, or, from a browser (which
    cannot set headers on a WebSocket), the subprotocol `openai-insecure-api-key.KEY`;
  - 4403 for a web page of another origin: an `Origin` is accepted when it is the server's own
    (the playground: under a Host that is an IP literal or `localhost`) or one of --allowed-origins;
  - 4404 for another `?model=` than the served one;
  - 1013 when sessions reach --max-realtime-sessions (default --max-running; a full-duplex model's
    `/api/chat` sessions count too), or when the engine is full (`Engine.busy`: requests generating
    or queued, at --max-running + --max-queue; a full-duplex session's engine request is opened
    before the upgrade is accepted, `RealtimeSession.open`, and refused beyond the model's sessions).
A refused connection never becomes a session: nothing is read from it and nothing else is sent.
After the checks: one session of the model's kind (`ListeningSession` for a model that listens,
`SpeakingSession` for text-to-speech, `DuplexSession` for a full-duplex model), which sees the
hub only as a `SessionHost`; a client silent for --realtime-idle-timeout-s while its session is
not `busy` (a response of a turn-based kind in progress; a duplex session's frames waiting for
their answer) is told so (an `error` event) and disconnected.

What counts where: a session's open turn (its streamed prompt, waiting for the user) counts only
here, against --max-realtime-sessions; its response, once the prompt closes, counts in
`Engine.busy` like any HTTP request. So idle sessions never make an HTTP request answer 503. Their KV pages are
bounded too: open prompts hold at most --realtime-turn-kv-share of the Thinker's pages together
(`turn_room`), and one with no input for --realtime-turn-idle-s gives its pages back, so requests
always find the rest of the cache.

A slow reader: a send that waits --realtime-send-timeout-s on a full socket (the client reads
nothing for that long with over --realtime-send-buffer-kb, 1 MiB, unsent) closes the connection with 1008, and a client that
answers none of uvicorn's keepalive pings is closed with 1011; either ends the session (its engine
requests cancelled, their pages freed) and counts in `omnivox_slow_readers_dropped_total`
(`sender.py`), so a client that stops reading cannot make the server hold its reply.
"""
from __future__ import annotations

import asyncio
import hmac
from functools import partial
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from fastapi import FastAPI, WebSocket
from starlette.websockets import WebSocketDisconnect
from fastapi.responses import HTMLResponse

from omnivox.api.admission import WorkPool
from omnivox.api.duplex_frames import DuplexFrames
from omnivox.api.errors import ApiError
from omnivox.api.flow import capacity_error, overloaded_error
from omnivox.api.guards import HostPolicy, names_this_machine
from omnivox.api.metrics import MetricFamily
from omnivox.api.output_limits import OutputLimits
from omnivox.api.realtime.dispatch import ClientEvents
from omnivox.api.realtime.duplex import DuplexSession
from omnivox.api.realtime.host import RealtimeLimits, SessionHost
from omnivox.api.realtime.inbox import Inbox
from omnivox.api.realtime.listening import ListeningSession
from omnivox.api.realtime.metrics import RealtimeMetrics
from omnivox.api.realtime.protocol import error_event
from omnivox.api.realtime.sender import Sender, close_reason
from omnivox.api.realtime.session import HangUp, RealtimeSession
from omnivox.api.realtime.speaking import SpeakingSession
from omnivox.errors import OmnivoxError, Overloaded
from omnivox.serving import ChatModel, ServedModel
from omnivox.serving_duplex import DuplexModel

PLAYGROUND = Path(__file__).resolve().parents[1] / "static" / "playground.html"
KEY_PROTOCOL = "openai-insecure-api-key."
# the playground is one self-contained page: it may run its inline script (and the microphone
# worklet it loads from a blob: URL), talk to this server and play blob: audio; no other site may
# frame it (clickjacking) or learn its URL
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self' 'unsafe-inline' blob:; style-src 'self' "
                               "'unsafe-inline'; connect-src 'self' ws: wss:; media-src 'self' blob:; "
                               "img-src 'self' data:; frame-ancestors 'self'",
    "X-Frame-Options": "SAMEORIGIN", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


class RealtimeHub:
    def __init__(self, model: ServedModel, served_name: str, pool: WorkPool, *, api_key: str | None,
                 hosts: HostPolicy, limits: RealtimeLimits, output: OutputLimits, dropped: MetricFamily):
        self.model, self.served_name, self.pool = model, served_name, pool
        self.api_key, self.hosts, self.limits = api_key, hosts, limits
        self.metrics = RealtimeMetrics()
        self.dropped = dropped  # the server's count of clients dropped for not reading (`sender.py`)
        self.sessions: dict[str, RealtimeSession] = {}
        self.chat_sessions = 0  # a duplex model's /api/chat sessions (`api/moshi_chat.py`), counted in max_sessions too
        # a full-duplex model's frame deadlines, of its sessions on /v1/realtime and /api/chat alike
        self.frames = DuplexFrames(model.frame_size / model.sample_rate) if isinstance(model, DuplexModel) else None
        self.vad_model = None
        listens = isinstance(model, ChatModel)
        self.turn_pages = int(limits.turn_kv_share * model.prompt_kv_pages) if listens else 0
        if listens:  # load the turn detector's weights once, before the first session
            from omnivox.audio.vad import load_silero_vad
            self.vad_model = load_silero_vad()
        # the session kind, chosen once: a full-duplex model, a model that listens (chat) or one that only speaks (TTS)
        self.session_kind: Callable[[SessionHost, Sender, bool, HangUp], RealtimeSession] = \
            partial(DuplexSession, frames=self.frames) if self.frames is not None \
            else ListeningSession if listens else SpeakingSession
        self.host = SessionHost(model, served_name, pool, limits, output, self.metrics, self.audio_window,
                                self.vad_model, self.turn_room)

    def audio_window(self, window_s: float):
        """The audio encoder's window arithmetic for a session's window (host only: the encoding is
        the listening request's encoder stage)."""
        return self.model.audio_window(window_s)

    # ---- the upgrade --------------------------------------------------------------------------
    def refusal(self, ws: WebSocket) -> ApiError | None:
        """Why the connection is refused (short messages: they travel as a close reason), or None."""
        refused = self.connection_refusal(ws)
        if refused is not None:
            return refused
        model = ws.query_params.get("model")
        if model is not None and model != self.served_name:
            return ApiError(404, f"model {model[:32]!r} is not served here; this server serves "
                                 f"{self.served_name[:32]!r}", param="model", code="model_not_found")
        if self.live_sessions >= self.max_sessions:
            return overloaded_error(f"server busy: {self.live_sessions} sessions (at most "
                                    f"{self.max_sessions}: --max-realtime-sessions)")
        return capacity_error(self.model.engine)

    def connection_refusal(self, ws: WebSocket) -> ApiError | None:
        """The checks of any WebSocket of this server (`/api/chat` too): Host, API key, Origin."""
        h = ws.headers
        # the Gate checks HTTP requests; a WebSocket upgrade is checked here
        if self.hosts.check({b"host": h["host"].encode("latin-1")} if "host" in h else {}) is not None:
            return ApiError(400, f"Host {h.get('host', '')[:48]!r} is not served here (see --allowed-hosts)",
                            code="invalid_host")
        if self.api_key is not None and not self._key_ok(h.get("authorization", ""), self._offered(ws)):
            return ApiError(401, "this server needs its API key: `Authorization: Bearer <key>`, or (browsers) the "
                                 f"subprotocol {KEY_PROTOCOL}<key>", code="invalid_api_key")
        origin = h.get("origin")
        if origin is not None and not self._origin_ok(origin, h.get("host", "")):
            return ApiError(403, f"web origin {origin[:48]!r} refused: not the server's own, nor in "
                                 "--allowed-origins", code="cross_origin_refused")
        return None

    def turn_room(self, session_id: str) -> int:
        """KV pages the open prompt of session `session_id` may hold: the turns' share
        (--realtime-turn-kv-share of the Thinker's pages) less what the other sessions' open prompts
        hold. NOTE: counts each prompt's own pages, a shared prefix once per session, so it never
        under-counts."""
        return self.turn_pages - sum(s.open_pages for sid, s in self.sessions.items() if sid != session_id)

    def measure(self) -> RealtimeMetrics:
        """The metrics, with each session's memory gauges set now (a scrape): host bytes of its
        audio (`RealtimeSession.host_bytes`) and the KV pages its open turn holds."""
        self.metrics.host_bytes.values.clear()
        self.metrics.turn_pages.values.clear()
        for sid, s in list(self.sessions.items()):
            self.metrics.host_bytes.set(s.host_bytes, session=sid)
            self.metrics.turn_pages.set(s.open_pages, session=sid)
        return self.metrics

    def cut(self, reason: str) -> None:
        """The drain's timeout (on the event loop): each session ends as its kind says (`RealtimeSession.cut`:
        a duplex one gets an `error` event, code `draining`, then close 1012)."""
        for s in list(self.sessions.values()):
            s.cut(reason)

    @property
    def live_sessions(self) -> int:
        """Sessions connected now: realtime ones and /api/chat ones (--max-realtime-sessions bounds both)."""
        return len(self.sessions) + self.chat_sessions

    @property
    def max_sessions(self) -> int:
        return self.limits.max_sessions or self.model.engine_config.max_running

    async def refuse(self, ws: WebSocket, refused: ApiError) -> None:
        """Accept, then close with the reason (an upgrade refused over HTTP reaches neither the
        official client's exception nor a browser's script with its reason)."""
        self.metrics.refused.inc(reason=refused.code or str(refused.status))
        await ws.accept(subprotocol="realtime" if "realtime" in self._offered(ws) else None)
        code = 1013 if refused.status == 503 else 4000 + refused.status
        await ws.close(code=code, reason=close_reason(refused.message))

    @staticmethod
    def _offered(ws: WebSocket) -> list[str]:
        return [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]

    def _key_ok(self, authorization: str, protocols: list[str]) -> bool:
        given = [authorization[7:]] if authorization[:7].lower() == "bearer " else []
        given += [p[len(KEY_PROTOCOL):] for p in protocols if p.startswith(KEY_PROTOCOL)]
        return any(hmac.compare_digest(g.encode(), self.api_key.encode()) for g in given)

    def _origin_ok(self, origin: str, host: str) -> bool:
        """One of --allowed-origins, or the server's own origin under a Host it answers whose name
        is an IP literal or `localhost`. NOTE: never a DNS name, whatever --allowed-hosts says: a
        page on a rebound name claims its own name as both Host and Origin (`--allowed-hosts '*'`
        answers it); a name must be listed in --allowed-origins."""
        allowed = self.limits.allowed_origins
        if "*" in allowed or origin.rstrip("/") in allowed:
            return True
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and parts.netloc.lower() == host.lower() \
            and names_this_machine(parts.netloc) and self.hosts.allows(parts.netloc)

    # ---- a session ----------------------------------------------------------------------------
    async def serve(self, ws: WebSocket) -> None:
        refused = self.refusal(ws)
        if refused is not None:
            return await self.refuse(ws, refused)
        beta = "realtime=v1" in ws.headers.get("openai-beta", "").replace(" ", "")
        inbox = Inbox(self.limits.inbox_bytes)
        send = Sender(ws, inbox, self.limits.send_timeout_s, self.limits.send_buffer_bytes, self.dropped)

        async def hang_up(code: int, reason: str) -> None:
            try:
                await ws.close(code=code, reason=close_reason(reason))
            except RuntimeError:
                pass  # closed already
            inbox.close()

        session = self.session_kind(self.host, send, beta, hang_up)
        try:
            session.open()
        except OmnivoxError as e:
            return await self.refuse(ws, overloaded_error(str(e)) if isinstance(e, Overloaded) or e.status == 503
                                     else ApiError(e.status, str(e), code=e.code))
        self.sessions[session.id] = session
        self.metrics.sessions.inc()
        self.metrics.active.inc()
        reader = None
        try:
            await ws.accept(subprotocol="realtime" if "realtime" in self._offered(ws) else None)
            await session.start()
            reader = asyncio.ensure_future(self._read(ws, session, inbox))
            await ClientEvents(session).handle(inbox)  # until the reader closes the inbox
        except (ConnectionError, WebSocketDisconnect):
            pass  # the client went away mid-send (or before the accept)
        finally:
            if reader is not None:
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)  # a disconnect: nothing to report
            self.sessions.pop(session.id, None)
            self.metrics.active.inc(-1)
            send.ended()
            await session.close()

    async def _read(self, ws: WebSocket, session: RealtimeSession, inbox: Inbox) -> None:
        """Client messages into the inbox until the client goes away or idles; then closes it."""
        try:
            while True:
                try:
                    async with asyncio.timeout(self.limits.idle_timeout_s):
                        message = await ws.receive()
                except asyncio.TimeoutError:
                    if session.busy:  # listening to a long reply, or waiting for frames, is not idling
                        continue
                    await session.out.send(error_event(f"no client event for {self.limits.idle_timeout_s:g} s: "
                                                       "the session is closed (--realtime-idle-timeout-s)",
                                                       code="idle_timeout"))
                    await ws.close(code=1000, reason="idle timeout")
                    return
                if message["type"] == "websocket.disconnect":
                    return
                text = message.get("text")
                await inbox.put(text if text is not None else message.get("bytes") or b"")
        finally:
            inbox.close()


def mount_realtime(app: FastAPI, model: ServedModel, served_name: str, pool: WorkPool, *, api_key: str | None,
                   hosts: HostPolicy, limits: RealtimeLimits, output: OutputLimits,
                   dropped: MetricFamily) -> RealtimeHub:
    """Add `/v1/realtime` and `/playground` to the app; the hub's metrics join `/metrics`. `output`:
    what one response may generate (the HTTP routes' limits); `dropped`: the server's count of
    clients dropped for not reading."""
    hub = RealtimeHub(model, served_name, pool, api_key=api_key, hosts=hosts, limits=limits, output=output,
                      dropped=dropped)
    app.state.realtime = hub

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket):
        await hub.serve(ws)

    page = PLAYGROUND.read_text(encoding="utf-8")

    @app.get("/playground")
    async def playground():
        return HTMLResponse(page, headers=PAGE_HEADERS)

    return hub
