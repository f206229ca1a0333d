"""Helpers shared by the chat and speech routes: event chaining, engine failures as HTTP
errors, overload, and the audio metrics every streamed reply records."""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from starlette.requests import Request

from omnivox.api.errors import ApiError, draining_error
from omnivox.api.metrics import ServerMetrics
from omnivox.api.streaming import until_disconnect
from omnivox.engine.playback import PlaybackClock
from omnivox.engine.events import AudioChunk, Event, Failed, Finished


async def chain(first: Event, events) -> AsyncIterator[Event]:
    """The first event (already awaited before any bytes were sent), then the rest."""
    yield first
    if not isinstance(first, (Finished, Failed)):
        async for ev in events:
            yield ev


def failed_error(ev: Failed) -> ApiError:
    status = ev.status if ev.status in (400, 413, 500, 503) else 500
    if ev.code == "engine_failed":  # for good: no point retrying this server
        return ApiError(503, ev.message, code=ev.code)
    if ev.code == "draining":  # the server is leaving: retry on another
        return draining_error(ev.message)
    if status == 503:
        return overloaded_error(ev.message)
    return ApiError(status, ev.message, code="request_too_large" if status == 413 else None)


def overloaded_error(message: str) -> ApiError:
    return ApiError(503, f"{message}; retry shortly", code="server_overloaded", headers={"Retry-After": "1"})


def capacity_error(engine) -> ApiError | None:
    """The engine's capacity rule (`Engine.overload`) as the 503 every route answers."""
    over = engine.overload()
    return None if over is None else overloaded_error(str(over))


def observe_chunk(m: ServerMetrics, ev: AudioChunk, clock: PlaybackClock, arrival: float) -> None:
    """TTFA at the first chunk; the slack of a later one; an underrun (and its silence) when a chunk
    comes after the audio before it ran out."""
    now = time.monotonic()
    slack = clock.slack(now)
    if clock.first is None:
        m.ttfa.observe(now - arrival)
    else:
        m.slack.observe(slack)
    if clock.on_chunk(ev.samples.shape[0] / ev.sample_rate, now):
        m.underruns.inc()
        m.stall_seconds.inc(-slack)
    m.chunks.inc()


def observe_audio_done(m: ServerMetrics, ev: Finished, arrival: float, clock: PlaybackClock | None) -> None:
    m.audio_seconds.inc(ev.audio_seconds)
    if ev.audio_seconds > 0:
        m.rtf.observe((time.monotonic() - arrival) / ev.audio_seconds)
    if clock is not None and clock.underruns:
        m.stalled.inc()


class ClientGone(Exception):
    """The HTTP client disconnected before its reply was ready."""


async def guard(awaitable, request: Request, handle, metrics: ServerMetrics):
    """Await `awaitable` unless the client disconnects first: then cancel the request (which
    frees its pages) and raise ClientGone."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(until_disconnect(request.receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is shutting down
        work.cancel()
        handle.cancel()
        raise
    finally:
        gone.cancel()
    if not work.done():
        work.cancel()
        handle.cancel()
        metrics.disconnects.inc()
        raise ClientGone()
    return work.result()
