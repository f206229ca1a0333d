"""Bounded worker pools for the work requests cause outside the engine, one per kind, so one kind
can never delay another:

- `requests`: parsing and planning bodies, tokenizing text-only prompts, submitting speech,
  encoding replies (light, bounded by the body limit);
- `media`: decoding and featurising a chat's audio, images and video (`--media-workers`,
  `--media-queue`);
- `voice`: encoding voice samples with the codec, for `POST /v1/audio/voices` and for speech
  `references` (`--voice-workers`, `--voice-queue`);
- `realtime`: the audio input of `/v1/realtime` sessions (resampling, VAD, log-mel, the AuT
  window) and their prompts (`--realtime-workers`); each session holds at most one job of at most
  a second of audio at a time, so the pool's first-come order serves sessions round-robin
  (`api/realtime/session.py`, `listening.py`; sessions are bounded by --max-realtime-sessions).

Each pool runs at most `workers` jobs at once and holds at most `queue` more; past that a request
gets 503 with Retry-After at once (before its body is read when the route says which pool it
needs), instead of waiting behind the others.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from omnivox.api.errors import ApiError


class WorkPool:
    def __init__(self, name: str, workers: int, queue: int, flags: str = ""):
        self.name, self.workers, self.queue, self.flags = name, workers, queue, flags
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"omnivox-{name}")
        self.pending = 0  # jobs submitted and not finished (running or queued); event loop only

    @property
    def full(self) -> bool:
        return self.pending >= self.workers + self.queue

    def overloaded(self) -> ApiError:
        how = f" ({self.flags})" if self.flags else ""
        return ApiError(503, f"server busy: {self.pending} {self.name} jobs running or queued (at most "
                             f"{self.workers} + {self.queue}{how}); retry shortly", code="server_overloaded",
                        headers={"Retry-After": "1"})

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in a worker thread; 503 at once when the pool is full.
        NOTE: a job counts until its thread finishes it, even when the awaiting request is
        cancelled (a worker cannot be interrupted), so the limit bounds real work."""
        if self.full:
            raise self.overloaded()
        loop = asyncio.get_running_loop()
        future = self.executor.submit(fn, *args)
        self.pending += 1

        def release(_) -> None:
            try:
                loop.call_soon_threadsafe(self._done)
            except RuntimeError:  # the loop is closed: the server is gone
                pass

        future.add_done_callback(release)
        return await asyncio.wrap_future(future)

    def _done(self) -> None:
        self.pending -= 1

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


@dataclass
class Pools:
    requests: WorkPool
    media: WorkPool
    voice: WorkPool
    realtime: WorkPool

    @classmethod
    def create(cls, *, media_workers: int = 2, media_queue: int = 32, voice_workers: int = 1,
               voice_queue: int = 4, request_workers: int = 4, request_queue: int = 512,
               realtime_workers: int = 2) -> "Pools":
        return cls(WorkPool("request", request_workers, request_queue),
                   WorkPool("media", media_workers, media_queue, "--media-workers + --media-queue"),
                   WorkPool("voice", voice_workers, voice_queue, "--voice-workers + --voice-queue"),
                   WorkPool("realtime", realtime_workers, 1024, "--realtime-workers"))

    def shutdown(self) -> None:
        for pool in (self.requests, self.media, self.voice, self.realtime):
            pool.shutdown()
