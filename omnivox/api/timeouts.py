"""Deadlines for slow clients: request headers (`--header-timeout`), request bodies
(`--body-timeout`) and idle keep-alive connections (`--keep-alive-timeout`, uvicorn's own).

uvicorn has no deadline for a request's headers: a client that opens a connection and sends
nothing, or one header byte at a time, holds it forever. `protocol_with` returns uvicorn's h11
protocol with one: from the connection's start (and again after each response) the next
request's headers must be complete within `header_timeout` seconds, or the connection is
closed. The body's deadline is the app's (`deadline_receive`): a request whose body has not
fully arrived `body_timeout` seconds after its headers gets 408 and its connection is closed.
"""
from __future__ import annotations

import asyncio
import time

from starlette.types import Message, Receive
from uvicorn.protocols.http.h11_impl import H11Protocol

from omnivox.api.errors import ApiError


def protocol_with(header_timeout: float) -> type[H11Protocol]:
    class TimedH11Protocol(H11Protocol):
        # NOTE: uses uvicorn's h11 protocol internals (cycle, loop, handle_events, on_response_complete);
        # tests/api/test_slow_clients.py fails if a uvicorn release changes them
        _deadline: asyncio.TimerHandle | None = None
        _waiting_for = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.transport.get_protocol() is not self:
                self._disarm()  # upgraded to a WebSocket: the connection is no longer this protocol's
            elif self._deadline is not None and self.cycle is not self._waiting_for:
                self._disarm()  # the awaited request's headers arrived

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.cycle is not None and self.cycle.response_complete:
                self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._waiting_for = self.cycle
            self._deadline = self.loop.call_later(header_timeout, self._too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if self.cycle is self._waiting_for and not self.transport.is_closing():
                self.transport.close()

    return TimedH11Protocol


def deadline_receive(receive: Receive, timeout: float) -> Receive:
    """`receive`, with the whole body due `timeout` seconds from now: 408 past it."""
    deadline = time.monotonic() + timeout
    done = False

    async def wrapped() -> Message:
        nonlocal done
        if done:
            return await receive()
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                message = await receive()
        except asyncio.TimeoutError:
            raise body_timeout_error(timeout) from None
        done = message["type"] != "http.request" or not message.get("more_body", False)
        return message

    return wrapped


def body_timeout_error(timeout: float) -> ApiError:
    return ApiError(408, f"the request body did not arrive within {timeout:g} s (omnivox serve --body-timeout); "
                         "send it faster or in one piece", code="request_timeout", headers={"Connection": "close"})
