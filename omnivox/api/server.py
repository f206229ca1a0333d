"""The HTTP app: routes, the auth/body-size/metrics middleware and OpenAI-shaped error handlers.

Routes: POST /v1/chat/completions (Qwen3-Omni), POST /v1/audio/speech (both families),
POST/GET /v1/audio/voices and DELETE /v1/audio/voices/{id} (saved voices, S2),
GET /v1/models[/{id}], GET /health, GET /metrics; WebSocket /v1/realtime and GET /playground
(`omnivox.api.realtime`).
With an API key, every /v1 route needs `Authorization: Bearer <key>` (401 otherwise);
/health and /metrics stay open for probes and scrapers.
"""
from __future__ import annotations

import hmac
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omnivox.api.chat import ChatService
from omnivox.api.flow import ClientGone
from omnivox.api.errors import ApiError, error_body
from omnivox.api.hooks import HookFactory
from omnivox.api.metrics import ServerMetrics
from omnivox.api.realtime import RealtimeLimits, mount_realtime
from omnivox.api.speech import SpeechService
from omnivox.api.voices import VoiceService, VoiceStore
from omnivox.models.registry import ServedModel

DEFAULT_MAX_BODY_BYTES = 32 * 2**20
DRAIN_BYTES = 64 * 2**20
ROUTES = ("/v1/chat/completions", "/v1/audio/speech", "/v1/audio/voices", "/v1/models", "/v1/realtime", "/playground",
          "/health", "/metrics")


class Gate:
    """ASGI middleware: API key check, request body limit, per-route status counts."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int, metrics: ServerMetrics):
        self.app, self.api_key, self.limit, self.metrics = app, api_key, max_body_bytes, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = next((r for r in ROUTES if path == r or path.startswith(r + "/")), "other")
        status = [0]

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            error = self._refuse(scope)
            if error is not None:
                await self._drain(receive)
                return await error.response()(scope, receive, counted_send)
            await self.app(scope, self._limited(receive), counted_send)
        finally:
            self.metrics.requests.inc(route=route, code=str(status[0] or 499))

    def _refuse(self, scope: Scope) -> ApiError | None:
        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"].startswith("/v1"):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            given = auth[7:] if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(given.encode(), self.api_key.encode()):
                what = "no API key was given" if not auth else "the API key is not valid"
                return ApiError(401, f"{what}: send the server's --api-key as `Authorization: Bearer <key>`",
                                code="invalid_api_key")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return self._too_large(int(length))
        return None

    def _too_large(self, size: int | None) -> ApiError:
        got = f"request body is {size} bytes" if size is not None else "request body is too large"
        return ApiError(413, f"{got}; this server accepts at most {self.limit} bytes (omnivox serve --max-body-mb); "
                             "send shorter media", code="request_too_large")

    async def _drain(self, receive: Receive) -> None:
        """Read (and drop) a refused body, so the client can read the error instead of a reset.
        NOTE: bounded: past DRAIN_BYTES the connection is simply closed after the reply."""
        seen, more = 0, True
        while more and seen <= DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return
            seen += len(message.get("body", b""))
            more = message.get("more_body", False)

    def _limited(self, receive: Receive) -> Receive:
        seen = [0]

        async def wrapped() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > self.limit:  # a chunked body without content-length
                    if message.get("more_body", False):
                        await self._drain(receive)
                    raise self._too_large(None)
            return message

        return wrapped


def create_app(model: ServedModel, served_name: str, *, api_key: str | None = None,
               hook_factory: HookFactory | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               voices: VoiceStore | None = None, realtime: RealtimeLimits | None = None) -> FastAPI:
    """The server for one loaded model (`omnivox.models.registry.ServedModel`); the engine thread
    starts here. `voices`: the saved-voice store (families with cloning); `realtime`: the limits of
    `/v1/realtime` sessions (`omnivox.api.realtime`; default ones when None)."""
    family = model.family
    metrics = ServerMetrics()
    chat = ChatService(model, served_name, metrics, hook_factory) if family.chat else None
    executor = chat.executor if chat is not None else ThreadPoolExecutor(4, thread_name_prefix="omnivox-prepare")
    speech = SpeechService(model, served_name, metrics, executor, voices if family.cloning else None)
    label = f"{served_name!r} ({family.label})"
    voice_api = VoiceService(voices if family.cloning else None, model if family.cloning else None, executor, label)
    started = int(time.time())
    engine = model.engine

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        executor.shutdown(wait=False, cancel_futures=True)
        model.close()

    app = FastAPI(title="omnivox", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.omni, app.state.metrics, app.state.chat, app.state.speech = model, metrics, chat, speech
    app.add_middleware(Gate, api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics)
    _add_error_handlers(app)
    live = mount_realtime(app, model, served_name, executor, api_key=api_key, limits=realtime or RealtimeLimits())

    def model_card() -> dict:
        saved = voices.names() if (voices is not None and family.cloning) else []
        return {"id": served_name, "object": "model", "created": started, "owned_by": "omnivox",
                "demo": model.is_demo, "sample_rate": speech.sample_rate, "family": family.name,
                "voices": [*model.builtin_voices, *saved], "max_model_len": model.max_model_len,
                "modalities": model.modalities}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
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
    async def health():
        s = engine.stats()
        body = {"status": "ok" if engine.alive else "engine stopped", "model": served_name,
                "in_flight": s.in_flight, "running": s.running, "waiting": s.waiting}
        return body if engine.alive else JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(engine.stats()) + live.metrics.render(),
                                 media_type="text/plain; version=0.0.4")

    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return e.response()

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, e: ClientGone):
        return Response(status_code=499)  # nobody reads it; the request is already cancelled

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        message = {404: f"no route {request.method} {request.url.path}; see GET /v1/models and "
                        "POST /v1/chat/completions or /v1/audio/speech",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return JSONResponse(error_body(e.status_code, message), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        return JSONResponse(error_body(400, f"invalid request: {e.errors()[:1]}"), status_code=400)

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception):
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}"), status_code=500)
