"""A realtime session: client events in order, the conversation, one response at a time. This is
the part both session kinds share; the hub picks the kind once, when the session starts, from the
served model:

  listening.py  `ListeningSession` (a `ChatModel`, Qwen3-Omni): input audio, turns, VAD,
                the next response's open prompt, barge-in, audio items
  speaking.py   `SpeakingSession` (text-to-speech, S2): text items in, speech out; audio input is
                refused with an `error` event (`audio_input_unsupported`)

Client events are handled one after another, in the order the client sent them (the socket's
reader queues them in an `Inbox` and keeps reading meanwhile); the audio work of appends runs in
worker threads, and a response's events are forwarded by their own task meanwhile.

Fair share of the realtime workers (`--realtime-workers`): a session has at most one job in the
pool at a time (`_work`: its events are handled in order, each waiting for its job), and a job
holds at most PIECE_SAMPLES of audio (`ListeningSession.on_appends`). The pool runs jobs first
come, first served, so while a session's long append goes through piece by piece, every other
session's next job runs after at most one piece of it: round-robin between the sessions that have
work.
"""
from __future__ import annotations

import asyncio
import json
import traceback
from abc import ABC, abstractmethod
from dataclasses import replace
from typing import Any, Awaitable, Callable

from omnivox.api.realtime.conversation import Item, ItemSpec, ReplyItem, TextItem, new_id, parse_item
from omnivox.api.realtime.host import SessionHost
from omnivox.api.realtime.inbox import BIG_MESSAGE, Inbox, loads_big
from omnivox.api.realtime.protocol import (BETA, GA, Dialect, Generation, ProtocolError, SessionConfig, error_event,
                                           parse_response_params, parse_session_update, session_json)
from omnivox.api.realtime.response import ResponseRun
from omnivox.engine.handle import RequestHandle
from omnivox.errors import Draining, InputError, OmnivoxError, message_of
from omnivox.serving import MAX_CHARS_PER_TOKEN

APPEND = "input_audio_buffer.append"
MAX_APPEND_BATCH = 256  # queued appends handled together (their audio in jobs of PIECE_SAMPLES)


class RealtimeSession(ABC):
    """One client's session: what both kinds do. A kind fills in the methods under "what the kinds
    fill in" (each says what it owes), on the event loop unless it says otherwise, and may extend
    `close`. What a kind refuses it raises as ProtocolError (InputError from the model's checks),
    and `_report` answers it with an `error` event: the session goes on.
    """

    def __init__(self, host: SessionHost, send: Callable[[str], Awaitable[None]], beta: bool):
        self.host, self._send_text = host, send
        self.dialect: Dialect = BETA if beta else GA
        self.model, self.metrics = host.model, host.metrics
        self.id, self.conversation_id = new_id("sess"), new_id("conv")
        self.loop = asyncio.get_running_loop()
        self.voices = [v.lower() for v in host.model.builtin_voices]
        self.default_voice = host.model.default_voice
        # server VAD on (the kind may drop it); every value within the server's output limits
        self.cfg = SessionConfig(gen=Generation().within(host.output), audio_window_s=host.limits.audio_window_s)
        self.items: list[Item] = []
        self.run: ResponseRun | None = None
        self.closed = False
        self._job = asyncio.Lock()  # one worker job at a time: the fair share (see the module's doc)

    # ---- plumbing -----------------------------------------------------------------------------
    async def send(self, event: dict[str, Any]) -> None:
        name = self.dialect.name(event["type"])
        if name is None or self.closed:
            return
        event = {"type": name, "event_id": new_id("event"), **{k: v for k, v in event.items() if k != "type"}}
        await self._send_text(json.dumps(event))

    async def error(self, message: str, *, code: str, param: str | None = None, event_id: str | None = None) -> None:
        self.metrics.errors.inc(code=code)
        await self.send(error_event(message, code=code, param=param, event_id=event_id))

    async def _tell(self, message: str, *, code: str) -> None:
        """An error event sent from a task of its own (a client gone meanwhile is not an error)."""
        try:
            await self.error(message, code=code)
        except ConnectionError:
            pass

    async def _work(self, fn, *args):
        async with self._job:
            return await self.host.pool.run(fn, *args)

    def previous_id(self, item: Item) -> str | None:
        i = self.items.index(item) if item in self.items else len(self.items)
        return self.items[i - 1].id if i > 0 else None

    def session_json(self) -> dict[str, Any]:
        extra = {"default_voice": self.default_voice, **self._omnivox_json()}
        return session_json(self.id, self.host.served_name, self.cfg, self.dialect, extra)

    @property
    def open_pages(self) -> int:
        """KV pages the session holds while no response of it runs (the hub's turns' share, which
        only a listening session's open prompt takes)."""
        return 0

    # ---- the session's life -------------------------------------------------------------------
    async def start(self) -> None:
        await self.send({"type": "session.created", "session": self.session_json()})
        if self.dialect.beta:
            await self.send({"type": "conversation.created",
                             "conversation": {"id": self.conversation_id, "object": "realtime.conversation"}})

    async def close(self) -> None:
        """The client went away: every engine request of the session is cancelled (pages freed)."""
        self.closed = True
        if self.run is not None:
            self.run.handle.cancel()
            if self.run.task is not None:
                self.run.task.cancel()

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
            await self._guarded(self.on_appends, batch)

    async def _parse(self, raw: str | bytes) -> dict | Exception:
        """A client event, or what is wrong with it (answered in its turn)."""
        try:
            if isinstance(raw, bytes):
                raise ProtocolError("send client events as JSON text frames (binary frames are not accepted)",
                                    code="invalid_event")
            event = await self._work(loads_big, raw) if len(raw) > BIG_MESSAGE else json.loads(raw)
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
        handler = HANDLERS.get(event["type"])
        if handler is None:
            raise ProtocolError(f"unknown event type {event['type']!r:.80}", param="type", code="unknown_event")
        await getattr(self, handler)(event)

    async def _guarded(self, handler, arg) -> None:
        try:
            await handler(arg)
        except Exception as e:
            await self._report(e, event_id_of(arg))

    async def _report(self, e: Exception, event_id: str | None) -> None:
        if isinstance(e, ConnectionError):  # the client went away (`send`): nothing to tell, the session ends
            raise e
        if isinstance(e, json.JSONDecodeError):
            await self.error(f"the message is not valid JSON: {e}", code="invalid_json")
        elif isinstance(e, RecursionError):
            await self.error("the message is nested too deeply", code="invalid_json")
        elif isinstance(e, OmnivoxError):  # ProtocolError, InputError (bad audio, options), Overloaded, ...
            code = getattr(e, "code", None) or ("server_overloaded" if getattr(e, "status", 400) == 503
                                                else "invalid_value")
            await self.error(str(e), code=code, param=getattr(e, "param", None), event_id=event_id)
        else:  # a bug fails this event only: the traceback goes to the log, the session goes on
            traceback.print_exception(e)
            await self.error(message_of(e), code="server_error", event_id=event_id)

    # ---- session.update -----------------------------------------------------------------------
    async def on_session_update(self, event: dict) -> None:
        cfg = parse_session_update(event.get("session"), self.cfg, self.voices, self.host.limits.max_window_s)
        cfg = replace(cfg, gen=cfg.gen.within(self.host.output))
        await self._check_generation(cfg.gen, "session")
        self.cfg = self._adopt(cfg)
        await self.send({"type": "session.updated", "session": self.session_json()})
        self._sync()

    # ---- the conversation ---------------------------------------------------------------------
    async def _item_added(self, item: Item) -> None:
        prev = self.previous_id(item)
        await self.send({"type": "conversation.item.added", "previous_item_id": prev, "item": item.to_json(self.dialect)})
        await self.send({"type": "conversation.item.done", "previous_item_id": prev, "item": item.to_json(self.dialect)})

    def _find(self, item_id: Any, param: str = "item_id") -> Item:
        for it in self.items:
            if it.id == item_id:
                return it
        raise ProtocolError(f"no conversation item {item_id!r:.80}", param=param, code="item_not_found")

    async def on_item_create(self, event: dict) -> None:
        spec = parse_item(event.get("item"), {it.id for it in self.items})
        if spec.audio is None:
            self._check_text(spec.text, "item.content")
            item: Item = TextItem(spec.id, spec.role, text=spec.text, ids=await self._text_ids(spec.text))
        else:
            item = await self._audio_item(spec)
        self._insert(item, event.get("previous_item_id"))
        await self._item_added(item)
        self._sync()

    def _insert(self, item: Item, previous: Any) -> None:
        if previous is None:
            self.items.append(item)
        elif previous == "root":
            self.items.insert(0, item)
        else:
            self.items.insert(self.items.index(self._find(previous, "previous_item_id")) + 1, item)

    async def on_item_truncate(self, event: dict) -> None:
        item = self._find(event.get("item_id"))
        if not isinstance(item, ReplyItem) or not item.audio:
            raise ProtocolError("only an assistant reply with audio can be truncated", param="item_id",
                                code="invalid_item")
        end = event.get("audio_end_ms")
        if isinstance(end, bool) or not isinstance(end, int) or end < 0:
            raise ProtocolError("audio_end_ms must be a non-negative integer", param="audio_end_ms")
        if event.get("content_index", 0) != 0:
            raise ProtocolError("content_index must be 0", param="content_index")
        if self.run is not None and self.run.item is item:  # still speaking: what comes next is unheard
            await self.run.cancel("client_cancelled")
        if end > item.audio_ms:
            raise ProtocolError(f"audio_end_ms {end} is past the end of the item's audio ({item.audio_ms} ms)",
                                param="audio_end_ms")
        item.truncate(end)
        await self.send({"type": "conversation.item.truncated", "item_id": item.id, "content_index": 0,
                         "audio_end_ms": end})
        self._sync()

    async def on_item_delete(self, event: dict) -> None:
        item = self._find(event.get("item_id"))
        if self.run is not None and self.run.item is item:
            raise ProtocolError("the reply of the active response cannot be deleted; cancel the response first",
                                param="item_id")
        self.items.remove(item)
        await self.send({"type": "conversation.item.deleted", "item_id": item.id})
        self._sync()

    async def on_item_retrieve(self, event: dict) -> None:
        item = self._find(event.get("item_id"))
        await self.send({"type": "conversation.item.retrieved", "item": item.to_json(self.dialect)})

    # ---- responses ----------------------------------------------------------------------------
    async def on_response_create(self, event: dict) -> None:
        if self.run is not None:
            raise ProtocolError(f"response {self.run.id} is still in progress: cancel it or wait for response.done",
                                code="conversation_already_has_active_response")
        gen = parse_response_params(event.get("response"), self.cfg.gen, self.voices).within(self.host.output)
        await self._check_generation(gen, "response")
        await self._respond(gen)

    async def on_response_cancel(self, event: dict) -> None:
        run = self.run
        if run is None or (event.get("response_id") not in (None, run.id)):
            raise ProtocolError("there is no response in progress to cancel", code="response_cancel_not_active")
        await run.cancel("client_cancelled")

    async def _respond(self, gen: Generation) -> None:
        if self.model.engine.draining:  # response.create, or a turn's end under server VAD
            raise Draining("server draining: it is shutting down and starts no new response; open a new session "
                           "(a load balancer sends it to another server)")
        handle, audio_tokens, speech_end = await self._request(gen)
        item = ReplyItem(new_id("item"), status="in_progress", audio=gen.audio)
        self.items.append(item)
        run = ResponseRun(self, handle, gen, item, speech_end, audio_tokens)
        self.run = run
        await run.start()
        run.task = asyncio.ensure_future(self._drive(run))

    async def _drive(self, run: ResponseRun) -> None:
        try:
            await run.run()
        except ConnectionError:  # the socket went away mid-send: the request is cancelled by run()
            pass
        except Exception as e:  # a bug ends this response only; its traceback goes to the log
            traceback.print_exception(e)
        finally:
            if self.run is run:
                self.run = None
            self._sync()  # a turn spoken during the response waits for it to end

    async def unsupported(self, event: dict) -> None:
        raise ProtocolError(f"{event['type']} is not supported over WebSocket (WebRTC/SIP only)",
                            code="unsupported_event")

    # ---- checks before work -------------------------------------------------------------------
    def _check_text(self, text: str, param: str) -> None:
        """Refuse text that cannot fit the model's context before anything tokenizes it (the HTTP
        routes' pre-check: at most MAX_CHARS_PER_TOKEN characters per context token)."""
        context = self.model.max_model_len
        if context and len(text) > MAX_CHARS_PER_TOKEN * context:
            raise ProtocolError(f"{param} holds {len(text)} characters, more than can fit the model's context of "
                                f"{context} tokens (at most {MAX_CHARS_PER_TOKEN} characters per token)",
                                param=param, code="input_too_long")

    async def _check_generation(self, gen: Generation, param: str) -> None:
        """Everything a response would refuse in `gen`, refused now: session.update and
        response.create share this, so a session never holds settings its responses cannot use.
        Sizes in characters on the loop; the model's own option checks (sampling ranges, the Talker
        instruction in characters, then tokens) and the tokenizing of the instructions in a worker
        (`_tokenizes`), or at once when nothing needs tokenizing."""
        self._check_text(gen.instructions, f"{param}.instructions")
        try:
            if self._tokenizes(gen):
                await self._work(self._prepare_generation, gen)
            else:  # nothing to tokenize: range checks only, without waiting for a worker
                self._prepare_generation(gen)
        except InputError as e:
            where = e.param if e.param in ("instructions", "voice") else f"omnivox.{e.param}" if e.param else None
            raise ProtocolError(str(e), param=f"{param}.{where}" if where else None,
                                code=e.code or "invalid_value") from None

    def _tokenizes(self, gen: Generation) -> bool:
        """Whether `_prepare_generation(gen)` tokenizes (then it runs in a worker)."""
        return bool(gen.talker_instruction)

    # ---- what the kinds fill in (see the class's doc) -----------------------------------------
    @abstractmethod
    async def on_appends(self, batch: list[tuple[dict, float]]) -> None:
        """Queued `input_audio_buffer.append` events (with when each was read), taken together;
        each one that fails is answered with an `error` event of its own (`_report`)."""

    @abstractmethod
    async def on_commit(self, event: dict) -> None:
        """`input_audio_buffer.commit`."""

    @abstractmethod
    async def on_clear(self, event: dict) -> None:
        """`input_audio_buffer.clear`."""

    @abstractmethod
    async def _text_ids(self, text: str) -> list[int] | None:
        """A user text item's token ids (None: the kind keeps none)."""

    @abstractmethod
    async def _audio_item(self, spec: ItemSpec) -> Item:
        """A user audio item of conversation.item.create."""

    @abstractmethod
    def _adopt(self, cfg: SessionConfig) -> SessionConfig:
        """A checked session.update's settings, applied to the kind's parts; returns what is kept."""

    @abstractmethod
    def _prepare_generation(self, gen: Generation) -> None:
        """The model's checks of `gen` (InputError); a worker thread when `_tokenizes(gen)`."""

    @abstractmethod
    async def _request(self, gen: Generation) -> tuple[RequestHandle, int, float | None]:
        """The engine request of a response now: (its handle, the audio rows in its prompt, when the
        user's speech it answers ended (None: no spoken turn; TTFA's start))."""

    def _sync(self) -> None:
        """Called after each change to the conversation or the settings and after each response:
        keep what the next response reads up to date (nothing to keep by default)."""

    @abstractmethod
    def _omnivox_json(self) -> dict[str, Any]:
        """The kind's fields of session.omnivox (`listens` at least)."""


HANDLERS: dict[str, str] = {  # client event type -> the session's method that handles it
    "session.update": "on_session_update",
    "input_audio_buffer.commit": "on_commit",
    "input_audio_buffer.clear": "on_clear",
    "conversation.item.create": "on_item_create",
    "conversation.item.truncate": "on_item_truncate",
    "conversation.item.delete": "on_item_delete",
    "conversation.item.retrieve": "on_item_retrieve",
    "response.create": "on_response_create",
    "response.cancel": "on_response_cancel",
    "output_audio_buffer.clear": "unsupported",
}


def _is_append(event: dict | Exception) -> bool:
    return isinstance(event, dict) and event["type"] == APPEND


def event_id_of(arg) -> str | None:
    event = arg[0][0] if isinstance(arg, list) else arg
    event_id = event.get("event_id") if isinstance(event, dict) else None
    return event_id if isinstance(event_id, str) else None
