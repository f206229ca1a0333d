"""The HTTP app: routes, the auth/body-size/metrics middleware and OpenAI-shaped error handlers.

Routes: POST /v1/chat/completions (Qwen3-Omni), POST /v1/audio/speech (both families),
POST/GET /v1/audio/voices and DELETE /v1/audio/voices/{id} (saved voices, S2),
GET /v1/models[/{id}], GET /health (200 while serving or draining), GET /health/live (liveness),
GET /health/ready (readiness: lifecycle.py), GET /metrics; WebSocket /v1/realtime and GET
/playground (`omnivox.api.realtime`); for a full-duplex model, WebSocket /api/chat (moshi's
protocol: `moshi_chat.py`). With an API key, every /v1 route needs
`Authorization: Bearer <key>` (401 otherwise); the probes and /metrics stay open for probes and
scrapers. Every route checks `Host` (guards.py); while the server drains, every route but those
answers 503 `draining`.
"""
from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omnivox.api.admission import Pools
from omnivox.api.chat import ChatService
from omnivox.api.dialects import VoiceAliases
from omnivox.api.flow import ClientGone, capacity_error
from omnivox.api.errors import ApiError, error_body
from omnivox.api.guards import JSON_ROUTES, BodyBudget, HostPolicy, RequestGuard, discard_body
from omnivox.api.hooks import HookFactory
from omnivox.api.lifecycle import PROBES, Lifecycle, refuse_socket
from omnivox.api.media import MediaReader
from omnivox.api.metrics import ServerMetrics
from omnivox.api.moshi_chat import MoshiChatLimits, mount_moshi_chat
from omnivox.api.output_limits import OutputLimits
from omnivox.api.realtime import RealtimeLimits, mount_realtime
from omnivox.api.speech import SpeechService
from omnivox.api.streaming import SEND_LIMIT, SendLimit, transport_of
from omnivox.api.timeouts import deadline_receive
from omnivox.api.voices import VoiceService, VoiceStore
from omnivox.errors import EngineFailed
from omnivox.serving import ChatModel, ServedModel, VoiceCloner
from omnivox.serving_duplex import DuplexModel

log = logging.getLogger("omnivox.api")
DEFAULT_MAX_BODY_BYTES = 32 * 2**20
DEFAULT_BODY_TIMEOUT = 60.0
DEFAULT_SEND_TIMEOUT = RealtimeLimits.send_timeout_s  # a streamed reply's, as a realtime session's
ROUTES = ("/v1/chat/completions", "/v1/audio/speech", "/v1/audio/voices", "/v1/models", "/v1/realtime", "/playground",
          "/health", "/metrics")


class Gate:
    """ASGI middleware: every check that needs no body (Host, draining, API key, Origin,
    Content-Type, body size, capacity: `guards.RequestGuard`) before any of it is read, the body's
    size limit and deadline while it is read, the send limit of a streamed reply
    (`streaming.SendLimit`), per-route status counts, and the count of requests being answered that
    a drain waits for (`lifecycle.py`)."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int, metrics: ServerMetrics,
                 hosts: HostPolicy | None = None, body_timeout: float = DEFAULT_BODY_TIMEOUT,
                 bodies: BodyBudget | None = None, capacity: Callable[[str, str], ApiError | None] | None = None,
                 lifecycle: Lifecycle | None = None, send_timeout: float = DEFAULT_SEND_TIMEOUT):
        self.app, self.metrics = app, metrics
        self.body_timeout = body_timeout
        self.lifecycle = lifecycle or Lifecycle("serving")
        self.send_timeout = send_timeout
        hosts, bodies = hosts or HostPolicy("127.0.0.1"), bodies or BodyBudget(4 * max_body_bytes)
        self.guard = RequestGuard(api_key=api_key, max_body_bytes=max_body_bytes, hosts=hosts, bodies=bodies,
                                  lifecycle=self.lifecycle, capacity=capacity)

    def _dropped(self) -> None:
        self.metrics.slow_readers.inc(api="http", reason="send_timeout")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "websocket":  # the realtime hub bounds what a slow reader leaves unsent
                refused = self.lifecycle.refusal(scope["path"])
                if refused is not None:
                    return await refuse_socket(scope, receive, send, refused)
                scope["omnivox.ws_protocol"] = getattr(send, "__self__", None)  # uvicorn's protocol object
            return await self.app(scope, receive, send)
        path = scope["path"]
        counted = path not in PROBES
        route = next((r for r in ROUTES if path == r or path.startswith(r + "/")), "other")
        status = [0]
        scope[SEND_LIMIT] = SendLimit(self.send_timeout, transport_of(receive), self._dropped)

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        receive = deadline_receive(receive, self.body_timeout)
        reserved = 0
        try:
            error, reserved = self.guard.admit(scope)
            if error is not None:
                if not await discard_body(receive):
                    error.headers = {**(error.headers or {}), "Connection": "close"}
                return await error.response()(scope, receive, counted_send)
            self.lifecycle.requests += int(counted)
            try:
                await self.app(scope, self.guard.limited(receive), counted_send)
            finally:
                self.lifecycle.requests -= int(counted)
        finally:
            self.guard.bodies.release(reserved)
            self.metrics.requests.inc(route=route, code=str(status[0] or 499))


def create_app(model: ServedModel, served_name: str, *, api_key: str | None = None,
               hook_factory: HookFactory | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               voices: VoiceStore | None = None, hosts: HostPolicy | None = None,
               body_timeout: float = DEFAULT_BODY_TIMEOUT, max_pending_body_bytes: int | None = None,
               pools: Pools | None = None, voice_aliases: dict[str, str] | None = None,
               media_dir: Path | None = None, realtime: RealtimeLimits | None = None,
               output_limits: OutputLimits | None = None, lifecycle: Lifecycle | None = None,
               stream_send_timeout: float | None = None, moshi_chat: MoshiChatLimits | None = None) -> FastAPI:
    """The server for one loaded model (`omnivox.serving.ServedModel`); the engine thread
    starts here. `voices`: the saved-voice store (a `VoiceCloner`'s). `hosts`: the Host
    headers answered (default: a server bound to 127.0.0.1); `pools`: the worker pools;
    `voice_aliases`: --voice-alias overrides (api/dialects.py); `media_dir`:
    --allowed-local-media-path; `realtime`: the limits of `/v1/realtime` sessions
    (`omnivox.api.realtime`; default ones when None); `output_limits`: what one request may
    generate (api/output_limits.py; default: what the model's context allows); `lifecycle`:
    readiness and draining (`omnivox serve`'s; default: one that serves at once);
    `stream_send_timeout`: seconds a write of a streamed reply may wait for a client that reads
    nothing before it is dropped (`streaming.SendLimit`; default: the realtime send timeout's);
    `moshi_chat`: the limits of `/api/chat` sessions (a `DuplexModel` only; default ones when None).
    `app.state.close()` stops the pools and the model (the app's lifespan calls it)."""
    family = model.family
    clones = isinstance(model, VoiceCloner)
    voices = voices if clones else None
    lifecycle = lifecycle or Lifecycle("serving")
    realtime = realtime or RealtimeLimits()
    metrics = ServerMetrics()
    for stage, by in model.weight_bytes().items():
        for dtype, n in by.items():
            metrics.weights.set(n, stage=stage, dtype=dtype)
    pools, hosts = pools or Pools.create(), hosts or HostPolicy("127.0.0.1")
    aliases = VoiceAliases(model.builtin_voices, voice_aliases, saved_voices=clones)
    media = MediaReader(media_dir)
    limits = output_limits or OutputLimits.for_model(model)
    chat = ChatService(model, served_name, metrics, hook_factory, pools, aliases, media, limits) \
        if isinstance(model, ChatModel) else None
    speech = SpeechService(model, served_name, metrics, pools, voices, aliases, media, limits)
    label = f"{served_name!r} ({family.label})"
    voice_api = VoiceService(voices, model if clones else None, pools.voice, label)
    started = int(time.time())
    engine = model.engine

    def capacity(method: str, path: str) -> ApiError | None:
        """A 503 before the body is read when the work this request needs has no room."""
        if method != "POST":
            return None
        if path == "/v1/audio/voices":
            return pools.voice.overloaded() if pools.voice.full else None
        return capacity_error(engine) if path in JSON_ROUTES else None

    def close() -> None:
        pools.shutdown()
        model.close()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        close()

    app = FastAPI(title="omnivox", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.router.redirect_slashes = False  # its redirect writes the request's Host into Location
    app.state.omni, app.state.metrics, app.state.chat, app.state.speech = model, metrics, chat, speech
    app.state.output_limits, app.state.close = limits, close
    app.add_middleware(Gate, api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics, hosts=hosts,
                       body_timeout=body_timeout, bodies=BodyBudget(max_pending_body_bytes or 4 * max_body_bytes),
                       capacity=capacity, lifecycle=lifecycle,
                       send_timeout=realtime.send_timeout_s if stream_send_timeout is None else stream_send_timeout)
    _add_error_handlers(app)
    live = mount_realtime(app, model, served_name, pools.realtime, api_key=api_key, hosts=hosts,
                          limits=realtime, output=limits, dropped=metrics.slow_readers)
    duplex = mount_moshi_chat(app, model, live, moshi_chat or MoshiChatLimits(), metrics.slow_readers) \
        if isinstance(model, DuplexModel) else None
    lifecycle.attach(model, live, duplex)

    def model_card() -> dict:
        saved = voices.names() if voices is not None else []
        return {"id": served_name, "object": "model", "created": started, "owned_by": "omnivox",
                "demo": model.is_demo, "sample_rate": speech.sample_rate, "family": family.name,
                "voices": [*model.builtin_voices, *saved], "voice_aliases": aliases.table,
                "max_model_len": model.max_model_len,
                "modalities": model.modalities}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        if duplex is not None:
            raise ApiError(400, f"{served_name!r} is a full-duplex model ({family.label}): chat completions are not "
                                "available; talk to it over the WebSocket /api/chat", code="unsupported_model")
        if chat is None:
            raise ApiError(400, f"{served_name!r} is a text-to-speech model ({family.label}): chat completions are not "
                                "available; use POST /v1/audio/speech", code="unsupported_model")
        return await chat.create(request)

    @app.post("/v1/audio/speech")
    async def audio_speech(request: Request):
        return await speech.create(request)

    @app.post("/v1/audio/voices")
    async def create_voice(request: Request):
        return await voice_api.create(request)

    @app.get("/v1/audio/voices")
    async def list_voices():
        return voice_api.list()

    @app.delete("/v1/audio/voices/{voice_id:path}")
    async def delete_voice(voice_id: str):
        return voice_api.delete(voice_id)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id != served_name:
            raise ApiError(404, f"model {model_id!r} is not served here; this server serves {served_name!r}",
                           param="model", code="model_not_found")
        return model_card()

    @app.get("/health")
    @app.get("/health/live")
    async def health():  # this app answers only once the server serves (`lifecycle.Front`)
        s = engine.stats()
        alive = engine.alive
        status = ("draining" if lifecycle.draining else "healthy") if alive else "engine stopped"
        body = {"status": status, "model": served_name, "in_flight": s.in_flight, "running": s.running,
                "waiting": s.waiting}
        return body if alive else JSONResponse(body, status_code=503)

    @app.get("/health/ready")
    async def ready():
        body = lifecycle.report()
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(engine.stats()) + live.measure().render()
                                 + (duplex.render() + live.frames.render() if duplex is not None else ""),
                                 media_type="text/plain; version=0.0.4")

    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return e.response()

    @app.exception_handler(EngineFailed)
    async def engine_failed(request: Request, e: EngineFailed):  # for good (a tensor-parallel rank died)
        return JSONResponse(error_body(503, str(e), code=e.code), status_code=503)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, e: ClientGone):
        return Response(status_code=499)  # nobody reads it; the request is already cancelled

    @app.exception_handler(ClientDisconnect)
    async def cut_body(request: Request, e: ClientDisconnect):
        log.debug("%s %s: the client went away while sending the body", request.method, request.url.path)
        return Response(status_code=499)  # an ordinary event, not a server error: no traceback

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        path = request.url.path
        hint = " (routes take no trailing slash)" if path.endswith("/") and len(path) > 1 else ""
        message = {404: f"no route {request.method} {path:.200}{hint}; see GET /v1/models and "
                        "POST /v1/chat/completions or /v1/audio/speech",
                   405: f"{request.method} is not allowed on {path:.200}"}.get(e.status_code, str(e.detail))
        return JSONResponse(error_body(e.status_code, message), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        return JSONResponse(error_body(400, f"invalid request: {e.errors()[:1]}"), status_code=400)

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception):
        log.error("internal error on %s %s", request.method, request.url.path, exc_info=e)  # the text stays here
        return JSONResponse(error_body(500, f"internal error ({type(e).__name__}); see the server log"),
                            status_code=500)
