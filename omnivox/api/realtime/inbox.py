"""The client messages a session has read from its socket and not yet handled.

The socket's reader and the session's handler are two tasks: the reader keeps reading while the
handler works (an append's audio can wait seconds for a worker thread on a busy server), so the
connection's control frames keep flowing (a keepalive pong that queued behind unhandled appends
would close the connection) and the handler finds every append that arrived meanwhile and takes
them in one worker job. Within a byte budget: past it the reader waits, and the client's writes
wait in the socket. A large message is parsed only if it is shaped like a large client event
(`loads_big`).
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from collections import deque
from typing import Any

from omnivox.api.realtime.protocol import ProtocolError

Message = tuple[str | bytes, float]  # a text (or a refused binary) frame, and when it was read
BIG_MESSAGE = 64 * 1024  # larger client messages are parsed in a worker thread (`loads_big`)
MAX_BIG_STRINGS = 4096  # strings in one large message (an append or an item is a few long ones)
STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # one JSON string, escapes included


class Inbox:
    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self._items: deque[Message] = deque()
        self._bytes = 0
        self._closed = False
        self._changed = asyncio.Event()  # set on every change; a waiter re-checks its condition

    async def put(self, data: str | bytes) -> None:
        """Queue a message read now; waits while the queue holds the budget (one message always fits)."""
        read_at = time.monotonic()
        await self._until(lambda: self._closed or not self._items or self._bytes + len(data) <= self.budget)
        if not self._closed:
            self._items.append((data, read_at))
            self._bytes += len(data)
            self._changed.set()

    async def get(self) -> Message | None:
        """The oldest message; None once the inbox is closed (what is left is dropped)."""
        await self._until(lambda: self._closed or self._items)
        return self.take_ready()

    def take_ready(self) -> Message | None:
        """The oldest message if one is queued, without waiting."""
        if self._closed or not self._items:
            return None
        message = self._items.popleft()
        self._bytes -= len(message[0])
        self._changed.set()
        return message

    def close(self) -> None:
        self._closed = True
        self._changed.set()

    async def _until(self, ready) -> None:
        while not ready():
            self._changed.clear()
            await self._changed.wait()


def loads_big(raw: str) -> Any:  # worker thread
    """A large client message, parsed if it is what large client events are: a few long strings
    (base64 audio, text) in a small frame.

    NOTE: json.loads holds the GIL from start to end, so even in a worker it stops the event loop
    (every session, every route) for as long as it runs, and that grows with the count of values,
    not bytes: a 15 MiB message of a million keys takes ~1 s, one long string ~10 ms. The scan that
    counts strings and measures what lies outside them runs at string-scanning speed."""
    quotes = raw.count('"') - raw.count('\\"')  # at most twice the strings: a quick refusal of many
    outside, strings = ("", MAX_BIG_STRINGS + 1) if quotes > 2 * MAX_BIG_STRINGS else STRING.subn("", raw)
    if strings > MAX_BIG_STRINGS or len(outside) > BIG_MESSAGE:
        raise ProtocolError(f"a client event of {len(raw)} characters may hold at most {MAX_BIG_STRINGS} strings and "
                            f"{BIG_MESSAGE} characters outside them (large events carry audio or text in a few long "
                            "strings)", code="invalid_event")
    return json.loads(raw)
