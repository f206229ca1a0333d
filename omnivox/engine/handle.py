"""A submitted request as its caller sees it: an iterator of events (sync or async)."""
from __future__ import annotations

import asyncio
import queue
from typing import AsyncIterator, Callable, Iterator

import numpy as np

from omnivox.engine.events import AudioChunk, Event, Failed, Finished
from omnivox.errors import InputError, OmnivoxError


class RequestHandle:
    """Events arrive from the engine thread. Iterate synchronously (`for ev in handle`) or, when
    submitted with an asyncio loop, asynchronously (`async for ev in handle`). Iteration ends
    after the final `Finished` or `Failed` event."""

    def __init__(self, request_id: str, abort: Callable[[str], None],
                 loop: asyncio.AbstractEventLoop | None = None):
        self.request_id = request_id
        self._abort = abort
        self._loop = loop
        self._sync: queue.Queue[Event] = queue.Queue()
        self._async: asyncio.Queue[Event] | None = asyncio.Queue() if loop is not None else None

    def push(self, event: Event) -> None:  # called from the engine thread
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._async.put_nowait, event)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                pass
        else:
            self._sync.put(event)

    def cancel(self) -> None:
        """Abort the request: its pages and state are freed within one engine step."""
        self._abort(self.request_id)

    def __iter__(self) -> Iterator[Event]:
        if self._loop is not None:
            raise RuntimeError("this handle was submitted for asyncio: use `async for`")
        while True:
            ev = self._sync.get()
            yield ev
            if isinstance(ev, (Finished, Failed)):
                return

    def collect(self) -> tuple[Finished, np.ndarray]:
        """Wait for the end: (the Finished event, all audio chunks joined as float32).
        A Failed request raises InputError (status < 500) or OmnivoxError."""
        chunks = []
        for ev in self:
            if isinstance(ev, AudioChunk):
                chunks.append(ev.samples)
            elif isinstance(ev, Failed):
                raise (InputError if ev.status < 500 else OmnivoxError)(ev.message)
            elif isinstance(ev, Finished):
                audio = np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, dtype=np.float32)
                return ev, audio
        raise OmnivoxError("the request ended without a result")

    async def __aiter__(self) -> AsyncIterator[Event]:
        if self._async is None:
            raise RuntimeError("submit(..., loop=asyncio.get_running_loop()) to iterate asynchronously")
        while True:
            ev = await self._async.get()
            yield ev
            if isinstance(ev, (Finished, Failed)):
                return
