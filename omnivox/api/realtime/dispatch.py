"""A session's client events, handled one after another in the order the client sent them (the
socket's reader queues them in an `Inbox` and keeps reading meanwhile), each by the part of the
session it is about, as the session's kind names them (`RealtimeSession.handlers`): the session's
settings and input audio (the session and its kind), the conversation (`conversation.Conversation`),
responses (`response.Responses`). What a
handler refuses it raises (ProtocolError, InputError from the model's checks), answered with an
`error` event (`Outbox.report`): the session goes on.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

from omnivox.api.realtime.inbox import BIG_MESSAGE, Inbox, loads_big
from omnivox.api.realtime.protocol import ProtocolError
from omnivox.errors import OmnivoxError

if TYPE_CHECKING:
    from omnivox.api.realtime.session import RealtimeSession

APPEND = "input_audio_buffer.append"
MAX_APPEND_BATCH = 256  # queued appends handled together (their audio in jobs of PIECE_SAMPLES)


class ClientEvents:
    def __init__(self, session: RealtimeSession):
        self.session, self.out = session, session.out
        self.handlers = session.handlers()  # client event type -> what handles it (the session's kind says)

    async def handle(self, inbox: Inbox) -> None:
        """Client events in order until the inbox closes (the reader saw the client go away); each
        failure is answered with an `error` event. Appends queued behind one another are taken
        together (`on_appends`): a session that fell behind catches up in one worker job."""
        held = None  # an event read while gathering appends, handled next
        while True:
            if held is None:
                message = await inbox.get()
                if message is None:
                    return
                held = (await self._parse(message[0]), message[1])
            (event, read_at), held = held, None
            if not _is_append(event):
                await self._guarded(self._dispatch, event)
                continue
            batch = [(event, read_at)]
            while len(batch) < MAX_APPEND_BATCH and (message := inbox.take_ready()) is not None:
                nxt = (await self._parse(message[0]), message[1])
                if not _is_append(nxt[0]):
                    held = nxt
                    break
                batch.append(nxt)
            await self._guarded(self.session.on_appends, batch)

    async def _parse(self, raw: str | bytes) -> dict | Exception:
        """A client event, or what is wrong with it (answered in its turn)."""
        try:
            if isinstance(raw, bytes):
                raise ProtocolError("send client events as JSON text frames (binary frames are not accepted)",
                                    code="invalid_event")
            event = await self.session.work(loads_big, raw) if len(raw) > BIG_MESSAGE else json.loads(raw)
            if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                raise ProtocolError("a client event is a JSON object with a string `type`", code="invalid_event")
            return event
        except json.JSONDecodeError as e:
            return e
        except ValueError:  # int() of a number past Python's 4,300-digit limit
            return ProtocolError("a number in the message is too long", code="invalid_json")
        except (RecursionError, OmnivoxError) as e:
            return e

    async def _dispatch(self, event: dict | Exception) -> None:
        if isinstance(event, Exception):
            raise event
        handler = self.handlers.get(event["type"])
        if handler is None:
            raise ProtocolError(f"unknown event type {event['type']!r:.80}", param="type", code="unknown_event")
        await handler(event)

    async def _guarded(self, handler, arg) -> None:
        try:
            await handler(arg)
        except Exception as e:
            await self.out.report(e, arg)


def _is_append(event: dict | Exception) -> bool:
    return isinstance(event, dict) and event["type"] == APPEND
