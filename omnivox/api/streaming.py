"""Server-sent events: framing, a response that notices a vanished client and drops one that
stops reading (`SendLimit`). (The playback clock that detects underruns is the engine's:
`omnivox.engine.playback`.)

Streamed chat audio: with `audio.format` "pcm16" each `delta.audio.data` is base64 of raw
little-endian signed 16-bit mono samples at 24 kHz (OpenAI's behaviour); with "wav" each one is
a complete wav file of the same samples (the peers' behaviour; see the README).
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import traceback
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"
SEND_LIMIT = "omnivox.send_limit"  # the scope key of a request's `SendLimit` (the server's Gate sets it)
STREAM_SNDBUF = 64 * 2**10  # the kernel send buffer of a connection that streams (Linux reserves twice this)
log = logging.getLogger("omnivox.api")


@dataclass(frozen=True)
class SendLimit:
    """How long one write of a streamed reply may wait for a client that reads nothing
    (`--stream-send-timeout-s`: uvicorn's send waits while the socket's buffer is full), and what
    then: the connection is aborted (the client's read fails), `dropped` counts it, and the
    request is cancelled as for any client gone. `transport`: the connection's (None: nothing to
    abort, e.g. behind the replicas' bridge; the stream is only ended).

    A send waits once about 200 KB are unsent: uvicorn's 64 KiB plus the kernel's buffer, bounded
    to STREAM_SNDBUF when the stream starts (`bound_buffer`). NOTE: left to itself, Linux grows a
    socket's send buffer up to 4 MiB (tcp_wmem): a minute of base64 speech held for a client that
    reads nothing before its send timeout even starts; a speech stream (64 KB/s as base64 pcm16)
    needs far less in flight, ~200 KB covering a round trip of 3 s."""

    timeout_s: float
    transport: asyncio.Transport | None
    dropped: Callable[[], None]

    def bound_buffer(self) -> None:
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SNDBUF)
            except OSError:  # not a socket that has one: left as it is
                pass


def transport_of(receive: Receive) -> asyncio.Transport | None:
    """The connection's transport behind an ASGI `receive`, None when unknown. NOTE: uvicorn's
    `receive` is its request cycle's bound method, which holds the transport; middleware that
    wraps `receive` hides it."""
    return getattr(getattr(receive, "__self__", None), "transport", None)


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
    the body is cancelled and `on_close` runs, whatever the ASGI server's spec version.

    NOTE: every bounded await on these paths is `asyncio.timeout`, never `asyncio.wait_for`: before
    Python 3.12, a task cancelled just as wait_for's inner await completed got the result and lost
    the cancellation, so a stream whose client had left went on to the reply's end
    (tests/api/test_sse_cancel.py)."""

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
        pump = asyncio.ensure_future(self._pump(send, scope.get(SEND_LIMIT)))
        gone = asyncio.ensure_future(until_disconnect(receive))
        try:
            await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, gone):
                task.cancel()
            self.on_close()  # NOTE: before the tasks end: the request is freed whatever they do next
            results = await asyncio.gather(pump, gone, return_exceptions=True)
        if isinstance(results[0], Exception):  # a bug while streaming: log it (the stream is cut)
            traceback.print_exception(results[0])

    async def _pump(self, send: Send, limit: SendLimit | None) -> None:
        if limit is not None:
            limit.bound_buffer()
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for data in self.body_iter:
                message = {"type": "http.response.body", "body": data, "more_body": True}
                if limit is None:
                    await send(message)
                    continue
                try:
                    async with asyncio.timeout(limit.timeout_s):
                        await send(message)
                except asyncio.TimeoutError:
                    return await _drop(limit)
        except OSError:  # the socket went away mid-write
            return
        except StreamFailed as e:
            # NOTE: no final chunk: returning with the body incomplete makes the ASGI server close
            # the connection, so the client's read fails instead of seeing a short, clean reply
            log.warning("stream cut: its request failed mid-way (%s: %s)", e.status, e.message)
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _drop(limit: SendLimit) -> None:
    """A client that read nothing for `limit.timeout_s`: abort its connection (what it left unread
    is discarded) and count it. NOTE: the abort's connection_lost runs at the loop's next turn;
    yielding once lets it, so uvicorn sees the client gone, not a response left incomplete."""
    limit.dropped()
    log.info("a client read nothing of its streamed reply for %g s: dropped (--stream-send-timeout-s)",
             limit.timeout_s)
    if limit.transport is not None:
        limit.transport.abort()
        await asyncio.sleep(0)
