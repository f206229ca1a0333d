"""Server-sent events: framing, a response that notices a vanished client. (The playback clock
that detects underruns is the engine's: `omnivox.engine.playback`.)

Streamed chat audio: with `audio.format` "pcm16" each `delta.audio.data` is base64 of raw
little-endian signed 16-bit mono samples at 24 kHz (OpenAI's behaviour); with "wav" each one is
a complete wav file of the same samples (the peers' behaviour; see the README).
"""
from __future__ import annotations

import asyncio
import json
import logging
import traceback
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from omnivox.engine.playback import PlaybackClock  # noqa: F401 - the routes' import, until they name the engine's

DONE = b"data: [DONE]\n\n"
log = logging.getLogger("omnivox.api")


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def until_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    """Returns when the client has gone (the request body must already be read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class StreamFailed(Exception):
    """Raised by a streamed body whose request failed after its first bytes: the response is cut."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class SSEResponse(Response):
    """Streams `body` as `text/event-stream`. When the client disconnects (or the socket fails)
    the body is cancelled and `on_close` runs, whatever the ASGI server's spec version."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], None], media_type: str | None = None,
                 headers: dict[str, str] | None = None):
        # NOTE: not Response.__init__, which would add `content-length: 0`
        self.status_code, self.background = 200, None
        if media_type is not None:  # raw audio streams reuse this response with their own type
            self.media_type = media_type
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self.body_iter, self.on_close = body, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        gone = asyncio.ensure_future(until_disconnect(receive))
        try:
            await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, gone):
                task.cancel()
            results = await asyncio.gather(pump, gone, return_exceptions=True)
            self.on_close()
        if isinstance(results[0], Exception):  # a bug while streaming: log it (the stream is cut)
            traceback.print_exception(results[0])

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for data in self.body_iter:
                await send({"type": "http.response.body", "body": data, "more_body": True})
        except OSError:  # the socket went away mid-write
            return
        except StreamFailed as e:
            # NOTE: no final chunk: returning with the body incomplete makes the ASGI server close
            # the connection, so the client's read fails instead of seeing a short, clean reply
            log.warning("stream cut: its request failed mid-way (%s: %s)", e.status, e.message)
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})
