"""A session's socket as the session writes to it: one message at a time, and a client that stops
reading dropped instead of holding its session.

Two ways a server notices such a client, both counted in `omnivox_slow_readers_dropped_total`
(`api="realtime"`, `api="moshi_chat"` for `/api/chat`, as HTTP's streamed replies count with `api="http"`):
  - send_timeout: the socket's write buffer, and the kernel's, hold at most `buffer_bytes`
    (RealtimeLimits' send_buffer_bytes: --realtime-send-buffer-kb, 1024) each before a send waits; a send that waits --realtime-send-timeout-s closes the connection with 1008, the close frame
    written behind what is unsent, and aborts it if the client still reads nothing;
  - keepalive: uvicorn pings the client (--ws-ping-interval, 20 s) and fails the connection with
    1011 when no pong comes within its timeout (20 s): a client that reads nothing reads no ping.
Either way the session's inbox closes, so the session ends and its engine requests are cancelled.
"""
from __future__ import annotations

import asyncio
import socket

from fastapi import WebSocket
from starlette.websockets import WebSocketDisconnect

from omnivox.api.metrics import MetricFamily
from omnivox.api.realtime.inbox import Inbox

ABORT_AFTER_S = 5.0  # at least this long for a dropped slow reader to read its close frame


def close_reason(text: str, limit: int = 123) -> str:
    """`text` cut to a WebSocket close reason's limit (123 bytes of UTF-8)."""
    data = text.encode()
    return text if len(data) <= limit else data[:limit - 3].decode(errors="ignore") + "..."


class Sender:
    """The session's `send` (await it with a message: text, or bytes for a binary one): ConnectionError once the client is
    gone or dropped. `ended()` when the session ends: a client the keepalive dropped meanwhile
    (the session sent nothing since) is counted then."""

    def __init__(self, ws: WebSocket, inbox: Inbox, timeout_s: float, buffer_bytes: int, dropped: MetricFamily,
                 api: str = "realtime"):
        # NOTE: uvicorn's websockets-sansio protocol (its `transport`, `conn`, `close_sent`,
        # `close_timer`, `read_paused`), which the Gate puts in the scope
        self.protocol = ws.scope.get("omnivox.ws_protocol")
        self.transport = getattr(self.protocol, "transport", None)
        if self.transport is not None:  # uvicorn's send waits while more than this is unsent
            self.transport.set_write_buffer_limits(high=buffer_bytes)
            # NOTE: and the kernel's buffer is bounded alike: Linux's autotuning would let it hold
            # up to 4 MiB more (tcp_wmem), all of it unread by a client that stopped reading
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        self.ws, self.inbox, self.counter, self.api = ws, inbox, dropped, api
        self.timeout_s, self.buffer_bytes = timeout_s, buffer_bytes
        self.lock = asyncio.Lock()
        self.dropped = False

    async def __call__(self, message: str | bytes) -> None:
        async with self.lock:
            if self.dropped:
                raise ConnectionError("the client stopped reading")
            try:
                async with asyncio.timeout(self.timeout_s):
                    await (self.ws.send_bytes(message) if isinstance(message, bytes) else self.ws.send_text(message))
            except (WebSocketDisconnect, RuntimeError) as e:  # starlette's ways of saying the client went away
                if self._keepalive_failed():
                    self._drop("keepalive")
                raise ConnectionError("the client went away") from e
            except asyncio.TimeoutError:
                self._drop("keepalive" if self._keepalive_failed() else "send_timeout")
                raise ConnectionError("the client stopped reading") from None

    def ended(self) -> None:
        if not self.dropped and self._keepalive_failed():
            self._drop("keepalive")

    def _keepalive_failed(self) -> bool:
        """Whether uvicorn's keepalive gave up on the client (it sent close 1011, no pong came)."""
        sent = getattr(getattr(self.protocol, "conn", None), "close_sent", None)
        return sent is not None and sent.code == 1011 and "keepalive" in sent.reason

    def _drop(self, reason: str) -> None:
        """Count the client once and close its connection; the inbox closes, the session ends."""
        self.dropped = True
        self.counter.inc(api=self.api, reason=reason)
        self.inbox.close()
        self._close(f"the client read nothing for {self.timeout_s:g} s with over {self.buffer_bytes / 1024:g} KiB unsent "
                    "(--realtime-send-timeout-s)")

    def _close(self, reason: str) -> None:
        """1008 written behind the unsent bytes, as uvicorn's own close does but without its wait
        for the buffer to drain; the client's echo ends the connection, else it is aborted
        ABORT_AFTER_S (or the send timeout) later; a connection closing already (the keepalive's
        1011) is aborted now. NOTE: never `transport.close()` here: client bytes left unread make
        the kernel reset the connection, and the reset discards the close frame the client has not
        read yet."""
        protocol, transport = self.protocol, self.transport
        if transport is None:
            return
        if transport.is_closing() or getattr(protocol, "close_sent", True) or getattr(protocol, "close_timer", 0):
            transport.abort()  # not uvicorn's sans-I/O protocol, or closing already
            return
        protocol.conn.send_close(1008, close_reason(reason))
        transport.write(b"".join(protocol.conn.data_to_send()))
        protocol.close_sent = True
        loop = asyncio.get_running_loop()
        protocol.close_timer = loop.call_later(max(self.timeout_s, ABORT_AFTER_S), transport.abort)
        if getattr(protocol, "read_paused", False):
            protocol.read_paused = False
            transport.resume_reading()
