"""What a session tells its client: server events in the session's dialect, each with an event id,
and what went wrong with a client event as an `error` event (the session goes on).
"""
from __future__ import annotations

import json
import traceback
from typing import Any, Awaitable, Callable

from omnivox.api.realtime.metrics import RealtimeMetrics
from omnivox.api.realtime.protocol import Dialect, error_event, new_id
from omnivox.errors import OmnivoxError, message_of


class Outbox:
    """The session's server events (`send` raises ConnectionError once the client is gone). Once
    `closed` (the session ended), nothing more is sent."""

    def __init__(self, send: Callable[[str], Awaitable[None]], dialect: Dialect, metrics: RealtimeMetrics):
        self._send_text, self.dialect, self.metrics = send, dialect, metrics
        self.closed = False

    async def send(self, event: dict[str, Any]) -> None:
        name = self.dialect.name(event["type"])
        if name is None or self.closed:
            return
        event = {"type": name, "event_id": new_id("event"), **{k: v for k, v in event.items() if k != "type"}}
        await self._send_text(json.dumps(event))

    async def error(self, message: str, *, code: str, param: str | None = None, event_id: str | None = None) -> None:
        self.metrics.errors.inc(code=code)
        await self.send(error_event(message, code=code, param=param, event_id=event_id))

    async def tell(self, message: str, *, code: str) -> None:
        """An error event sent from a task of its own (a client gone meanwhile is not an error)."""
        try:
            await self.error(message, code=code)
        except ConnectionError:
            pass

    async def report(self, e: Exception, event: Any) -> None:
        """What went wrong handling `event` (a client event, a batch of (event, read at), or what
        was wrong with a message), as an `error` event naming the event's id."""
        if isinstance(e, ConnectionError):  # the client went away (`send`): nothing to tell, the session ends
            raise e
        if isinstance(e, json.JSONDecodeError):
            await self.error(f"the message is not valid JSON: {e}", code="invalid_json")
        elif isinstance(e, RecursionError):
            await self.error("the message is nested too deeply", code="invalid_json")
        elif isinstance(e, OmnivoxError):  # ProtocolError, InputError (bad audio, options), Overloaded, ...
            code = getattr(e, "code", None) or ("server_overloaded" if getattr(e, "status", 400) == 503
                                                else "invalid_value")
            await self.error(str(e), code=code, param=getattr(e, "param", None), event_id=event_id_of(event))
        else:  # a bug fails this event only: the traceback goes to the log, the session goes on
            traceback.print_exception(e)
            await self.error(message_of(e), code="server_error", event_id=event_id_of(event))


def event_id_of(arg: Any) -> str | None:
    event = arg[0][0] if isinstance(arg, list) else arg
    event_id = event.get("event_id") if isinstance(event, dict) else None
    return event_id if isinstance(event_id, str) else None
