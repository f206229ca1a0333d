"""A submitted request as its caller sees it: an iterator of events (sync or async)."""
from __future__ import annotations

import asyncio
import queue
from typing import AsyncIterator, Callable, Iterator

from omnivox.engine.events import Event, Failed, Finished


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

    async def __aiter__(self) -> AsyncIterator[Event]:
        if self._async is None:
            raise RuntimeError("submit(..., loop=asyncio.get_running_loop()) to iterate asynchronously")
        while True:
            ev = await self._async.get()
            yield ev
            if isinstance(ev, (Finished, Failed)):
                return
